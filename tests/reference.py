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


def make_model(n_layers: int = 2) -> Llama:
    return Llama(LlamaConfig(**{**MODEL, "n_layers": n_layers}), seed=0)


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
    corrupt: dict = field(default_factory=dict)  # sync index -> (replica(s), scale)
    n_layers: int = 2
    gta: dict | None = None  # consensus, sparsification, normalize, density (section 7)
    anchors_at_start: bool = False  # defect 4 of the reference implementation (for tests)
    finish_force: bool = False  # end with a sync even mid-window (engine.finish(force=True))


# ---------------------------------------------------------------------------- GTA
def keep_count(density: float, numel: int) -> int:
    """ceil(density * numel) entries, at least one (exact for products like 0.5 * n)."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(density * numel - 1e-9)))


def shard_view(t: torch.Tensor, S: int, s: int) -> torch.Tensor:
    """Rank ``s``'s piece of a parameter under FSDP2 (torch.chunk along dim 0)."""
    chunks = torch.chunk(t, S, dim=0)
    return chunks[s] if s < len(chunks) else t[0:0]


def magnitude_masks(delta: list[torch.Tensor], S: int, density: float) -> list[torch.Tensor]:
    """Top-``density`` by |x| on every rank's local shard of the unit, as FSDP2 lays it out:
    rank ``s`` holds the concatenation of chunk ``s`` of each parameter. The selection uses
    the fp32 pseudo-gradient, as the engine does."""
    masks = [torch.zeros(d.shape, dtype=torch.bool) for d in delta]
    for s in range(S):
        flat = torch.cat([shard_view(d, S, s).reshape(-1) for d in delta]).float().abs()
        keep = torch.zeros(flat.numel(), dtype=torch.bool)
        keep[torch.topk(flat, keep_count(density, flat.numel())).indices] = True
        off = 0
        for m in masks:
            view = shard_view(m, S, s)
            view.copy_(keep[off:off + view.numel()].view_as(view))
            off += view.numel()
    return masks


def ref_gta(deltas: list[list[torch.Tensor]], w: list[float], keep: list[int], S: int,
            gta: dict) -> list[torch.Tensor]:
    """Section 7 over one unit: ``deltas[i]`` are replica i's per-parameter float64 deltas."""
    R = len(deltas)
    sparse = gta.get("sparsification")
    density = gta.get("density", 1.0)
    xs = []
    for i in range(R):
        if i not in keep:
            xs.append([torch.zeros_like(d) for d in deltas[i]])
            continue
        d = deltas[i]
        if sparse == "magnitude" and density < 1.0:
            d = [x * m for x, m in zip(d, magnitude_masks(d, S, density))]
        elif sparse is not None:
            raise ValueError(f"reference GTA has no {sparse!r} sparsification")
        xs.append([w[i] * x for x in d])
    out = []
    for k in range(len(deltas[0])):
        xk = [xs[i][k] for i in range(R)]
        if gta.get("consensus", "sum") == "sum":
            elect = sum(xk)
        else:
            elect = sum(torch.sign(x) for x in xk)
        pos = elect >= 0
        masks = [torch.where(pos, x > 0, x < 0) for x in xk]
        num = sum(x * m for x, m in zip(xk, masks))
        if gta.get("normalize", True):
            div = sum(w[i] * masks[i].double() for i in range(R))
            num = num / torch.where(div < 1e-8, torch.ones_like(div), div)
        out.append(num)
    return out


def run_reference(cfg: RefConfig) -> list[dict[str, torch.Tensor]]:
    """Train R replicas for ``cfg.steps`` inner steps (or windows); return each replica's
    final parameters after a final sync if one is pending."""
    # One thread, like the distributed workers: the tiny model gains nothing from more, and
    # spinning OpenMP threads are very slow on a loaded machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(cfg)
    finally:
        torch.set_num_threads(threads)


def _simulate(cfg: RefConfig) -> list[dict[str, torch.Tensor]]:
    base = make_model(cfg.n_layers)
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
            bad, scale = cfg.corrupt[n_sync]
            with torch.no_grad():
                for r in _replicas(bad):
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
                    if cfg.gta is not None:
                        red = ref_gta(deltas, w, keep, cfg.S, cfg.gta)
                    else:
                        red = [sum(w[i] * deltas[i][k] for i in keep)
                               for k in range(len(anchors[u]))]
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

    if not cfg.sync and (cfg.warmup == 0 or cfg.anchors_at_start):
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
            if not cfg.sync and t == cfg.warmup and not cfg.anchors_at_start:
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
    elif cfg.finish_force and not cfg.sync and any(since):
        do_sync(None)
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in reps]


def _replicas(bad: int | tuple | list) -> list[int]:
    return list(bad) if isinstance(bad, (tuple, list)) else [bad]


