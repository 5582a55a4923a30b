"""Memory: extra bytes per rank held by the outer state (anchors + outer optimizer).

DiLoCo as published keeps a full copy of the model (the anchor) and of the outer
optimizer's state on every worker. editrain keeps both per FSDP2 shard, so a rank holds
``1 / S`` of them, and ``cpu_offload`` moves them off the accelerator. The numbers here are
real allocations: each shard size is a spawned gloo process group in which the model is
built with the public API a user calls (``editrain.parallelize``: FSDP2 on the ``"shard"``
mesh dimension; ``editrain.edit``: the :class:`~editrain.sync.SyncEngine`), trained for
one step and synced once; then ``engine.extra_memory()`` counts the bytes of the anchor
and outer-state tensors.
"""

from __future__ import annotations

import time
from typing import Any

from editrain.bench.plots import pyplot, save_figure
from editrain.bench.prose import fill, prose
from editrain.bench.scenario import Ctx, Scenario, Table, Verdict
from editrain.bench.tables import entry_cell, fmt_bytes
from editrain.spawn import run_ranks
from editrain.sync.methods import OUTER_SGD

NESTEROV = {"outer_optim_kwargs": dict(OUTER_SGD["diloco"])}
"""DiLoCo's outer optimizer, pinned for ``edit`` too, so that both hold anchor and momentum
(EDiT's default outer SGD has no momentum and holds the anchor only: half of it)."""
VARIANTS: dict[str, dict[str, Any]] = {
    "diloco": {"method": "diloco"},
    "edit": {"method": "edit", **NESTEROV},
    "edit+cpu_offload": {"method": "edit", "cpu_offload": True, **NESTEROV},
}

TEXT = prose("memory")


def measure_rank(rank: int, world: int, presets: list[str]) -> list[dict[str, Any]]:
    """On every rank of an initialised process group (1 replica x ``world`` shards; called by
    :func:`~editrain.spawn.run_ranks`): build, shard, sync once and count the outer state,
    for every preset and variant."""
    import torch

    import editrain
    from editrain.models import Llama, causal_lm_loss, preset_config
    from editrain.sync.outer import local_view

    info = editrain.init_mesh(shard_size=world, backend="gloo", device_type="cpu")
    out = []
    for preset in presets:
        mcfg = preset_config(preset)
        for variant, sync_kwargs in VARIANTS.items():
            # Built the way a user builds it: the public parallelize() and edit().
            model = Llama(mcfg, seed=0)
            blocks = editrain.parallelize(model, info, model.blocks())
            engine = editrain.edit(model, info, editrain.SyncConfig(local_sgd_sync_interval=1,
                                                                    **sync_kwargs),
                                   blocks=blocks)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            gen = torch.Generator().manual_seed(0)
            x = torch.randint(0, mcfg.vocab_size, (2, 17), generator=gen)
            causal_lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            engine.after_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            engine.step()  # H = 1: the sync is due now (blocking, or armed for layer-wise)
            engine.finish()  # runs an armed layer-wise sync
            extra = engine.extra_memory()
            local = sum(local_view(p).numel() * local_view(p).element_size()
                        for p in model.parameters())
            offloaded = all(u.anchor is None or not u.cpu_offload or
                            u.anchor.device.type == "cpu" for u in engine.units)
            out.append({"preset": preset, "variant": variant, "extra": extra,
                        "extra_total": sum(extra.values()), "local_param_bytes": local,
                        "model_param_bytes": sum(p.numel() * p.element_size()
                                                 for p in model.parameters()),
                        "syncs": engine.num_syncs, "anchors_on_cpu": offloaded})
            engine.close()
            del engine, model, opt
    return out


def _spawn(world: int, presets: list[str]) -> list[list[dict[str, Any]]]:
    """Every rank's rows of :func:`measure_rank` on ``world`` spawned processes."""
    return run_ranks(measure_rank, world, presets)


