"""The planner against published numbers, and the plan at the EDiT paper's scale.

:func:`published_table` reproduces, from the stated assumptions, the Eager Updates paper's
table of the inter-node bandwidth needed for 50 / 80 / 90 / 95 / 99% compute utilisation
(arXiv 2502.12996; the figures are in ``../shared/docs/beyond-streaming.md``): 1B, 10B and
100B models, step times 0.1 / 0.8 / 4.9 s from the paper's FLOPs rule, H = 100, FP4,
fragments of 3 layers, two replicas. :func:`edit_scale_table` plans Llama 1B to 7B on 64
to 1,024 GPUs. Both tables are in ``docs/planning.md``; ``tests/test_plan.py`` checks
that the page holds what these functions compute now.
"""

from __future__ import annotations

from typing import Any

from editrain.plan.inputs import Cluster, MethodSpec, ModelSpec
from editrain.plan.model import model_shape
from editrain.plan.search import bandwidth_for, search_target

UTILISATIONS = (0.5, 0.8, 0.9, 0.95, 0.99)

# name: (params, layers, dim, step seconds)
PAPER_MODELS = {"1B": (1e9, 24, 2048, 0.1), "10B": (1e10, 48, 4096, 0.8),
                "100B": (1e11, 96, 9216, 4.9)}

# (row, model, method, published Gbit/s at UTILISATIONS)
PUBLISHED: list[tuple[str, str, dict[str, Any], tuple[float, ...]]] = [
    ("1B data-parallel", "1B", {"method": "sync", "grad_overlap": True},
     (86.8, 152.6, 184.2, 222.3, 569.0)),
    ("1B Streaming DiLoCo, no overlap", "1B",
     {"method": "diloco", "H": 100, "codec": "bf16"}, (1.4, 5.2, 9.1, 16.0, 28.1)),
    ("1B 1-inner-step overlap, FP4, H=100", "1B",
     {"method": "diloco", "H": 100, "overlap": 1, "codec": "fp4"}, (0.4, 0.9, 1.7, 2.0, 3.0)),
    ("1B 1-outer-step eager, FP4, H=100", "1B",
     {"method": "diloco", "H": 100, "eager": True, "codec": "fp4"}, (0.1, 0.2, 0.2, 0.2, 0.2)),
    ("10B eager, FP4, H=100", "10B",
     {"method": "diloco", "H": 100, "eager": True, "codec": "fp4"}, (0.1, 0.2, 0.2, 0.3, 0.3)),
    ("100B eager, FP4, H=100", "100B",
     {"method": "diloco", "H": 100, "eager": True, "codec": "fp4"}, (0.2, 0.3, 0.3, 0.3, 0.4)),
]


def paper_setting(model: str, method: dict[str, Any]) -> tuple[Cluster, ModelSpec, MethodSpec]:
    """The cluster, model and method of one row of the paper's table.

    Two replicas (one per node), the paper's step time, no latency, bf16 training;
    fragments of 3 layers for the local methods.

    Args:
        model: ``1B``, ``10B`` or ``100B``.
        method: :class:`MethodSpec` fields.
    """
    params, layers, dim, step_s = PAPER_MODELS[model]
    cluster = Cluster(nodes=2, gpus_per_node=1, inter_node_gbps=1.0, step_time_s=step_s)
    spec = ModelSpec(params=params, layers=layers, dim=dim, dtype="bf16")
    fields = dict(method)
    if fields["method"] != "sync":
        fields["fragments"] = layers // 3
    return cluster, spec, MethodSpec(**fields)


def published_table() -> list[dict[str, Any]]:
    """Every row of the paper's table with the planner's bandwidth per utilisation.

    Returns:
        ``{"row", "published": [...], "predicted": [...], "ratio": [...]}`` per row
        (Gbit/s; ratio = predicted / published).
    """
    out = []
    for row, model, method, published in PUBLISHED:
        cluster, spec, meth = paper_setting(model, method)
        shape = model_shape(spec)
        predicted = [bandwidth_for(cluster, spec, meth, u, shape) for u in UTILISATIONS]
        out.append({"row": row, "published": list(published), "predicted": predicted,
                    "ratio": [None if p is None else p / q for p, q in zip(predicted, published)]})
    return out