# ---------------------------------------------------------------------------- distributed
def run_case(info: Any, rank: int, case: dict[str, Any]) -> dict[str, Any]:
    """One distributed run on an existing mesh, with the same data and model as the reference.

    ``case`` keys: ``sync`` (SyncConfig keyword arguments), ``steps`` (inner steps, or
    A-EDiT windows with ``schedule``), and optionally ``accum`` (1), ``inner`` ("adamw"),
    ``schedule`` (steps per window for each replica), ``corrupt`` (sync index ->
    (replica or tuple of replicas, scale): their pseudo-gradients are multiplied by
    ``scale`` just before that sync), ``link_delay`` (seconds per cross-replica message),
    ``n_layers`` (2), ``finish_force`` (False) and ``eval_forward`` (False: if True, an
    extra eval-mode forward runs after every step, which must not start a pending sync).

    Returns the final full parameters and the sync log, plus per-step probes: ``between``
    (cross-replica collectives of each local-phase step that ran no sync, counted from
    before the forward to after ``engine.step()``), ``warm`` (the same for warm-up steps),
    ``anchor_none`` (whether every unit's anchor is None, before the first step and after
    each step) and ``anchor_diff`` (max |anchor - local shard| over units, None while there
    are no anchors).
    """
    from torch.distributed.fsdp import fully_shard

    from editrain.sync import StepScheduleTrigger, SyncConfig, SyncEngine
    from editrain.sync.outer import local_view

    model = make_model(case.get("n_layers", 2))
    for block in model.layers:
        fully_shard(block, mesh=info.shard_mesh)
    fully_shard(model, mesh=info.shard_mesh)
    opt = make_inner(model.parameters(), case.get("inner", "adamw"))
    corrupt = case.get("corrupt") or {}
    schedule = case.get("schedule")
    accum = case.get("accum", 1)

    def before_sync(n: int) -> None:
        if n in corrupt and info.replica in _replicas(corrupt[n][0]):
            scale = corrupt[n][1]
            with torch.no_grad():
                for unit in engine.units:
                    flat = unit.anchor.to(unit.device) - scale * unit.pseudo_grad()
                    off = 0
                    for p, k in zip(unit.params, unit.numels):
                        local_view(p).copy_(flat[off:off + k].view_as(local_view(p)))
                        off += k

    delay = float(case.get("link_delay", 0.0))
    engine = SyncEngine(model, info.mesh, SyncConfig(**case["sync"]), blocks=model.layers,
                  trigger=StepScheduleTrigger(schedule) if schedule else None,
                  before_sync=before_sync,
                  link_delay=(lambda nbytes: delay) if delay else None)

    def anchor_probe() -> tuple[bool, float | None]:
        if all(u.anchor is None for u in engine.units):
            return True, None
        diff = max(float((u.anchor.to(u.device) - u.flat_params()).abs().max())
                   for u in engine.units if u.numel)
        return False, diff

    none0, diff0 = anchor_probe()
    anchor_none, anchor_diff = [none0], [diff0]
    between: list[int] = []
    warm_colls: list[int] = []
    eval_pending: list[bool] = []
    n_steps = case["steps"] if schedule is None else case["steps"] * schedule[info.replica]
    for step in range(n_steps):
        before, syncs_before = engine.comm.stats.lifetime_sync_collectives, engine.num_syncs
        warm = engine.in_warmup
        for m in range(accum):
            (loss_on(model, batch(rank, step, m)) / accum).backward()
        engine.after_backward()
        opt.step()
        opt.zero_grad()
        engine.step()
        colls = engine.comm.stats.lifetime_sync_collectives - before
        if warm:
            warm_colls.append(colls)
        elif engine.num_syncs == syncs_before:
            between.append(colls)
        none, diff = anchor_probe()
        anchor_none.append(none)
        anchor_diff.append(diff)
        if case.get("eval_forward"):
            pending = engine.sync_pending
            model.eval()
            with torch.no_grad():
                loss_on(model, batch(rank, step, 0))
            model.train()
            assert engine.sync_pending == pending, "an eval forward changed the pending sync"
            eval_pending.append(pending)
    syncs_before_finish = engine.num_syncs
    engine.finish(force=case.get("finish_force", False))
    out = {
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        "log": engine.pop_sync_log(),
        "replica": info.replica,
        "num_syncs": engine.num_syncs,
        "syncs_before_finish": syncs_before_finish,
        "num_skipped_syncs": engine.num_skipped_syncs,
        "num_syncs_forced": engine.num_syncs_forced,
        "between": between,
        "warm": warm_colls,
        "anchor_none": anchor_none,
        "anchor_diff": anchor_diff,
        "unit_numels": [u.numel for u in engine.units],
        "eval_pending": eval_pending,
    }
    engine.close()
    return out


def multi_worker(rank: int, world: int, S: int, cases: list[dict[str, Any]]) -> list[dict]:
    """One rank of several distributed runs in one process group (one spawn): a fresh model
    and engine per case, on one ``(R, S)`` mesh. Returns one result per case."""
    from editrain.topology import init_mesh

    info = init_mesh(shard_size=S)
    return [run_case(info, rank, case) for case in cases]


def dist_worker(rank: int, world: int, S: int, sync_kwargs: dict, steps: int, accum: int,
                inner: str, schedule: list[int] | None = None,
                corrupt: dict | None = None) -> dict[str, Any]:
    """One rank of a single distributed run (see :func:`run_case`)."""
    case = dict(sync=sync_kwargs, steps=steps, accum=accum, inner=inner, schedule=schedule,
                corrupt=corrupt)
    return multi_worker(rank, world, S, [case])[0]