def _results(ctx: Ctx) -> dict[str, Any]:
    """Every shard size's spawned measurement (a failed one keeps the others' numbers)."""
    bench, errors = ctx.bench, ctx.errors
    if bench.user_overrides:
        bench.log("note: training options from the command line do not apply here (no "
                  "training runs; the presets' own shapes are measured)")
    measured: dict[int, list[list[dict[str, Any]]]] = {}
    for s in ctx.shard_sizes:
        t0 = time.perf_counter()
        try:
            measured[s] = _spawn(s, ctx.presets)
            bench.log(f"shard size {s}: measured in {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # keep the other shard sizes' numbers
            errors[s] = f"{type(e).__name__}: {e}"
            bench.log(f"shard size {s}: FAILED: {errors[s]}")
    results: dict[str, Any] = {}
    for preset in ctx.presets:
        full = _per_rank(measured.get(1), preset, "diloco").get("max")
        by_shard = {str(s): _by_shard(measured[s], preset, full, s) if s in measured
                    else {"error": errors.get(s)} for s in ctx.shard_sizes}
        results[preset] = {"full_copy_bytes": full, "by_shard": by_shard}
    return results


def _by_shard(measured: list[list[dict[str, Any]]], preset: str, full: int | None,
              s: int) -> dict[str, Any]:
    """The numbers of one preset at shard size ``s`` (``full``: the full copy's bytes)."""
    d, e, o = (_per_rank(measured, preset, v) for v in VARIANTS)
    expected = full / s if full else None
    return {"ranks": s, "editrain_diloco_bytes_per_rank": d.get("max"),
            "edit_bytes_per_rank": e.get("max"), "edit_bytes_per_rank_min": e.get("min"),
            "edit_cpu_offload_bytes_per_rank": o.get("max"),
            "edit_by_device": e.get("by_device"), "edit_cpu_offload_by_device": o.get("by_device"),
            "local_param_bytes": e.get("params"), "expected_full_over_s": expected,
            "edit_over_expected": e["max"] / expected if e and expected else None,
            "syncs": e.get("syncs")}


def _rows(ctx: Ctx) -> list[tuple[str, dict[str, Any]]]:
    """``(preset, entry)`` of every measured shard size (entry: ``full`` added)."""
    return [(p, {**e, "full": ctx.results[p]["full_copy_bytes"]}) for p in ctx.presets
            for e in ctx.results[p]["by_shard"].values() if "ranks" in e]



def _per_rank(measured: list[list[dict[str, Any]]] | None, preset: str,
              variant: str) -> dict[str, Any]:
    """Largest / smallest extra bytes over ranks of one preset and variant (empty when
    not measured)."""
    rows = [r for rank_rows in measured or [] for r in rank_rows
            if r["preset"] == preset and r["variant"] == variant]
    if not rows:
        return {}
    by_device: dict[str, int] = {}
    for r in rows:
        for k, v in r["extra"].items():
            by_device[k] = max(by_device.get(k, 0), v)
    return {"max": max(r["extra_total"] for r in rows),
            "min": min(r["extra_total"] for r in rows),
            "params": max(r["local_param_bytes"] for r in rows),
            "by_device": by_device, "syncs": min(r["syncs"] for r in rows)}


def _judge(ctx: Ctx) -> Verdict:
    """The target check (edit = full copy / S) and the findings."""
    checks, findings = [], []
    for preset in ctx.presets:
        full = ctx.results[preset]["full_copy_bytes"]
        for s in ctx.shard_sizes:
            e = ctx.results[preset]["by_shard"].get(str(s), {})
            if e.get("edit_over_expected") is not None:
                checks.append((preset, s, e["edit_over_expected"]))
            edit = e.get("edit_bytes_per_rank")
            if edit and full:
                findings.append(fill(TEXT["finding"], preset=preset, s=s, full=fmt_bytes(full),
                                     edit=fmt_bytes(edit), smaller=full / edit,
                                     over_shard=edit / e["local_param_bytes"]))
    met = all(abs(r - 1.0) <= 0.05 for _, _, r in checks) if checks else None
    detail = "; ".join(f"{p} S={s}: {r:.3f}" for p, s, r in checks) or "no measurements"
    return Verdict(targets=[{"name": TEXT["target"], "met": met, "detail": detail}],
                   findings=findings)


def _mib_by_shard(by_shard: dict[str, Any], xs: list[int], key: str) -> list[float]:
    """MiB of ``key`` at each shard size (NaN, a gap in the line, where not measured)."""
    values = [by_shard.get(str(s), {}).get(key) for s in xs]
    return [float("nan") if v is None else v / 2**20 for v in values]


def _plot(ctx: Ctx):
    """MiB per rank against the shard size, one panel per preset."""
    xs, presets = list(ctx.shard_sizes), ctx.presets
    fig, axes = pyplot().subplots(1, len(presets), figsize=(5 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        full, by_shard = ctx.results[preset]["full_copy_bytes"], ctx.results[preset]["by_shard"]
        ax.plot(xs, _mib_by_shard(by_shard, xs, "edit_bytes_per_rank"), marker="o",
                label="edit (sharded), on the parameters' device")
        ax.plot(xs, _mib_by_shard(by_shard, xs, "edit_cpu_offload_bytes_per_rank"), marker="x",
                linestyle="none", markersize=9, label="edit + cpu_offload (offloaded)")
        if full:
            ax.plot(xs, [full / 2**20] * len(xs), linestyle="--", color="gray",
                    label="DiLoCo-style full copy")
            ax.plot(xs, [full / s / 2**20 for s in xs], linestyle=":", color="black",
                    label="full copy / S")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(s) for s in xs])
        ax.set(xlabel="shard size S", ylabel="MiB per rank", title=preset)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return save_figure(fig, ctx.bench.out_dir / "outer_state_per_rank.png")


SCENARIO = Scenario(
    name="memory",
    description=TEXT["description"],
    setup=lambda bench: {"shard_sizes": bench.pick((1, 2), (1, 2, 4), (1, 2, 4)),
                         "presets": bench.pick(["tiny"], ["tiny", "small"], ["tiny", "small"]),
                         "errors": {}},
    runs=lambda ctx: [],  # no training runs: spawned process groups measure (``measure``)
    measure=_results, judge=_judge, plots=[_plot], notes=lambda ctx: TEXT["notes"],
    size_caveat=False, methods=lambda ctx: list(VARIANTS),
    tables=[Table("Outer state per rank", [
        ("preset", None), ("shard size S", "ranks"),
        ("DiLoCo-style full copy (per rank)", entry_cell("full", fmt_bytes)),
        ("edit, on the parameters' device", entry_cell("edit_bytes_per_rank", fmt_bytes)),
        ("edit + cpu_offload, offloaded", entry_cell("edit_cpu_offload_bytes_per_rank", fmt_bytes)),
        ("editrain diloco (sharded too)", entry_cell("editrain_diloco_bytes_per_rank", fmt_bytes)),
        ("full copy / S", entry_cell("expected_full_over_s", fmt_bytes)),
        ("edit / (full / S)", "edit_over_expected"),
        ("parameter shard", entry_cell("local_param_bytes", fmt_bytes))], rows=_rows)],
    settings=lambda ctx: {"shard_sizes": list(ctx.shard_sizes), "presets": ctx.presets,
                          "errors": ctx.errors},
)