def published_table_md() -> str:
    """:func:`published_table` as Markdown: ``predicted (ratio)`` per cell."""
    from editrain.bench.tables import md_table

    rows = []
    for r in published_table():
        cells = [f"{q:g} / {p:.3g} ({x:.2f}x)" if p is not None else f"{q:g} / n/a"
                 for q, p, x in zip(r["published"], r["predicted"], r["ratio"])]
        rows.append([r["row"], *cells])
    return md_table(["model, method (published / predicted Gbit/s (ratio))",
                     *[f"{u:.0%}" for u in UTILISATIONS]], rows)


EDIT_MODELS = ("1b", "3b", "7b")
EDIT_GPUS = (64, 256, 1024)
EDIT_GBPS = (10.0, 25.0, 100.0, 400.0)


def edit_scale_cluster(gpus: int, gbps: float) -> Cluster:
    """The EDiT-scale cluster: A100-80GB nodes of 8 GPUs (312 TFLOP/s bf16 at MFU 0.4,
    NVLink 2,400 Gbit/s per GPU), ``gbps`` between nodes with 0.02 ms latency, a 10%
    straggler spread.

    Args:
        gpus: GPUs in all.
        gbps: inter-node Gbit/s per node.
    """
    return Cluster(nodes=gpus // 8, gpus_per_node=8, gpu_peak_tflops=312.0, mfu=0.4,
                   gpu_memory_gb=80.0, intra_node_gbps=2400.0, inter_node_gbps=gbps,
                   inter_node_latency_ms=0.02, straggler_spread=0.1)


def edit_scale_model(preset: str) -> ModelSpec:
    """The EDiT-scale model: a preset, 2,048-token sequences, 64 per replica (node) per
    step, one per GPU per forward, activation checkpointing."""
    return ModelSpec(preset=preset, seq_len=2048, batch_size=64, micro_batch=1,
                     activation_checkpointing=True)


def edit_scale_plan(target: float = 0.95) -> list[dict[str, Any]]:
    """For every model, GPU count and bandwidth: the cheapest setting of each method
    reaching ``target`` utilisation (sync; edit; blocking and non-blocking aedit).

    Returns:
        One dict per cell: ``model``, ``gpus``, ``gbps``, ``sync``, and per method the
        label and utilisation of the setting found (None when none reaches it).
    """
    bases = [MethodSpec(method="sync", name="sync"), MethodSpec(method="edit", name="edit"),
             MethodSpec(method="aedit", name="aedit"),
             MethodSpec(method="aedit", overlap=1, name="aedit-nb")]
    out = []
    for preset in EDIT_MODELS:
        spec = edit_scale_model(preset)
        shape = model_shape(spec)
        for gpus in EDIT_GPUS:
            for gbps in EDIT_GBPS:
                cluster = edit_scale_cluster(gpus, gbps)
                res = search_target(cluster, spec, bases, target, shape)
                cell: dict[str, Any] = {"model": preset, "gpus": gpus, "gbps": gbps}
                for name, r in res.items():
                    hit = r["found"]
                    cell[name] = None if hit is None else {"label": hit.label,
                                                           "utilisation": hit.utilisation}
                    if name == "sync":
                        cell["sync_utilisation"] = r["best"].utilisation
                out.append(cell)
    return out


def edit_scale_table_md(target: float = 0.95) -> str:
    """:func:`edit_scale_plan` as Markdown."""
    from editrain.bench.tables import md_table

    def show(hit: dict[str, Any] | None) -> str:
        if hit is None:
            return "none"
        label = hit["label"].split(" ", 1)
        return (label[1] if len(label) > 1 else label[0]) + f" ({hit['utilisation']:.3f})"

    rows = [[c["model"], c["gpus"], f"{c['gbps']:g}", f"{c['sync_utilisation']:.3f}",
             show(c["edit"]), show(c["aedit"]), show(c["aedit-nb"])]
            for c in edit_scale_plan(target)]
    return md_table(["model", "GPUs", "Gbit/s", "sync utilisation",
                     f"edit: cheapest for {target:.0%}", "aedit (blocking)",
                     "aedit non-blocking"], rows)


__all__ = ["EDIT_GBPS", "EDIT_GPUS", "EDIT_MODELS", "PUBLISHED", "UTILISATIONS",
           "edit_scale_plan", "edit_scale_table_md", "paper_setting", "published_table",
           "published_table_md"]