def run_cases(world: int, S: int, cases: dict[str, dict[str, Any]]) -> dict[str, list[dict]]:
    """Run every case on one spawned ``world``-process group with shard size ``S``; return
    ``{name: [result of rank 0, rank 1, ...]}``."""
    from editrain.spawn import run_ranks

    names = list(cases)
    outs = run_ranks(multi_worker, world, S, [cases[n] for n in names])
    return {n: [outs[r][i] for r in range(world)] for i, n in enumerate(names)}


# ---------------------------------------------------------------------------- glue
_METHOD_PENALTY = {"edit": True, "aedit": True}

def topology_runs(topologies: dict[tuple[int, int], dict[str, dict[str, Any]]]):
    """``get(R, S)``: every case of that topology, from one spawn per topology (cached; a
    failed spawn is remembered so later tests report it instead of spawning again)."""
    cache: dict[tuple[int, int], dict | BaseException] = {}

    def get(R: int, S: int) -> dict[str, list[dict]]:
        if (R, S) not in cache:
            try:
                cache[(R, S)] = run_cases(R * S, S, topologies[(R, S)])
            except Exception as exc:
                cache[(R, S)] = exc
        got = cache[(R, S)]
        if isinstance(got, BaseException):
            raise RuntimeError(f"the {R}x{S} spawn failed") from got
        return got

    return get


def ref_config(case: dict[str, Any], R: int, S: int, **overrides: Any) -> RefConfig:
    """The reference configuration of a distributed ``case`` (see :func:`run_case`), with
    each method's defaults written out here (independently of ``editrain.sync.methods``)."""
    sk = dict(case["sync"])
    method = sk.get("method", "edit")
    penalty = _METHOD_PENALTY.get(method, False)
    outer = None if method == "post_local_sgd" else "sgd"
    outer_kwargs = sk.get("outer_optim_kwargs") or {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    gta = sk.get("gta")
    if gta is not None and not isinstance(gta, dict):
        gta = vars(gta)
    ref_gta_cfg = None
    if gta and gta.get("reducer") == "gta":
        ref_gta_cfg = {"consensus": gta.get("consensus_method", "sum"),
                       "sparsification": gta.get("sparsification_method"),
                       "normalize": gta.get("normalize", True),
                       "density": gta.get("density", 1.0)}
    clip = sk.get("clip_pseudo_grad")
    kw: dict[str, Any] = dict(
        R=R, S=S, steps=case["steps"],
        H=sk.get("local_sgd_sync_interval") or 10,
        warmup=sk.get("local_sgd_warmup_steps", 0),
        accum=case.get("accum", 1),
        inner=case.get("inner", "adamw"),
        outer=outer,
        outer_kwargs=dict(outer_kwargs),
        sync=method == "sync",
        softmax=penalty if sk.get("pseudo_gradnorm_reduce") is None
        else bool(sk["pseudo_gradnorm_reduce"]),
        temperature=sk.get("weight_softmax_temperature", 1.0),
        skip_anomaly=penalty if sk.get("skip_anomaly") is None else bool(sk["skip_anomaly"]),
        ewma=(sk.get("ewma_alpha", 0.02), sk.get("ewma_warmup_steps", 120),
              sk.get("ewma_threshold", 3.0)),
        clip=(10.0 if penalty else 0.0) if clip is None else float(clip),
        schedule=case.get("schedule"),
        step_weight_ratio=(sk.get("step_weight_ratio", 0.5)
                           if sk.get("use_step_weight", True) else 0.0),
        corrupt=dict(case.get("corrupt") or {}),
        n_layers=case.get("n_layers", 2),
        gta=ref_gta_cfg,
        finish_force=bool(case.get("finish_force", False)),
    )
    kw.update(overrides)
    return RefConfig(**kw)


_REF_CACHE: dict[str, list[dict[str, torch.Tensor]]] = {}


def reference(cfg: RefConfig) -> list[dict[str, torch.Tensor]]:
    """:func:`run_reference`, memoised on the configuration."""
    key = repr(cfg)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = run_reference(cfg)
    return _REF_CACHE[key]


def max_diff(outs: list[dict], ref: list[dict[str, torch.Tensor]]) -> float:
    """Largest |distributed - reference| over every rank's full parameters."""
    return _worst(float((p - ref[o["replica"]][name]).abs().max())
                  for o in outs for name, p in o["params"].items())


def max_diff_runs(a: list[dict], b: list[dict]) -> float:
    """Largest |a - b| between two distributed runs, rank by rank."""
    return _worst(float((x["params"][n] - y["params"][n]).abs().max())
                  for x, y in zip(a, b) for n in x["params"])


def _worst(diffs: Any) -> float:
    """max() that turns any NaN into +inf (a plain max() can silently drop a NaN)."""
    worst = 0.0
    for d in diffs:
        if not math.isfinite(d):
            return math.inf
        worst = max(worst, d)
    return worst
