"""Single-process reference simulator of the algorithm (edit-algorithm.md section 5).

R model replicas live in one process, unsharded. Every formula is written out plainly, in
float64 where it matters, with no code shared with ``editrain.sync`` except the model.
The distributed engine with R x S processes must match it.

Also holds the shared pieces of the distributed-vs-reference tests: the tiny model, the
deterministic per-rank batches and the distributed worker.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from editrain.models import Llama, LlamaConfig, causal_lm_loss

MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
             max_seq_len=32)
SEQ, BATCH = 16, 2


def make_model() -> Llama:
    return Llama(LlamaConfig(**MODEL), seed=0)


def batch(global_rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * global_rank + 1009 * step + micro)
    return torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1), generator=g)


def loss_on(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(model(x[:, :-1]), x[:, 1:])


def make_inner(params, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def units_of(model: Llama) -> list[list[nn.Parameter]]:
    in_blocks = {id(p) for b in model.layers for p in b.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    return [root] + [list(b.parameters()) for b in model.layers]


# ---------------------------------------------------------------------------- detector
class RefDetector:
    """Section 6, written plainly."""

    def __init__(self, alpha: float, warmup: int, threshold: float) -> None:
        self.alpha, self.warmup, self.threshold = alpha, warmup, threshold
        self.mean = self.var = 0.0
        self.count = 0
        self.window: list[float] = []

    def z(self, v: float) -> float:
        if self.count < self.warmup or self.var == 0:
            return 0.0
        return (v - self.mean) / math.sqrt(self.var)

    def update(self, v: float) -> None:
        self.count += 1
        d = v - self.mean
        self.mean += self.alpha * d
        self.var = (1 - self.alpha) * (self.var + self.alpha * d * (v - self.mean))
        self.window.append(self.z(v))
        self.window = self.window[-self.warmup:] if self.warmup else []

    def outlier(self, v: float) -> bool:
        if self.count < self.warmup:
            return False
        w = self.window
        std = 1.0
        if w:
            m = sum(w) / len(w)
            std = math.sqrt(sum((x - m) ** 2 for x in w) / len(w))
        return self.z(v) > self.threshold * max(1.0, std)


# ---------------------------------------------------------------------------- simulator
@dataclass
class RefConfig:
    R: int
    S: int
    steps: int
    H: int = 3
    warmup: int = 0
    accum: int = 1
    inner: str = "adamw"
    outer: str | None = "sgd"  # None = plain averaging
    outer_kwargs: dict = field(default_factory=lambda: {"lr": 0.7, "momentum": 0.9,
                                                        "nesterov": True})
    sync: bool = False  # the synchronous method
    softmax: bool = False
    temperature: float = 1.0
    skip_anomaly: bool = False
    ewma: tuple = (0.02, 120, 3.0)
    clip: float = 0.0
    schedule: list[int] | None = None  # A-EDiT forced steps per window, per replica
    step_weight_ratio: float = 0.5
    corrupt: dict = field(default_factory=dict)  # sync index -> (replica, scale)


def run_reference(cfg: RefConfig) -> list[dict[str, torch.Tensor]]:
    """Train R replicas for ``cfg.steps`` inner steps (or windows); return each replica's
    final parameters after a final sync if one is pending."""
    base = make_model()
    reps = [copy.deepcopy(base) for _ in range(cfg.R)]
    opts = [make_inner(m.parameters(), cfg.inner) for m in reps]
    n_units = len(units_of(base))
    anchors: list[list[torch.Tensor]] | None = None
    outers: list[torch.optim.Optimizer | None] = []
    dets = [[RefDetector(*cfg.ewma) for _ in range(cfg.R)] for _ in range(n_units)]
    steps = [0] * cfg.R  # per replica global step
    since = [0] * cfg.R
    n_sync = 0

    def make_anchors():
        nonlocal anchors, outers
        anchors = [[p.detach().clone() for p in u] for u in units_of(reps[0])]
        outers = [
            (getattr(torch.optim, {"sgd": "SGD"}[cfg.outer])(a, **cfg.outer_kwargs)
             if cfg.outer else None)
            for a in anchors
        ]

    def grads_of(i: int, t: int) -> list[torch.Tensor]:
        m = reps[i]
        m.zero_grad()
        for s in range(cfg.S):
            for mi in range(cfg.accum):
                (loss_on(m, batch(i * cfg.S + s, t, mi)) / (cfg.S * cfg.accum)).backward()
        return [p.grad.clone() for p in m.parameters()]

    def do_sync(counts: list[int] | None) -> None:
        nonlocal n_sync
        assert anchors is not None
        if n_sync in cfg.corrupt:
            r, scale = cfg.corrupt[n_sync]
            with torch.no_grad():
                for p, a in zip([p for u in units_of(reps[r]) for p in u],
                                [a for u in anchors for a in u]):
                    p.copy_(a + scale * (p - a))
        for u in range(n_units):
            thetas = [units_of(reps[i])[u] for i in range(cfg.R)]
            deltas = [[a.double() - t.detach().double() for a, t in zip(anchors[u], th)]
                      for th in thetas]
            norms = [math.sqrt(sum(float((d * d).sum()) for d in dl)) for dl in deltas]
            inc = [math.isfinite(n) for n in norms]
            if cfg.skip_anomaly:
                for i in range(cfg.R):
                    if not inc[i]:
                        continue
                    det = dets[u][i]
                    flag = det.outlier(norms[i])
                    if flag:
                        det.update(det.mean + det.threshold * math.sqrt(det.var))
                        inc[i] = False
                    else:
                        det.update(norms[i])
            keep = [i for i in range(cfg.R) if inc[i]]
            w = [0.0] * cfg.R
            if keep:
                if cfg.softmax:
                    mx = max(-norms[i] / cfg.temperature for i in keep)
                    e = {i: math.exp(-norms[i] / cfg.temperature - mx) for i in keep}
                    tot = sum(e.values())
                    for i in keep:
                        w[i] = e[i] / tot
                else:
                    for i in keep:
                        w[i] = 1.0 / len(keep)
                if counts is not None:
                    tot = sum(counts[i] for i in keep)
                    for i in keep:
                        s = counts[i] / tot if tot > 0 else 1.0 / len(keep)
                        w[i] = (1 - cfg.step_weight_ratio) * w[i] + cfg.step_weight_ratio * s
            with torch.no_grad():
                if keep:
                    red = [sum(w[i] * deltas[i][k] for i in keep) for k in range(len(anchors[u]))]
                    if cfg.clip:
                        n = math.sqrt(sum(float((r * r).sum()) for r in red))
                        c = min(1.0, cfg.clip / (n + 1e-6))
                        red = [r * c for r in red]
                    if outers[u] is None:
                        for a, r in zip(anchors[u], red):
                            a.sub_(r.float())
                    else:
                        for a, r in zip(anchors[u], red):
                            a.grad = r.float()
                        outers[u].step()
                        for a in anchors[u]:
                            a.grad = None
                for i in range(cfg.R):
                    for p, a in zip(units_of(reps[i])[u], anchors[u]):
                        p.copy_(a)
        n_sync += 1

    if not cfg.sync and cfg.warmup == 0:
        make_anchors()

    t = 0
    total = cfg.steps
    pending = False
    pending_counts: list[int] | None = None
    while t < total:
        if pending:
            do_sync(pending_counts)
            pending = False
        warm = cfg.sync or t < cfg.warmup
        if warm:
            gs = [grads_of(i, t) for i in range(cfg.R)]
            mean = [sum(g[k] for g in gs) / cfg.R for k in range(len(gs[0]))]
            for i in range(cfg.R):
                for p, g in zip(reps[i].parameters(), mean):
                    p.grad = g.clone()
                opts[i].step()
                steps[i] += 1
            t += 1
            if not cfg.sync and t == cfg.warmup:
                make_anchors()
            continue
        if cfg.schedule is None:
            for i in range(cfg.R):
                g = grads_of(i, steps[i])
                for p, gg in zip(reps[i].parameters(), g):
                    p.grad = gg
                opts[i].step()
                steps[i] += 1
                since[i] += 1
            t += 1
            if since[0] >= cfg.H:
                pending, pending_counts = True, None
                since = [0] * cfg.R
        else:
            # One A-EDiT window: replica i does schedule[i] steps, then all sync.
            for i in range(cfg.R):
                for _ in range(cfg.schedule[i]):
                    g = grads_of(i, steps[i])
                    for p, gg in zip(reps[i].parameters(), g):
                        p.grad = gg
                    opts[i].step()
                    steps[i] += 1
            pending, pending_counts = True, list(cfg.schedule)
            t += 1  # t counts windows here
    if pending:
        do_sync(pending_counts)
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in reps]


# ---------------------------------------------------------------------------- distributed
def dist_worker(rank: int, world: int, S: int, sync_kwargs: dict, steps: int, accum: int,
                inner: str, schedule: list[int] | None = None,
                corrupt: dict | None = None) -> dict[str, Any]:
    """One rank of a distributed run with the same data and model as the reference."""
    from torch.distributed.fsdp import fully_shard

    from editrain.sync import EDiT, StepScheduleTrigger, SyncConfig
    from editrain.topology import init_mesh

    info = init_mesh(shard_size=S)
    model = make_model()
    for block in model.layers:
        fully_shard(block, mesh=info.shard_mesh)
    fully_shard(model, mesh=info.shard_mesh)
    opt = make_inner(model.parameters(), inner)

    def before_sync(n: int) -> None:
        if corrupt and n in corrupt and corrupt[n][0] == info.replica:
            from editrain.sync.outer import local_view
            scale = corrupt[n][1]
            with torch.no_grad():
                for unit in engine.units:
                    delta = unit.pseudo_grad()
                    flat = unit.anchor - scale * delta
                    off = 0
                    for p, k in zip(unit.params, unit.numels):
                        local_view(p).copy_(flat[off:off + k].view_as(local_view(p)))
                        off += k

    trigger = StepScheduleTrigger(schedule) if schedule else None
    engine = EDiT(model, info.mesh, SyncConfig(**sync_kwargs), blocks=model.layers,
                  trigger=trigger, before_sync=before_sync)
    between: list[int] = []  # cross-replica collectives issued by each step outside syncs
    steps_done = 0
    n_steps = steps if schedule is None else steps * schedule[info.replica]
    for _ in range(n_steps):
        before, syncs_before = engine.comm.stats.lifetime_sync_collectives, engine.num_syncs
        warm = engine.in_warmup
        for m in range(accum):
            (loss_on(model, batch(rank, steps_done, m)) / accum).backward()
        engine.after_backward()
        opt.step()
        opt.zero_grad()
        engine.step()
        if engine.num_syncs == syncs_before and not warm:
            between.append(engine.comm.stats.lifetime_sync_collectives - before)
        steps_done += 1
    engine.finish()
    log = engine.pop_sync_log()
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    out = {"params": params, "log": log, "replica": info.replica,
           "num_syncs": engine.num_syncs, "between": between}
    engine.close()
    return out
