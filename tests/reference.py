"""Single-process reference simulator of the algorithm (docs/algorithm.md section 5) and of
its streaming options (docs/streaming.md: fragments, delayed outer updates, the eager merge,
quantised pseudo-gradients with error feedback).

R model replicas live in one process, unsharded. Every formula is written out plainly, in
float64 where it matters (in fp32 where the engine's arithmetic decides a quantisation),
with no code shared with ``editrain.sync``: only the model comes from ``editrain``.
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


def make_model(n_layers: int = 2, tied: bool = True) -> Llama:
    """The tiny Llama; ``tied=False`` gives it an ``output`` head of its own."""
    return Llama(LlamaConfig(**{**MODEL, "n_layers": n_layers, "tie_embeddings": tied}), seed=0)


def batch(global_rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * global_rank + 1009 * step + micro)
    return torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1), generator=g)


def loss_on(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(model(x[:, :-1]), x[:, 1:])


def make_inner(params, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def units_of(model: Llama, split_root: bool = False) -> list[list[nn.Parameter]]:
    """The sync units (docs/streaming.md section 1): ``[root, block0, ...]``, or with
    ``split_root`` and untied embeddings ``[root, tok_embeddings, block0, ..., output]``: the
    root first (every parameter outside the separately sharded modules, i.e. the final norm),
    then those modules in ``model.modules()`` order. Tied embeddings stay in the root (the
    root's forward uses ``tok_embeddings.weight`` as the output head, which FSDP2 cannot
    serve from another unit), so with them ``split_root`` changes nothing."""
    own = list(model.layers)
    if split_root and model.output is not None:
        own += [model.tok_embeddings, model.output]
    own_ids = {id(m) for m in own}
    separate = {id(p) for m in own for p in m.parameters()}
    root = [p for p in model.parameters() if id(p) not in separate]
    return [root] + [list(m.parameters()) for m in model.modules() if id(m) in own_ids]


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
        a = max(self.alpha, 1 / self.count)  # equal weights until count reaches 1 / alpha
        d = v - self.mean
        self.mean += a * d
        self.var = (1 - a) * (self.var + a * d * (v - self.mean))
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
    # streaming (docs/streaming.md); the defaults are the sync of before
    tau: int = 0  # overlap_steps: inner steps between a round's launch and its merge
    fragments: int = 1  # P: unit u belongs to fragment u mod P
    merge: str = "blend"  # "blend" | "keep_local" (tau > 0) | "eager" (tau = H, section 3c);
    # ref_config maps the engine default
    alpha: float = 0.0  # merge_alpha (blend)
    comm_dtype: str = "fp32"  # "fp32" | "bf16" | "int8" | "int4" | "topk2" | "topk1"
    error_feedback: bool = True  # quantised comm_dtype only
    error_decay: float | None = None  # e <- decay * e + delta (None: the codec's default)
    topk_chunk: int = 4096  # sparse codecs: values per chunk
    topk_k: int = 64  # sparse codecs: values kept per full chunk
    split_root: bool = False  # tok_embeddings (and an untied output) are units of their own
    tied: bool = True  # tied embeddings (False: the model has an ``output`` head)
    T: int = 1  # tensor-parallel ranks per shard: the codecs' local pieces (S = 1 with T > 1)
    # unit -> fragment, in the order of :func:`units_of` (None: unit u in fragment u mod P);
    # pipeline stages stride their own units over the fragments
    fragment_of: tuple[int, ...] | None = None
    # inner steps k (streaming, lock-step runs) after whose merges and launches every
    # replica's global model is recorded in probe["global"][k] (an evaluation there)
    global_at: tuple[int, ...] = ()


# ---------------------------------------------------------------------------- streaming
COMM_DTYPES = ("fp32", "bf16", "int8", "int4", "topk2", "topk1")
TOPK_BITS = {"topk2": 2, "topk1": 1}
MERGES = ("blend", "keep_local", "eager")
QBLOCK = 128  # values per quantisation block (one fp32 scale each)
_QMAX = {"int8": 127.0, "int4": 7.0}


def fragment_launches(k: int, H: int, P: int) -> list[int]:
    """The fragments launched after inner step ``k`` of the local phase (section 2):
    ``k >= 1 and k mod H == ((f + 1) * H // P) mod H``."""
    if k < 1:
        return []
    return [f for f in range(P) if k % H == ((f + 1) * H // P) % H]


def fragment_units(n_units: int, P: int, f: int) -> list[int]:
    """The units of fragment ``f``: unit ``u`` belongs to fragment ``u mod P``."""
    return [u for u in range(n_units) if u % P == f]


def quantize(x: torch.Tensor, comm_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Q(x)`` of a flat fp32 shard (section 4): ``(codes, scales)``. bf16: the bf16 cast and
    no scales. int8 / int4: integer codes (int8 storage) and one fp32 scale per block of
    ``QBLOCK`` consecutive values (the last block may be shorter)."""
    if comm_dtype == "bf16":
        return x.to(torch.bfloat16), None
    qmax = _QMAX[comm_dtype]
    n = x.numel()
    blocks = torch.cat([x, x.new_zeros((-n) % QBLOCK)]).view(-1, QBLOCK)
    s = blocks.abs().amax(dim=1) / qmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(blocks / s[:, None]).clamp(-qmax, qmax)
    return q.to(torch.int8).reshape(-1)[:n], s


def dequantize(codes: torch.Tensor, scales: torch.Tensor | None, comm_dtype: str) -> torch.Tensor:
    """``D(c)``, fp32."""
    if comm_dtype == "bf16":
        return codes.float()
    assert scales is not None
    return codes.float() * scales.repeat_interleave(QBLOCK)[:codes.numel()]


def sparse_decoded(x: torch.Tensor, bits: int, chunk: int, k: int) -> torch.Tensor:
    """``D(C(x))`` of a sparse codec (section 4b), written out chunk by chunk: in each chunk
    of ``L`` values keep the ``ceil(k L / chunk)`` (at most ``L``) of largest magnitude
    (ties: lower index), order them by value (ties: lower index), cut that order into
    ``2 ** bits`` groups of equal count, and decode each kept value to its group's mean
    (summed in fp32 in index order); everything else to 0."""
    out = torch.zeros_like(x)
    groups = 2 ** bits
    for start in range(0, x.numel(), chunk):
        v = x[start:start + chunk]
        L = v.numel()
        kept = min(L, math.ceil(k * L / chunk))
        vals = v.tolist()
        keep = sorted(sorted(range(L), key=lambda i: (-abs(vals[i]), i))[:kept])
        by_value = sorted(keep, key=lambda i: (vals[i], i))
        group = {i: j * groups // kept for j, i in enumerate(by_value)}
        for g in range(groups):
            members = [i for i in keep if group[i] == g]  # index order
            if not members:
                continue
            total = torch.zeros((), dtype=torch.float32)
            for i in members:
                total = total + v[i]
            mean = total / float(len(members))
            for i in members:
                out[start + i] = mean
    return out


def encode(delta: torch.Tensor, e: torch.Tensor | None, comm_dtype: str,
           decay: float = 1.0, chunk: int = 4096,
           k: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One included replica's message on one shard: ``x = delta + decay * e`` (no ``e``: no
    error feedback), ``c = Q(x)``; returns ``(D(c), x - D(c))`` (the new ``e``; None
    without)."""
    if e is None:
        x = delta
    else:
        x = delta + e if decay == 1.0 else delta + e * decay
    if comm_dtype in TOPK_BITS:
        d = sparse_decoded(x, TOPK_BITS[comm_dtype], chunk, k)
    else:
        d = dequantize(*quantize(x, comm_dtype), comm_dtype)
    return d, (x - d if e is not None else None)


def ef_decay(cfg: RefConfig) -> float:
    """The error feedback's decay: the configured one, else 0.95 for the sparse codecs and 1
    for the others."""
    if cfg.error_decay is not None:
        return cfg.error_decay
    return 0.95 if cfg.comm_dtype in TOPK_BITS else 1.0


def shard_flat(ts: list[torch.Tensor], S: int, s: int) -> torch.Tensor:
    """Rank ``s``'s flat local shard of a unit: its pieces of the parameters, concatenated."""
    return torch.cat([shard_view(t, S, s).reshape(-1) for t in ts])


TP_KINDS = {"attention.wq": "col", "attention.wk": "col", "attention.wv": "col",
            "attention.wo": "row", "feed_forward.w1": "col", "feed_forward.w3": "col",
            "feed_forward.w2": "row"}
"""The Megatron split of a block (module path -> column- or row-wise), written here
independently of editrain's plan: column-wise weights are cut along dim 0, row-wise along
dim 1; everything else is held whole by every tp rank."""


def tp_kinds(model: Llama, split_root: bool = False) -> list[list[str | None]]:
    """Per unit of :func:`units_of`, per parameter: ``"col"``, ``"row"`` or None
    (replicated over tp)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for params in units_of(model, split_root):
        kinds = []
        for p in params:
            path = names[id(p)].rsplit(".", 1)[0]  # drop ".weight"
            kinds.append(next((kind for sub, kind in TP_KINDS.items()
                               if path.endswith("." + sub)), None))
        out.append(kinds)
    return out


def tp_view(t: torch.Tensor, kind: str | None, T: int, r: int) -> torch.Tensor:
    """Tensor-parallel rank ``r``'s piece of a parameter of ``kind`` (the whole if None)."""
    if kind is None:
        return t
    return torch.chunk(t, T, dim=0 if kind == "col" else 1)[r]


Piece = tuple[Any, list[tuple[int, Any]]]


def local_pieces(n_params: int, S: int, T: int = 1,
                 kinds: list[str | None] | None = None) -> list[Piece]:
    """The flat tensors one unit's reduction works on, as ``(key, [(param, view), ...])``:
    without tensor parallelism one per shard rank ``s`` (key ``s``: chunk ``s`` of every
    parameter, concatenated); with it (``S = 1``) the elements tp peers hold alike (key
    ``"alike"``: the replicated parameters whole, reduced alike by every tp rank), then per
    tp rank ``r`` (key ``("tp", r)``) its piece of every split parameter, concatenated in
    parameter order. Each is encoded from its own start (blocks and chunks cut there)."""
    if T == 1:
        return [(s, [(j, lambda t, s=s: shard_view(t, S, s)) for j in range(n_params)])
                for s in range(S)]
    if S != 1 or kinds is None:
        raise NotImplementedError("tensor parallelism here needs S = 1 and the kinds")
    pieces: list[Piece] = [("alike", [(j, lambda t: t) for j in range(n_params)
                                      if kinds[j] is None])]
    for r in range(T):
        pieces.append((("tp", r), [(j, lambda t, kind=kinds[j], r=r: tp_view(t, kind, T, r))
                                   for j in range(n_params) if kinds[j] is not None]))
    return [piece for piece in pieces if piece[1]]


def quantised_reduce(deltas: list[list[torch.Tensor]], w: list[float], keep: list[int], S: int,
                     comm_dtype: str, ef: dict[tuple[Any, int, Any], torch.Tensor] | None,
                     unit: Any = 0, decay: float = 1.0, chunk: int = 4096,
                     k: int = 64, pieces: list[Piece] | None = None) -> list[torch.Tensor]:
    """Section 4 over one unit: ``deltas[r]`` are replica r's fp32 per-parameter
    pseudo-gradients. On every local piece (:func:`local_pieces`; default: every shard rank
    ``s``'s flat shard), each included replica encodes ``x = Δ + e`` (``e = ef[(unit, r,
    key)]``, zeros at first; ``ef=None``: no error feedback) and an excluded one sends
    ``Q(0)`` and keeps its ``e``; then ``Δ̄ = Δ̄ + w_r · D(c_r)`` in fp32, in replica order.
    Returns ``Δ̄`` per parameter (fp32, full shapes)."""
    red = [torch.zeros_like(d) for d in deltas[0]]
    for key, views in (pieces if pieces is not None else local_pieces(len(red), S)):
        acc: torch.Tensor | None = None
        for r in range(len(deltas)):
            x = torch.cat([view(deltas[r][j]).reshape(-1) for j, view in views])
            if r in keep:
                e = None
                if ef is not None:
                    e = ef.get((unit, r, key))
                    e = torch.zeros_like(x) if e is None else e
                d, e = encode(x, e, comm_dtype, decay, chunk, k)
                if ef is not None:
                    assert e is not None
                    ef[(unit, r, key)] = e
            elif comm_dtype in TOPK_BITS:
                d = torch.zeros_like(x)  # a sparse message of zeros decodes to zeros
            else:
                d = dequantize(*quantize(torch.zeros_like(x), comm_dtype), comm_dtype)
            if acc is None:
                acc = torch.zeros_like(d)
            acc = acc + w[r] * d
        assert acc is not None
        off = 0
        for j, view in views:
            piece = view(red[j])
            piece.copy_(acc[off:off + piece.numel()].view_as(piece))
            off += piece.numel()
    return red


def _check_streaming(cfg: RefConfig, n_units: int) -> None:
    if cfg.comm_dtype not in COMM_DTYPES:
        raise ValueError(f"comm_dtype must be one of {COMM_DTYPES}, got {cfg.comm_dtype!r}")
    if cfg.merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {cfg.merge!r}")
    if not 1 <= cfg.fragments <= min(cfg.H, n_units):
        raise ValueError(f"fragments must be in [1, min(H, units)] = [1, "
                         f"{min(cfg.H, n_units)}], got {cfg.fragments}")
    if cfg.merge == "eager":
        # section 3c: a whole round in flight (any tau >= 1 with A-EDiT's own trigger)
        if cfg.sync:
            raise ValueError("merge = 'eager' delays the outer updates of a local-SGD method")
        if cfg.alpha != 0:
            raise ValueError(f"merge = 'eager' needs alpha = 0, got {cfg.alpha}")
        if cfg.schedule is None and cfg.tau != cfg.H:
            raise ValueError(f"merge = 'eager' needs tau = H = {cfg.H}, got {cfg.tau}")
        if cfg.schedule is not None and cfg.tau < 1:
            raise ValueError(f"merge = 'eager' needs tau >= 1 with A-EDiT, got {cfg.tau}")
    elif not 0 <= cfg.tau < cfg.H:
        raise ValueError(f"tau must be in [0, H) = [0, {cfg.H}), got {cfg.tau}")
    if cfg.comm_dtype != "fp32" and cfg.gta is not None:
        raise NotImplementedError("quantised comm_dtype is for the linear reducer only")
    if cfg.schedule is not None and cfg.fragments > 1:
        raise NotImplementedError("A-EDiT syncs every unit at once (fragments = 1)")
    if cfg.schedule is not None and cfg.tau > 0 and min(cfg.schedule) <= cfg.tau:
        raise NotImplementedError("non-blocking A-EDiT here needs schedule[i] > tau")


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


def _outer_step(anchor: list[torch.Tensor], opt: torch.optim.Optimizer | None,
                update: list[torch.Tensor]) -> None:
    """``A ← OuterOpt(A, update)`` in fp32, or ``A ← A − update`` for plain averaging."""
    if opt is None:
        for a, x in zip(anchor, update):
            a.sub_(x.float())
        return
    for a, x in zip(anchor, update):
        a.grad = x.float()
    opt.step()
    for a in anchor:
        a.grad = None


def run_reference(cfg: RefConfig,
                  probe: dict[str, Any] | None = None) -> list[dict[str, torch.Tensor]]:
    """Train R replicas for ``cfg.steps`` inner steps (or windows); return each replica's
    final parameters after a final sync if one is pending. ``probe`` (for tests of the eager
    merge): gets ``"own"``, unit -> every replica's own anchor stepped with ``C + I`` by the
    final round (what each replica's own outer optimizer was fed), and with
    ``cfg.global_at`` ``"global"``, step -> every replica's global model (name -> tensor)."""
    # One thread, like the distributed workers: the tiny model gains nothing from more, and
    # spinning OpenMP threads are very slow on a loaded machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(cfg, probe)
    finally:
        torch.set_num_threads(threads)


def _simulate(cfg: RefConfig,
              probe: dict[str, Any] | None = None) -> list[dict[str, torch.Tensor]]:
    base = make_model(cfg.n_layers, cfg.tied)
    reps = [copy.deepcopy(base) for _ in range(cfg.R)]
    opts = [make_inner(m.parameters(), cfg.inner) for m in reps]
    uparams = [units_of(m, cfg.split_root) for m in reps]  # [replica][unit] -> params
    n_units = len(uparams[0])
    kinds = tp_kinds(base, cfg.split_root) if cfg.T > 1 else [None] * n_units
    # what each rank's codec encodes (fp32 rounds need no pieces: any layout sums alike)
    pieces = ([local_pieces(len(uparams[0][u]), cfg.S, cfg.T, kinds[u])
               for u in range(n_units)] if cfg.comm_dtype != "fp32" else [None] * n_units)
    _check_streaming(cfg, n_units)
    P = cfg.fragments
    streaming = cfg.tau > 0 or P > 1
    quantised = cfg.comm_dtype != "fp32"
    eager = cfg.merge == "eager"
    all_units = list(range(n_units))
    frags = [fragment_units(n_units, P, f) for f in range(P)]
    if cfg.fragment_of is not None:
        assert len(cfg.fragment_of) == n_units, (cfg.fragment_of, n_units)
        frags = [[u for u in range(n_units) if cfg.fragment_of[u] == f] for f in range(P)]
    anchors: list[list[torch.Tensor]] | None = None
    outers: list[torch.optim.Optimizer | None] = []
    # the eager merge (section 3c): every replica has its own anchor and outer optimizer per
    # unit (own[i][u], own_outers[i][u]; ``anchors`` stays None) and its correction C
    # (corr[i][u]), all fp32; C is 0 at the start
    own: list[list[list[torch.Tensor]]] = []
    own_outers: list[list[torch.optim.Optimizer | None]] = []
    corr: list[list[list[torch.Tensor]]] = []
    # ... and the global anchor G with its own outer optimizer (glob[i][u], glob_outers[i][u]):
    # fed every round's I once, at the merge; the same on every replica
    glob: list[list[list[torch.Tensor]]] = []
    glob_outers: list[list[torch.optim.Optimizer | None]] = []
    dets = [[RefDetector(*cfg.ewma) for _ in range(cfg.R)] for _ in range(n_units)]
    # error feedback: (unit, replica, piece key) -> flat fp32 residual, zeros at the start
    ef: dict[tuple[int, int, Any], torch.Tensor] = {}
    # rounds in flight (tau > 0), in launch order: (merge step, units, theta0[replica][j]);
    # eager: (merge step, units, (D[replica][j], I[j])), D and I fp32 per parameter
    inflight: list[tuple[int, list[int], Any]] = []
    steps = [0] * cfg.R  # per replica global step
    k = 0  # inner steps since the local phase began
    n_sync = 0

    def new_outer(a: list[torch.Tensor]) -> torch.optim.Optimizer | None:
        return (getattr(torch.optim, {"sgd": "SGD"}[cfg.outer])(a, **cfg.outer_kwargs)
                if cfg.outer else None)

    def make_anchors():
        nonlocal anchors, outers
        if eager:
            for i in range(cfg.R):
                own.append([[p.detach().clone() for p in u] for u in uparams[i]])
                own_outers.append([new_outer(a) for a in own[i]])
                corr.append([[torch.zeros_like(a) for a in u] for u in own[i]])
                glob.append([[p.detach().clone() for p in u] for u in uparams[i]])
                glob_outers.append([new_outer(a) for a in glob[i]])
            return
        anchors = [[p.detach().clone() for p in u] for u in uparams[0]]
        outers = [new_outer(a) for a in anchors]

    def anchor(i: int, u: int) -> list[torch.Tensor]:
        """Replica ``i``'s anchor of unit ``u`` (one shared anchor unless eager)."""
        if eager:
            return own[i][u]
        assert anchors is not None
        return anchors[u]

    def grads_of(i: int, t: int) -> list[torch.Tensor]:
        m = reps[i]
        m.zero_grad()
        for s in range(cfg.S):
            for mi in range(cfg.accum):
                (loss_on(m, batch(i * cfg.S + s, t, mi)) / (cfg.S * cfg.accum)).backward()
        return [p.grad.clone() for p in m.parameters()]

    def launch(units: list[int], counts: list[int] | None, tau: int) -> None:
        """One round over ``units`` (section 5 on those units only), its outer step
        included; with ``tau == 0`` every replica takes the new anchors now, otherwise the
        round is merged after inner step ``k + tau``. Eager (section 3c): each replica
        steps its own anchor with ``C + D / R`` and restarts from it; with ``tau == 0`` (the
        end of training) with ``C + I``, then every replica takes the replicas' mean."""
        nonlocal n_sync
        assert anchors is not None or own
        if n_sync in cfg.corrupt:
            bad, scale = cfg.corrupt[n_sync]
            with torch.no_grad():
                for r in _replicas(bad):
                    for p, a in zip([p for u in uparams[r] for p in u],
                                    [a for u in range(n_units) for a in anchor(r, u)]):
                        p.copy_(a + scale * (p - a))
        theta0: list[list[list[torch.Tensor]]] = [[] for _ in range(cfg.R)]
        sent: list[list[list[torch.Tensor]]] = [[] for _ in range(cfg.R)]  # eager: D[i][j]
        reduced: list[list[torch.Tensor]] = []  # eager: I[j]
        for u in units:
            thetas = [uparams[i][u] for i in range(cfg.R)]
            if tau > 0 and not eager:
                for i in range(cfg.R):
                    theta0[i].append([t.detach().clone() for t in thetas[i]])
            deltas = [[a.double() - t.detach().double() for a, t in zip(anchor(i, u), th)]
                      for i, th in enumerate(thetas)]
            # fp32 pseudo-gradients: what a codec encodes, and the eager merge's D
            d32 = ([[a.float() - t.detach().float() for a, t in zip(anchor(i, u), th)]
                    for i, th in enumerate(thetas)] if quantised or eager else [])
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
                red = None
                if keep:
                    if quantised:
                        red = quantised_reduce(d32, w, keep, cfg.S, cfg.comm_dtype,
                                               ef if cfg.error_feedback else None, u,
                                               ef_decay(cfg), cfg.topk_chunk, cfg.topk_k,
                                               pieces[u])
                    elif cfg.gta is not None:
                        red = ref_gta(deltas, w, keep, cfg.S, cfg.gta)
                    else:
                        red = [sum(w[i] * deltas[i][k] for i in keep)
                               for k in range(len(deltas[0]))]
                    if cfg.clip:
                        n = math.sqrt(sum(float((r.double() * r.double()).sum()) for r in red))
                        c = min(1.0, cfg.clip / (n + 1e-6))
                        red = [r * c for r in red]
                if eager:
                    got = ([r.float() for r in red] if red is not None
                           else [torch.zeros_like(d) for d in d32[0]])  # nobody trusted: 0
                    eager_step(u, d32, got, tau, red is not None)
                    for i in range(cfg.R):
                        sent[i].append(d32[i])
                    reduced.append((got, red is not None))
                else:
                    if red is not None:
                        _outer_step(anchor(0, u), outers[u], red)
                    if tau == 0:
                        for i in range(cfg.R):
                            for p, a in zip(uparams[i][u], anchor(0, u)):
                                p.copy_(a)
        if tau > 0:
            inflight.append((k + tau, list(units), (sent, reduced) if eager else theta0))
        n_sync += 1

    def eager_step(u: int, d: list[list[torch.Tensor]], got: list[torch.Tensor],
                   tau: int, trusted: bool) -> None:
        """Section 3c's outer steps of unit ``u`` at a launch: ``A_i ← OuterOpt_i(A_i, C_i +
        D_i / R)`` (a replica's own share now, the others' at the merge), ``C_i ← 0``,
        ``θ_i ← A_i``. With ``tau == 0`` (the final blocking round) the round's ``I`` is
        known: ``G_i ← OuterOpt_G(G_i, I)`` (no step if nobody was trusted), then ``A_i``
        and its outer state become ``G_i``'s, ``C_i ← 0``, ``θ_i ← G_i``."""
        for i in range(cfg.R):
            if tau > 0:
                update = [c + x / cfg.R for c, x in zip(corr[i][u], d[i])]
                _outer_step(own[i][u], own_outers[i][u], update)
                for c in corr[i][u]:
                    c.zero_()
                for p, a in zip(uparams[i][u], own[i][u]):
                    p.copy_(a)
                continue
            if probe is not None:  # what the replica's own optimizer was fed: C + I
                mine = [a.clone() for a in own[i][u]]
                opt = new_outer(mine)
                if opt is not None:
                    opt.load_state_dict(copy.deepcopy(own_outers[i][u].state_dict()))
                _outer_step(mine, opt, [c + x for c, x in zip(corr[i][u], got)])
                probe.setdefault("own", {}).setdefault(u, []).append(mine)
            if trusted:
                _outer_step(glob[i][u], glob_outers[i][u], got)
            end_on_global(i, u)

    def end_on_global(i: int, u: int) -> None:
        """Replica ``i`` ends unit ``u`` on ``G_i`` as it is: ``A_i`` and its outer state
        become ``G_i``'s, ``C_i ← 0``, ``θ_i ← G_i`` (section 3c's end)."""
        for a, g, c, p in zip(own[i][u], glob[i][u], corr[i][u], uparams[i][u]):
            a.copy_(g)
            c.zero_()
            p.copy_(g)
        if own_outers[i][u] is not None:
            own_outers[i][u].load_state_dict(copy.deepcopy(glob_outers[i][u].state_dict()))

    def merge(rnd: tuple[int, list[int], Any], replicas: list[int] | None = None) -> None:
        """Section 3: blend ``θ ← lerp(Ã, θ, α)`` or keep_local ``θ ← Ã + (θ − θ⁰)``;
        eager (section 3c): ``C ← C + (I − D / R)``, the live parameters stay."""
        _, units, payload = rnd
        if eager:
            sent, reduced = payload
            with torch.no_grad():
                for j, u in enumerate(units):
                    got, trusted = reduced[j]
                    for i in (range(cfg.R) if replicas is None else replicas):
                        for c, x, d in zip(corr[i][u], got, sent[i][j]):
                            c.copy_(c + (x - d / cfg.R))
                        if trusted:
                            _outer_step(glob[i][u], glob_outers[i][u], got)
            return
        assert anchors is not None
        theta0 = payload
        with torch.no_grad():
            for j, u in enumerate(units):
                for i in (range(cfg.R) if replicas is None else replicas):
                    for p, a, p0 in zip(uparams[i][u], anchors[u], theta0[i][j]):
                        if cfg.merge == "blend":
                            p.copy_(torch.lerp(a, p.detach(), cfg.alpha))
                        else:
                            p.copy_(a + (p.detach() - p0))

    def global_model(i: int) -> dict[str, torch.Tensor]:
        """Replica ``i``'s global model now (an evaluation's): the anchors; eager: each
        unit's ``G`` with its round in flight merged as sent (a copy of ``G`` and of its
        optimizer state stepped with the round's ``I``), ``G`` itself if none is in flight
        or nobody was trusted in it."""
        values: list[torch.Tensor] = []
        for u in range(n_units):
            if not eager:
                values += [a.clone() for a in anchor(0, u)]
                continue
            g = [a.clone() for a in glob[i][u]]
            for _, units, (_, reduced) in inflight:
                if u in units:
                    got, trusted = reduced[units.index(u)]
                    if trusted:
                        opt = new_outer(g)
                        if opt is not None:
                            opt.load_state_dict(copy.deepcopy(glob_outers[i][u].state_dict()))
                        _outer_step(g, opt, got)
            values += g
        names = [n for n, _ in reps[i].named_parameters()]
        by_param = {id(p): t for p, t in zip([p for u in uparams[i] for p in u], values)}
        return {n: by_param[id(p)] for n, p in zip(names, reps[i].parameters())}

    if not cfg.sync and (cfg.warmup == 0 or cfg.anchors_at_start):
        make_anchors()

    t = 0
    total = cfg.steps
    pending = False  # A-EDiT: a window ended, sync before the next one
    pending_counts: list[int] | None = None
    while t < total:
        if pending:
            launch(all_units, pending_counts, 0)
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
            t += 1
            k += 1
            # after inner step k: merge the rounds due now, then launch the fragments due
            # (a round with tau = 0 is synced at once: nothing runs before the next forward)
            for rnd in [r for r in inflight if r[0] == k]:
                merge(rnd)
                inflight.remove(rnd)
            for f in fragment_launches(k, cfg.H, P):
                launch(frags[f], None, cfg.tau)
            if k in cfg.global_at and probe is not None:
                probe.setdefault("global", {})[k] = [global_model(i) for i in range(cfg.R)]
        elif cfg.tau > 0:
            # Non-blocking A-EDiT: replica i launches after every schedule[i] of its own
            # steps (snapshot, rendezvous and reduction behind training) and merges that
            # round tau of its own steps later; the steps after a launch count towards the
            # next window.
            for i in range(cfg.R):
                for j in range(cfg.schedule[i]):
                    if j == cfg.tau and inflight:
                        merge(inflight[0], replicas=[i])
                    g = grads_of(i, steps[i])
                    for p, gg in zip(reps[i].parameters(), g):
                        p.grad = gg
                    opts[i].step()
                    steps[i] += 1
                if cfg.schedule[i] == cfg.tau and inflight:
                    merge(inflight[0], replicas=[i])
            inflight.clear()
            launch(all_units, list(cfg.schedule), cfg.tau)
            t += 1  # t counts windows here
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
        launch(all_units, pending_counts, 0)
    elif cfg.schedule is not None and cfg.tau > 0:
        # finish(force): the round in flight is merged at once; every replica then has 0
        # steps since its snapshot, so no further sync
        for rnd in inflight:
            merge(rnd)
        inflight.clear()
        if eager and cfg.finish_force and own:
            # eager: the replicas' own anchors still differ and C still waits; nobody
            # trained since the launch, so no round: every replica ends on G as it is
            with torch.no_grad():
                for u in all_units:
                    for i in range(cfg.R):
                        end_on_global(i, u)
    elif streaming:
        # finish(): rounds in flight are merged at once; with force, one more round over
        # every unit with tau = 0 so that all replicas end on the same model. Eager: the
        # units of fragments launched after the last step trained nothing since; every
        # replica ends them on G as it is, and the round runs over the others
        for rnd in inflight:
            merge(rnd)
        inflight.clear()
        if cfg.finish_force and not cfg.sync and eager and own:
            fresh = {u for f in fragment_launches(k, cfg.H, P) for u in frags[f]}
            with torch.no_grad():
                for u in sorted(fresh):
                    for i in range(cfg.R):
                        end_on_global(i, u)
            rest = [u for u in all_units if u not in fresh]
            if rest:
                launch(rest, None, 0)
        elif cfg.finish_force and not cfg.sync and not eager and k >= 1:
            launch(all_units, None, 0)
    elif cfg.finish_force and not cfg.sync and k % cfg.H != 0:
        launch(all_units, None, 0)
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
    ``n_layers`` (2), ``finish_force`` (False), ``eval_forward`` (False: if True, an
    extra eval-mode forward runs after every step, which must not start a pending sync),
    ``tied`` (True: tied embeddings; False gives the model an ``output`` head) and
    ``unsharded`` (False: if True, no ``fully_shard`` at all: plain parameters, shard size
    1; the engine's units are the root, the blocks and, with ``split_root``, the untied
    embeddings and head), ``world_allreduce`` (False: if True, an all-reduce on the world group after every
    step, as a training loop that logs a mean loss does), ``split_root`` (False: if True
    and the embeddings are untied, ``tok_embeddings`` and
    ``output`` are sharded as units of their own, docs/streaming.md section 1; tied
    embeddings stay in the root, as in :func:`units_of`), ``trace`` (False: if True, the
    result's ``trace`` lists the communication thread's collectives in issue order),
    ``record_loss`` (False: if True, each step's loss goes to ``engine.record_loss``; the
    result's ``losses`` are the rank's step losses either way), ``global_at`` (steps after
    which the global model is taken, as an evaluation does: the result's ``globals``,
    step -> full parameters) and ``state_at`` (steps after which ``engine.state_dict()``
    is taken, as a checkpoint does). The result's ``ledger`` is the engine's
    cross-replica bytes by cause.

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

    model = make_model(case.get("n_layers", 2), tied=case.get("tied", True))
    if not case.get("unsharded"):
        for block in model.layers:
            fully_shard(block, mesh=info.shard_mesh)
        if case.get("split_root", False) and model.output is not None:
            fully_shard(model.tok_embeddings, mesh=info.shard_mesh)
            fully_shard(model.output, mesh=info.shard_mesh)
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
    if case.get("trace"):
        engine.comm.trace = []  # every collective of the communication thread, in order

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
    losses: list[float] = []
    globals_: dict[int, dict[str, torch.Tensor]] = {}
    n_steps = case["steps"] if schedule is None else case["steps"] * schedule[info.replica]
    for step in range(n_steps):
        before, syncs_before = engine.comm.stats.lifetime_sync_collectives, engine.num_syncs
        warm = engine.in_warmup
        total = torch.zeros(())
        for m in range(accum):
            loss = loss_on(model, batch(rank, step, m)) / accum
            loss.backward()
            total += loss.detach()
        engine.after_backward()
        opt.step()
        opt.zero_grad()
        if case.get("record_loss"):
            engine.record_loss(total)
        losses.append(float(total))
        engine.step()
        colls = engine.comm.stats.lifetime_sync_collectives - before
        if warm:
            warm_colls.append(colls)
        elif engine.num_syncs == syncs_before:
            between.append(colls)
        none, diff = anchor_probe()
        anchor_none.append(none)
        anchor_diff.append(diff)
        if case.get("world_allreduce"):
            # The caller's own collective on the world group at every step boundary, while
            # a delayed sync's collectives may be in flight on the communication thread.
            import torch.distributed as dist

            dist.all_reduce(torch.ones(1))
        if step + 1 in case.get("global_at", ()):
            with engine.global_model():
                globals_[step + 1] = {
                    n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for n, p in model.named_parameters()}
        if step + 1 in case.get("state_at", ()):
            engine.state_dict()
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
        "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for n, p in model.named_parameters()},
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
        "trace": engine.comm.trace,
        "losses": losses,
        "globals": globals_,
        "ledger": engine.comm.ledger.totals(),
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
    outer_kwargs = sk.get("outer_optim_kwargs") or (
        {"lr": 2.0, "momentum": 0.0, "nesterov": False}  # the sparse codecs' outer SGD
        if sk.get("comm_dtype") in TOPK_BITS else
        {"lr": 1.0, "momentum": 0.0, "nesterov": False}  # the eager merge's outer SGD
        if sk.get("merge") == "eager" else
        {"lr": 1.0, "momentum": 0.0, "nesterov": False}  # EDiT's and A-EDiT's (the recipe)
        if method in ("edit", "aedit") else {"lr": 0.7, "momentum": 0.9, "nesterov": True})
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
        H=sk.get("local_sgd_sync_interval") or (20 if method in ("edit", "aedit") else 10),
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
        tau=sk.get("overlap_steps", 0),
        fragments=sk.get("fragments", 1),
        merge=sk.get("merge", "keep_local"),  # the engine's default
        alpha=float(sk.get("merge_alpha", 0.0)),
        comm_dtype=sk.get("comm_dtype", "fp32"),
        error_feedback=bool(sk.get("error_feedback", True)),
        error_decay=sk.get("error_decay"),
        topk_chunk=sk.get("topk_chunk") or 4096,
        topk_k=sk.get("topk_k") or 64,
        split_root=bool(case.get("split_root", False)),
        tied=bool(case.get("tied", True)),
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


def reference_mismatches(outs: list[dict], ref: list[dict[str, torch.Tensor]],
                         tol: float = 1e-5, isolated_tol: float = 1e-4,
                         isolated_share: float = 1e-3) -> list[str]:
    """Where the distributed parameters differ from the reference beyond float noise.

    Every element must match to ``tol``, except isolated elements: at most
    ``isolated_share`` of a tensor's elements (at least one), each within
    ``isolated_tol``. Two float effects land on single elements and depend on the CPU's
    rounding (an AMD host shows them where an Intel one did not): AdamW divides by the
    square root of the second moment, so where a gradient is almost zero a 1-ulp
    difference becomes a visible update; and a quantiser turns a 1-ulp difference at a
    rounding boundary into one quantum. A wrong algorithm moves whole tensors, which no
    allowance hides.

    Returns:
        One line per offending tensor (empty: the run matches).
    """
    bad = []
    for o in outs:
        for name, p in o["params"].items():
            d = (p - ref[o["replica"]][name]).abs().flatten()
            if not bool(torch.isfinite(d).all()):
                bad.append(f"replica {o['replica']} {name}: non-finite difference")
                continue
            over = int((d > tol).sum())
            allowed = max(1, int(isolated_share * d.numel()))
            worst = float(d.max()) if d.numel() else 0.0
            if over > allowed or worst >= isolated_tol:
                bad.append(f"replica {o['replica']} {name}: {over} of {d.numel()} elements "
                           f"beyond {tol:g} (allowed {allowed}), largest {worst:.3g}")
    return bad


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
