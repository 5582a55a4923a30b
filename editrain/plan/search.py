"""Searches over the job model: the cheapest setting for a target, the bandwidth it needs.

"Cheapest" orders settings by what they cost the training, not the cluster: first the
fewest inner steps per round (``H``: the loss grows with it), then the least overlap
(staler merges), then the widest codec (less rounding), then the fewest fragments. The
first setting in that order that reaches the target wins; ``sync`` (no local steps at all)
comes before every local setting.

Where no dense setting reaches the target, the slow-link settings come last, H by H: the
sparse 2-bit codec (``topk2``, 1/128 of the fp32 bytes) behind ``H - 1`` steps with the
local progress kept (``examples/configs/very_slow_link.toml``: the setting the committed
benchmarks show best on the slowest links, see ``docs/streaming.md``), then ``topk2``
with the eager merge, which gives the round one step more (a whole round in flight).
They come last because the sparse codec costs loss at equal tokens (the convergence
benchmarks).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from editrain.errors import ConfigError
from editrain.plan.inputs import Cluster, MethodSpec, ModelSpec
from editrain.plan.model import Prediction, Shape, model_shape, predict

H_GRID = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
OVERLAP_GRID = (0, 1, 2, 4, 8)
CODEC_ORDER = ("fp32", "bf16", "int8", "int4")
FRAGMENT_GRID = (1, 2, 4, 8, 16)
SLOW_LINK_CODEC = "topk2"
"""The codec of the slow-link settings tried after every dense one."""


def candidates(base: MethodSpec, n_units: int, h_grid: Iterable[int] = H_GRID,
               overlap_grid: Iterable[int] = OVERLAP_GRID,
               codecs: Iterable[str] = CODEC_ORDER,
               fragment_grid: Iterable[int] = FRAGMENT_GRID,
               slow_link: bool = True) -> list[MethodSpec]:
    """The settings the search tries, cheapest first (see the module docstring).

    Args:
        base: the method (edit, diloco, aedit...) and its fixed options.
        n_units: the model's sync units (fragments cannot exceed them).
        h_grid: values of H.
        overlap_grid: values of overlap (only those below H).
        codecs: codecs, widest first.
        fragment_grid: fragment counts.
        slow_link: append the slow-link settings (edit and diloco, not under ``--ft``):
            per H, ``topk2`` behind ``H - 1`` steps, then ``topk2`` with the eager merge.
    """
    h_grid = tuple(h_grid)
    out = []
    for H in h_grid:
        for tau in overlap_grid:
            # aedit's overlap picks the kind (blocking or not): the search keeps it.
            if tau >= H or (base.method == "aedit" and (tau > 0) != (base.overlap > 0)):
                continue
            for codec in codecs:
                for P in fragment_grid:
                    if P > min(H, n_units) or (base.method == "aedit" and P > 1):
                        continue
                    out.append(dataclasses.replace(base, H=H, overlap=tau, codec=codec,
                                                   fragments=P, name=None))
    if slow_link and base.method in ("edit", "diloco") and not base.ft:
        for H in h_grid:
            if H > 1:
                out.append(dataclasses.replace(base, H=H, overlap=H - 1,
                                               codec=SLOW_LINK_CODEC, fragments=1,
                                               eager=False, name=None))
            out.append(dataclasses.replace(base, H=H, overlap=H, codec=SLOW_LINK_CODEC,
                                           fragments=1, eager=True, name=None))
    return out


def search_target(cluster: Cluster, spec: ModelSpec, bases: list[MethodSpec], target: float,
                  shape: Shape | None = None) -> dict[str, Any]:
    """The cheapest setting reaching ``target`` utilisation, per base method.

    Args:
        cluster: the cluster.
        spec: the model.
        bases: the methods to search (their H, overlap, codec, fragments are searched).
        target: utilisation to reach, in (0, 1].

    Returns:
        ``{label of base: {"found": Prediction or None, "tried": int, "best": Prediction}}``
        where ``best`` is the highest-utilisation setting tried.
    """
    if not 0 < target <= 1:
        raise ConfigError(f"plan --target: must be in (0, 1], got {target}")
    shape = shape or model_shape(spec)
    out: dict[str, Any] = {}
    for base in bases:
        if base.method == "sync":
            pred = predict(cluster, spec, base, shape)
            out[base.name or base.method] = {"found": pred if pred.utilisation >= target else None,
                               "tried": 1, "best": pred}
            continue
        best: Prediction | None = None
        found = None
        tried = 0
        for cand in candidates(base, len(shape.units)):
            tried += 1
            pred = predict(cluster, spec, cand, shape, check_memory=False)
            if best is None or pred.utilisation > best.utilisation + 1e-12:
                best = pred
            # A non-blocking round that takes longer than its window merges less often
            # than every H steps: that is not the H it claims.
            if pred.utilisation >= target and pred.staleness_steps <= cand.H:
                found = predict(cluster, spec, cand, shape)  # now with the memory check
                break
        out[base.name or base.method] = {"found": found, "tried": tried, "best": best}
    return out


def bandwidth_for(cluster: Cluster, spec: ModelSpec, method: MethodSpec, target: float,
                  shape: Shape | None = None, lo_gbps: float = 1e-4,
                  hi_gbps: float = 1e5) -> float | None:
    """The least inter-node bandwidth (Gbit/s) at which ``method`` reaches ``target``
    utilisation, by bisection in log space (utilisation grows with bandwidth).

    Args:
        cluster: the cluster (its bandwidth is replaced).
        spec: the model.
        method: the setting.
        target: utilisation in (0, 1].
        shape: the model's shape.
        lo_gbps: lowest bandwidth tried.
        hi_gbps: highest bandwidth tried.

    Returns:
        Gbit/s within 0.5%, or None when even ``hi_gbps`` does not reach the target.
    """
    shape = shape or model_shape(spec)

    def util(gbps: float) -> float:
        return predict(cluster.with_(inter_node_gbps=gbps), spec, method, shape,
                       check_memory=False).utilisation

    if util(hi_gbps) < target:
        return None
    if util(lo_gbps) >= target:
        return lo_gbps
    lo, hi = math.log(lo_gbps), math.log(hi_gbps)
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        if util(math.exp(mid)) >= target:
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


def utilisation_curve(cluster: Cluster, spec: ModelSpec, method: MethodSpec,
                      gbps: Iterable[float], shape: Shape | None = None) -> list[float]:
    """Utilisation of ``method`` at each inter-node bandwidth in ``gbps``."""
    shape = shape or model_shape(spec)
    return [predict(cluster.with_(inter_node_gbps=g), spec, method, shape,
                    check_memory=False).utilisation for g in gbps]


__all__ = ["CODEC_ORDER", "FRAGMENT_GRID", "H_GRID", "OVERLAP_GRID", "bandwidth_for",
           "candidates", "search_target", "utilisation_curve"]
