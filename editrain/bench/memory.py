"""Memory: extra bytes per rank held by the outer state (anchors + outer optimizer).

DiLoCo as published keeps a full copy of the model (the anchor) and of the outer
optimizer's state on every worker. editrain keeps both per FSDP2 shard, so a rank holds
``1 / S`` of them, and ``cpu_offload`` moves them off the accelerator. The numbers here are
real allocations: each shard size is a spawned gloo process group in which the model is
built with the public API a user calls (``editrain.parallelize``: FSDP2 on the ``"shard"``
mesh dimension; ``editrain.edit``: the :class:`~editrain.sync.SyncEngine`), trained for one step and synced once; then
``engine.extra_memory()`` counts the bytes of the anchor and outer-state tensors.
"""

from __future__ import annotations

from typing import Any

from editrain.bench.plots import pyplot, save_figure
from editrain.bench.prose import fill, prose
from editrain.bench.scenario import Ctx, Scenario, Table, Verdict
from editrain.bench.tables import fmt_bytes
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


def measure_rank(presets: list[str]) -> list[dict[str, Any]]:
    """On every rank of an initialised process group (1 replica x world shards): build,
    shard, sync once and count the outer state, for every preset and variant."""
    import torch

    import editrain
    from editrain.models import Llama, causal_lm_loss, preset_config
    from editrain.sync.outer import local_view

    info = editrain.init_mesh(shard_size=torch.distributed.get_world_size(), backend="gloo",
                              device_type="cpu")
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
            syncs = engine.num_syncs
            local = sum(local_view(p).numel() * local_view(p).element_size()
                        for p in model.parameters())
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            offloaded = all(u.anchor is None or not u.cpu_offload or
                            u.anchor.device.type == "cpu" for u in engine.units)
            engine.close()
            out.append({"preset": preset, "variant": variant, "extra": extra,
                        "extra_total": sum(extra.values()), "local_param_bytes": local,
                        "model_param_bytes": total, "syncs": syncs,
                        "anchors_on_cpu": offloaded})
            del engine, model, opt
    return out


def _measure(rank: int, world: int, presets: list[str]) -> list[dict[str, Any]]:
    """Spawned rank: :func:`measure_rank` (the signature :func:`run_ranks` calls)."""
    return measure_rank(presets)


def _spawn(world: int, presets: list[str]) -> list[list[dict[str, Any]]]:
    """Run :func:`measure_rank` on ``world`` spawned processes; every rank's rows."""
    return run_ranks(_measure, world, presets)


def _results(ctx: Ctx) -> dict[str, Any]:
    """Every shard size's spawned measurement (a failed one keeps the others' numbers)."""
    import time

    bench, shard_sizes, presets = ctx.bench, ctx.shard_sizes, ctx.presets
    if bench.user_overrides:
        bench.log("note: training options from the command line do not apply here (no "
                  "training runs; the presets' own shapes are measured)")
    measured: dict[int, list[list[dict[str, Any]]]] = {}
    errors = ctx.errors
    for s in shard_sizes:
        t0 = time.perf_counter()
        try:
            measured[s] = _spawn(s, presets)
            bench.log(f"shard size {s}: measured in {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # keep the other shard sizes' numbers
            errors[s] = f"{type(e).__name__}: {e}"
            bench.log(f"shard size {s}: FAILED: {errors[s]}")
    results: dict[str, Any] = {}
    for preset in presets:
        full = _per_rank(measured.get(1), preset, "diloco")
        results[preset] = {"full_copy_bytes": full["max"] if full else None, "by_shard": {}}
        for s in shard_sizes:
            if s not in measured:
                results[preset]["by_shard"][str(s)] = {"error": errors.get(s)}
                continue
            d, e, o = (_per_rank(measured[s], preset, v) for v in VARIANTS)
            expected = full["max"] / s if full else None
            results[preset]["by_shard"][str(s)] = {
                "ranks": s,
                "editrain_diloco_bytes_per_rank": d["max"] if d else None,
                "edit_bytes_per_rank": e["max"] if e else None,
                "edit_bytes_per_rank_min": e["min"] if e else None,
                "edit_cpu_offload_bytes_per_rank": o["max"] if o else None,
                "edit_by_device": e["by_device"] if e else None,
                "edit_cpu_offload_by_device": o["by_device"] if o else None,
                "local_param_bytes": e["params"] if e else None,
                "expected_full_over_s": expected,
                "edit_over_expected": (e["max"] / expected) if e and expected else None,
                "syncs": e["syncs"] if e else None,
            }
    return results


def _rows(ctx: Ctx) -> list[tuple[str, dict[str, Any]]]:
    """``(preset, entry)`` of every measured shard size (entry: ``full`` added)."""
    return [(p, {**e, "full": ctx.results[p]["full_copy_bytes"]}) for p in ctx.presets
            for e in ctx.results[p]["by_shard"].values() if "ranks" in e]


def _mib(key: str):
    return lambda row: fmt_bytes(row[1][key])


NOTES = TEXT["notes"]
"""How the numbers were measured (the record's notes)."""


def _per_rank(measured: list[list[dict[str, Any]]] | None, preset: str,
              variant: str) -> dict[str, Any] | None:
    """Largest / smallest extra bytes over ranks of one preset and variant."""
    if not measured:
        return None
    rows = [r for rank_rows in measured for r in rank_rows
            if r["preset"] == preset and r["variant"] == variant]
    if not rows:
        return None
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
    results, presets, shard_sizes = ctx.results, ctx.presets, ctx.shard_sizes
    checks, findings = [], []
    for preset in presets:
        for s in shard_sizes:
            e = results[preset]["by_shard"].get(str(s), {})
            r = e.get("edit_over_expected")
            if r is not None:
                checks.append((preset, s, r))
            if e.get("edit_bytes_per_rank") and results[preset]["full_copy_bytes"]:
                full = results[preset]["full_copy_bytes"]
                findings.append(fill(TEXT["finding"], preset=preset, s=s, full=fmt_bytes(full),
                                     edit=fmt_bytes(e["edit_bytes_per_rank"]),
                                     smaller=full / e["edit_bytes_per_rank"],
                                     over_shard=e["edit_bytes_per_rank"]
                                     / e["local_param_bytes"]))
    met = all(abs(r - 1.0) <= 0.05 for _, _, r in checks) if checks else None
    detail = "; ".join(f"{p} S={s}: {r:.3f}" for p, s, r in checks) or "no measurements"
    return Verdict(targets=[{"name": TEXT["target"], "met": met, "detail": detail}],
                   findings=findings)


def _plot(ctx: Ctx):
    """MiB per rank against the shard size, one panel per preset."""
    results, presets, shard_sizes = ctx.results, ctx.presets, ctx.shard_sizes
    plt = pyplot()
    fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        full = results[preset]["full_copy_bytes"]
        xs = list(shard_sizes)
        edit = [results[preset]["by_shard"].get(str(s), {}).get("edit_bytes_per_rank")
                for s in xs]
        offload = [results[preset]["by_shard"].get(str(s), {}).get(
            "edit_cpu_offload_bytes_per_rank") for s in xs]
        ax.plot(xs, [float("nan") if v is None else v / 2**20 for v in edit], marker="o",
                label="edit (sharded), on the parameters' device")
        ax.plot(xs, [float("nan") if v is None else v / 2**20 for v in offload], marker="x",
                linestyle="none", markersize=9, label="edit + cpu_offload (offloaded)")
        if full:
            ax.plot(xs, [full / 2**20] * len(xs), linestyle="--", color="gray",
                    label="DiLoCo-style full copy")
            ax.plot(xs, [full / s / 2**20 for s in xs], linestyle=":", color="black",
                    label="full copy / S")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(s) for s in xs])
        ax.set_xlabel("shard size S")
        ax.set_ylabel("MiB per rank")
        ax.set_ylim(bottom=0)
        ax.set_title(preset)
        ax.grid(alpha=0.3)
    return save_figure(fig, ctx.bench.out_dir / "outer_state_per_rank.png")


SCENARIO = Scenario(
    name="memory",
    description=TEXT["description"],
    setup=lambda bench: {"shard_sizes": bench.pick((1, 2), (1, 2, 4), (1, 2, 4)),
                         "presets": bench.pick(["tiny"], ["tiny", "small"], ["tiny", "small"]),
                         "errors": {}},
    runs=lambda ctx: [],  # no training runs: spawned process groups measure (``measure``)
    measure=_results, judge=_judge, plots=[_plot], notes=lambda ctx: NOTES,
    size_caveat=False, methods=lambda ctx: list(VARIANTS),
    tables=[Table("Outer state per rank", [
        ("preset", None), ("shard size S", "ranks"),
        ("DiLoCo-style full copy (per rank)", lambda row: None if row[1]["full"] is None
         else fmt_bytes(row[1]["full"])),
        ("edit, on the parameters' device", _mib("edit_bytes_per_rank")),
        ("edit + cpu_offload, offloaded", _mib("edit_cpu_offload_bytes_per_rank")),
        ("editrain diloco (sharded too)", _mib("editrain_diloco_bytes_per_rank")),
        ("full copy / S", _mib("expected_full_over_s")),
        ("edit / (full / S)", "edit_over_expected"),
        ("parameter shard", _mib("local_param_bytes"))], rows=_rows)],
    settings=lambda ctx: {"shard_sizes": list(ctx.shard_sizes), "presets": ctx.presets,
                          "errors": ctx.errors},
)
