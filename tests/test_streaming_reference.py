"""The reference simulator's streaming options (docs/streaming.md): the fragment schedule,
the delayed and the eager merge, the quantisers with error feedback and the final forced
sync. Reference only (no engine, no processes): each check follows from the formulas of the
page."""

from __future__ import annotations

import pytest
import torch

from tests.reference import (
    QBLOCK,
    RefConfig,
    dequantize,
    encode,
    fragment_launches,
    fragment_units,
    make_model,
    quantised_reduce,
    quantize,
    ref_config,
    run_reference,
    shard_flat,
    units_of,
)

QMAX = {"int8": 127, "int4": 7}
PEN = dict(softmax=True, temperature=0.02, skip_anomaly=True, ewma=(0.5, 2, 3.0), clip=0.05)


def run(**kw) -> list[dict[str, torch.Tensor]]:
    return run_reference(RefConfig(**{"R": 2, "S": 2, "H": 4, **kw}))


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names=None) -> bool:
    return all(torch.equal(a[n], b[n]) for n in (a if names is None else names))


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names=None) -> float:
    """The largest absolute difference of two models' parameters. They are of order 1 and
    below (norm weights 1, the rest at std 0.02), so the bounds used with it are absolute
    (tests/README.md class 3): 1e-6, 8 float32 ulps at 1, where two runs are the same
    arithmetic but for a few roundings (a round that moves nothing, an eager launch that is
    the blocking round); 1e-5 where one side adds and takes back a term at every merge; a
    different trajectory moves them by 1e-4 and more (each test checks that too)."""
    return max(float((a[n] - b[n]).abs().max()) for n in (a if names is None else names))


def unit_names(split_root: bool, tied: bool, n_layers: int = 2) -> list[list[str]]:
    m = make_model(n_layers, tied=tied)
    names = {id(p): n for n, p in m.named_parameters()}
    return [[names[id(p)] for p in u] for u in units_of(m, split_root)]


# ---------------------------------------------------------------------------- defaults
def test_new_fields_default_to_the_sync_of_before():
    cfg = RefConfig(R=2, S=1, steps=1)
    assert (cfg.tau, cfg.fragments, cfg.merge, cfg.alpha, cfg.comm_dtype, cfg.error_feedback,
            cfg.split_root, cfg.tied) == (0, 1, "blend", 0.0, "fp32", True, False, True)
    case = dict(sync=dict(method="edit", local_sgd_sync_interval=4), steps=8)
    got = ref_config(case, 2, 2)
    assert (got.tau, got.fragments, got.merge, got.alpha, got.comm_dtype, got.error_feedback,
            got.split_root, got.tied) == (0, 1, "keep_local", 0.0, "fp32", True, False, True)


def test_ref_config_maps_the_streaming_options():
    case = dict(sync=dict(method="diloco", local_sgd_sync_interval=8, overlap_steps=2,
                          fragments=4, merge="keep_local", merge_alpha=0.5, comm_dtype="int4",
                          error_feedback=False),
                steps=16, split_root=True, tied=False)
    got = ref_config(case, 2, 2)
    assert (got.tau, got.fragments, got.merge, got.alpha, got.comm_dtype, got.error_feedback,
            got.split_root, got.tied) == (2, 4, "keep_local", 0.5, "int4", False, True, False)


# ---------------------------------------------------------------------------- units
def test_units_without_split_root_are_root_then_blocks():
    units = unit_names(split_root=False, tied=False)
    assert units[0] == ["tok_embeddings.weight", "norm.weight", "output.weight"]
    assert len(units) == 3
    assert all(n.startswith(f"layers.{i}.") for i, u in enumerate(units[1:]) for n in u)


def test_units_with_split_root():
    units = unit_names(split_root=True, tied=False)
    assert units[:2] == [["norm.weight"], ["tok_embeddings.weight"]]
    assert units[4:] == [["output.weight"]] and len(units) == 5
    for i, u in enumerate(units[2:4]):
        assert u and all(n.startswith(f"layers.{i}.") for n in u)
    # every parameter in exactly one unit
    all_names = [n for u in units for n in u]
    assert sorted(all_names) == sorted(n for n, _ in make_model(2, False).named_parameters())


def test_tied_embeddings_stay_in_the_root():
    """streaming.md section 1: the root's forward uses tok_embeddings.weight as the head."""
    assert unit_names(split_root=True, tied=True) == unit_names(split_root=False, tied=True)
    assert unit_names(split_root=False, tied=True)[0] == ["tok_embeddings.weight",
                                                          "norm.weight"]


def test_fragment_membership_is_u_mod_p():
    assert fragment_units(5, 2, 0) == [0, 2, 4]  # root, block0, output
    assert fragment_units(5, 2, 1) == [1, 3]  # tok_embeddings, block1
    assert fragment_units(4, 1, 0) == [0, 1, 2, 3]
    assert fragment_units(5, 3, 2) == [2]


# ---------------------------------------------------------------------------- schedule
def launches(H: int, P: int, upto: int) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {f: [] for f in range(P)}
    for k in range(upto + 1):
        for f in fragment_launches(k, H, P):
            got[f].append(k)
    return got


def test_fragment_launches_doc_examples():
    assert launches(32, 2, 64) == {0: [16, 48], 1: [32, 64]}
    assert launches(32, 1, 100) == {0: [32, 64, 96]}
    assert launches(4, 3, 8) == {0: [1, 5], 1: [2, 6], 2: [4, 8]}
    assert fragment_launches(0, 4, 1) == [] and fragment_launches(0, 4, 4) == []


@pytest.mark.parametrize("H", range(1, 10))
def test_every_fragment_launches_once_per_window(H):
    for P in range(1, H + 1):
        got = launches(H, P, 5 * H)
        for f in range(P):
            assert len(got[f]) == 5, (H, P, f)
            assert all(b - a == H for a, b in zip(got[f], got[f][1:]))
        # never two fragments after the same step; the last fragment at k = H, 2H, ...
        ks = [k for f in got for k in got[f]]
        assert len(ks) == len(set(ks))
        assert got[P - 1] == [H * j for j in range(1, 6)]


def test_fragment_rounds_sync_only_their_units():
    """P = 2, split_root, untied: after k = 2 (H = 4) fragment 0 (root, block0, output) was
    synced and is the same on both replicas, fragment 1 (tok_embeddings, block1) is not;
    after k = 4 the other way round."""
    units = unit_names(split_root=True, tied=False)
    f0 = [n for u in fragment_units(5, 2, 0) for n in units[u]]
    f1 = [n for u in fragment_units(5, 2, 1) for n in units[u]]
    kw = dict(fragments=2, split_root=True, tied=False)
    for steps, same, other in [(2, f0, f1), (4, f1, f0), (6, f0, f1)]:
        a, b = run(steps=steps, **kw)
        assert equal(a, b, same), steps
        assert diff(a, b, other) > 1e-4, steps
    # delayed: launched after k = 2, merged after k = 3 (blend alpha = 0: theta <- A~)
    a, b = run(steps=3, tau=1, **kw)
    assert equal(a, b, f0) and diff(a, b, f1) > 1e-4


# ---------------------------------------------------------------------------- quantisers
def blocky(n: int, seed: int = 0) -> torch.Tensor:
    """Values with a different magnitude in every block, some blocks all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    scale = torch.logspace(-6, 2, (n + QBLOCK - 1) // QBLOCK).repeat_interleave(QBLOCK)[:n]
    x = x * scale
    x[QBLOCK:2 * QBLOCK] = 0  # an all-zero block
    return x.float()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000])
def test_int_round_trip_error_at_most_half_a_step(dtype, n):
    x = blocky(n, seed=n)
    q, s = quantize(x, dtype)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert s is not None and s.dtype == torch.float32 and s.numel() == (n + QBLOCK - 1) // QBLOCK
    assert int(q.abs().max()) <= QMAX[dtype]
    d = dequantize(q, s, dtype)
    assert d.dtype == torch.float32 and d.shape == x.shape
    step = s.repeat_interleave(QBLOCK)[:n]
    assert bool(((x - d).abs() <= step / 2 * (1 + 1e-5)).all())
    for b in range(s.numel()):
        blk = x[b * QBLOCK:(b + 1) * QBLOCK]
        if blk.abs().max() > 0:
            # the largest value of a block maps to the largest code
            assert int(q[b * QBLOCK:(b + 1) * QBLOCK].abs().max()) == QMAX[dtype]


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_all_zero_blocks_decode_to_zero_with_scale_one(dtype):
    x = blocky(3 * QBLOCK)
    q, s = quantize(x, dtype)
    assert float(s[1]) == 1.0
    d = dequantize(q, s, dtype)
    assert bool((d[QBLOCK:2 * QBLOCK] == 0).all())
    z = torch.zeros(300)
    q, s = quantize(z, dtype)
    assert bool((s == 1).all()) and bool((dequantize(q, s, dtype) == 0).all())


def test_bf16_is_torchs_cast():
    x = blocky(1000)
    c, s = quantize(x, "bf16")
    assert s is None and c.dtype == torch.bfloat16
    assert torch.equal(dequantize(c, s, "bf16"), x.to(torch.bfloat16).float())
    assert not torch.equal(dequantize(c, s, "bf16"), x)  # it does round


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_representable_values_round_trip_exactly(dtype):
    g = torch.Generator().manual_seed(1)
    m = QMAX[dtype]
    codes = torch.randint(-m, m + 1, (5 * QBLOCK,), generator=g)
    codes[::QBLOCK] = m  # every block reaches the largest code, so s is the block's step
    steps = torch.tensor([2.0 ** e for e in (-20, -7, 0, 3, -1)]).repeat_interleave(QBLOCK)
    x = (codes.float() * steps).float()
    q, s = quantize(x, dtype)
    assert torch.equal(q.long(), codes)
    assert torch.equal(dequantize(q, s, dtype), x)


def test_scale_is_a_division_and_rounding_is_half_to_even():
    # a block maximum whose scale differs between amax / 127 and amax * (1 / 127)
    g = torch.Generator().manual_seed(2)
    cands = torch.rand(10000, generator=g) * 10
    bad = cands[(cands / 127.0) != (cands * (1 / 127.0))]
    assert bad.numel() > 0
    amax = bad[:1]
    _, s = quantize(torch.cat([amax, torch.zeros(5)]), "int8")
    assert torch.equal(s, amax / 127.0)
    # s = 1 exactly: x / s = x, so the halves show the rounding
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])
    q, s = quantize(x, "int8")
    assert float(s[0]) == 1.0
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -2, 4]


def test_error_feedback_telescopes():
    """sum_t D(c_t) = sum_t delta_t - e_T: nothing is lost but the last residual."""
    g = torch.Generator().manual_seed(3)
    n = 300
    e = torch.zeros(n)
    sent = torch.zeros(n, dtype=torch.float64)
    sent_plain = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for t in range(8):
        delta = (torch.randn(n, generator=g) * 10 ** (-t % 3)).float()
        d, e_new = encode(delta, e, "int8")
        sent_plain += encode(delta, None, "int8")[0].double()
        assert e_new is not None
        x = delta + e
        assert torch.equal(e_new, x - d)
        _, s = quantize(x, "int8")
        assert bool((e_new.abs() <= s.repeat_interleave(QBLOCK)[:n] / 2 * (1 + 1e-5)).all())
        sent += d.double()
        total += delta.double()
        e = e_new
    # exact in real arithmetic; fp32 rounding of x = delta + e and x - D(c) only: two
    # roundings a round of values up to about 4 (ulp 4.8e-7), at most 8e-6 in 8 rounds,
    # where 1e-4 leaves room and the run without feedback is 100 times further (below)
    err = (sent - (total - e.double())).abs().max()
    assert float(err) < 1e-4
    # without error feedback the quantisation errors pile up instead
    assert float((sent_plain - total).abs().max()) > 100 * float(err)
    # without error feedback: plain Q then D, no residual
    d, none = encode(delta, None, "int8")
    assert none is None and torch.equal(d, dequantize(*quantize(delta, "int8"), "int8"))


def test_quantised_reduce_order_weights_and_exclusion():
    """Replica 1 excluded: it sends Q(0) and keeps its e; replica 0's error feedback moves."""
    g = torch.Generator().manual_seed(4)
    shapes = [(5, 40), (3,), (7, 30)]
    R, S = 3, 2
    deltas = [[torch.randn(s, generator=g) for s in shapes] for _ in range(R)]
    e_old = shard_flat([torch.full(s, 0.25) for s in shapes], S, 1)
    ef = {("u", 1, 1): e_old.clone()}
    w = [0.3, 0.0, 0.7]
    red = quantised_reduce(deltas, w, [0, 2], S, "int8", ef, "u")
    assert torch.equal(ef[("u", 1, 1)], e_old) and ("u", 1, 0) not in ef
    assert set(ef) == {("u", r, s) for r in (0, 2) for s in range(S)} | {("u", 1, 1)}
    for s in range(S):
        want = torch.zeros_like(shard_flat(deltas[0], S, s))
        for r in range(R):
            x = shard_flat(deltas[r], S, s)
            d = dequantize(*quantize(x if r != 1 else torch.zeros_like(x), "int8"), "int8")
            want = want + w[r] * d
            if r != 1:
                assert torch.equal(ef[("u", r, s)], x - d)
        assert torch.equal(shard_flat(red, S, s), want)
    # no error feedback: nothing stored
    assert quantised_reduce(deltas, w, [0, 2], S, "int8", None, "u")[0].dtype == torch.float32


# ---------------------------------------------------------------------------- merge
def test_split_root_changes_nothing_without_per_unit_statistics():
    """Outer SGD and equal weights are element-wise: how the model is cut into units cannot
    matter; with the penalty (per-unit norms, weights, clipping) it does."""
    a = run(steps=9, tied=False)
    b = run(steps=9, tied=False, split_root=True)
    assert all(equal(x, y) for x, y in zip(a, b))
    a = run(steps=9, tied=False, **PEN)
    b = run(steps=9, tied=False, split_root=True, **PEN)
    assert max(diff(x, y) for x, y in zip(a, b)) > 1e-6


@pytest.mark.parametrize("outer", ["sgd", None])
def test_blend_alpha_one_discards_the_global_update(outer):
    """theta <- lerp(A~, theta, 1) = theta: every replica trains as if there were no sync."""
    alone = run(steps=9, H=10, outer=outer)
    got = run(steps=9, tau=2, alpha=1.0, outer=outer, **PEN)
    assert all(equal(x, y) for x, y in zip(alone, got))
    assert diff(got[0], got[1]) > 1e-4


def test_delayed_round_uses_the_pseudo_gradient_at_launch():
    """The outer step is taken at launch: blend with alpha = 0 after tau more steps lands on
    exactly the model a tau = 0 sync at the launch step gives (the tau steps are discarded)."""
    for kw in [dict(), PEN, dict(comm_dtype="int8"), dict(merge="keep_local", alpha=0.5)]:
        now = run(steps=4, **kw)
        later = run(steps=6, tau=2, **kw)
        if kw.get("merge") == "keep_local":  # A~ + (theta - theta0): the tau steps are kept
            assert max(diff(x, y) for x, y in zip(now, later)) > 1e-4
        else:
            assert all(equal(x, y) for x, y in zip(now, later)), kw
    # P = 2: fragment 0 (root, block0, output) is launched first, after k = 2
    units = unit_names(True, False)
    f0 = [n for u in fragment_units(5, 2, 0) for n in units[u]]
    kw = dict(fragments=2, split_root=True, tied=False)
    now, later = run(steps=2, **kw), run(steps=3, tau=1, **kw)
    assert all(equal(x, y, f0) for x, y in zip(now, later))
    assert max(diff(x, y) for x, y in zip(now, later)) > 1e-4  # fragment 1 kept training


def test_blend_alpha_zero_single_replica_returns_to_the_launch_point():
    """R = 1, plain averaging: A~ = A - (A - theta0) ~= theta0, so with alpha = 0 the model
    after the merge is (up to fp32 rounding) the model at launch."""
    at_launch = run(R=1, steps=4, H=10, outer=None)[0]
    after = run(R=1, steps=6, tau=2, outer=None)[0]
    assert diff(at_launch, after) < 1e-6
    assert diff(run(R=1, steps=6, H=10, outer=None)[0], after) > 1e-4


def test_keep_local_single_replica_keeps_training():
    """R = 1, plain averaging: theta <- A~ + (theta - theta0) ~= theta: local training."""
    alone = run(R=1, steps=11, H=10, outer=None)[0]
    got = run(R=1, steps=11, tau=2, merge="keep_local", outer=None)[0]
    assert diff(alone, got) < 1e-5
    # with the outer optimizer the global update does move the model
    moved = run(R=1, steps=11, tau=2, merge="keep_local")[0]
    assert diff(alone, moved) > 1e-4


def test_alpha_only_matters_for_a_delayed_blend():
    a = run(steps=9, tau=2, merge="keep_local", alpha=0.0)
    b = run(steps=9, tau=2, merge="keep_local", alpha=0.7)
    assert all(equal(x, y) for x, y in zip(a, b))
    a = run(steps=9, alpha=0.0)
    b = run(steps=9, alpha=0.7)
    assert all(equal(x, y) for x, y in zip(a, b))
    a = run(steps=9, tau=2, alpha=0.0)
    b = run(steps=9, tau=2, alpha=0.5)
    assert max(diff(x, y) for x, y in zip(a, b)) > 1e-5


def test_error_feedback_and_comm_dtype_change_the_result():
    fp32 = run(steps=8)
    int8 = run(steps=8, comm_dtype="int8")
    no_ef = run(steps=8, comm_dtype="int8", error_feedback=False)
    int4 = run(steps=8, comm_dtype="int4")
    for got, tol in [(int8, 1e-2), (no_ef, 1e-2), (int4, 1e-1)]:
        d = max(diff(x, y) for x, y in zip(fp32, got))
        assert 0 < d < tol
    assert max(diff(x, y) for x, y in zip(int8, no_ef)) > 0
    # error feedback is irrelevant for the first round (e = 0)
    assert all(equal(x, y) for x, y in zip(run(steps=4, comm_dtype="int8"),
                                           run(steps=4, comm_dtype="int8",
                                               error_feedback=False)))


# ---------------------------------------------------------------------------- finish
@pytest.mark.parametrize("tau", [1, 2])
@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("comm_dtype", ["fp32", "int8"])
def test_final_forced_sync_leaves_replicas_identical(tau, P, comm_dtype):
    steps = 8 + tau + P  # mixes ends right after a launch, a merge, or mid-window
    merge = "keep_local" if (tau + P) % 2 else "blend"
    out = run(steps=steps, tau=tau, fragments=P, comm_dtype=comm_dtype, merge=merge,
              alpha=0.5, split_root=P == 2, tied=tau == 1, finish_force=True, **PEN)
    assert equal(out[0], out[1])
    assert all(torch.isfinite(p).all() for p in out[0].values())
    init = dict(make_model(2, tau == 1).named_parameters())
    assert diff(out[0], {n: p.detach() for n, p in init.items()}) > 1e-3


def test_streaming_finish_force_syncs_even_at_a_window_end():
    """tau = 1 ends right after a launch (k = 8): the round in flight is merged with
    alpha = 0.5, which leaves replicas apart; finish(force=True) adds one more round."""
    a, b = run(steps=8, tau=1, alpha=0.5)
    assert diff(a, b) > 1e-5
    a, b = run(steps=8, tau=1, alpha=0.5, finish_force=True)
    assert equal(a, b)
    # P = 1, tau = 0 keeps the old rule: no forced round at a window end
    x = run(steps=8)
    y = run(steps=8, finish_force=True)
    assert all(equal(p, q) for p, q in zip(x, y))


@pytest.mark.parametrize("kw, exc", [
    (dict(tau=4), ValueError),
    (dict(tau=-1), ValueError),
    (dict(fragments=5), ValueError),  # more fragments than H
    (dict(fragments=4), ValueError),  # more fragments than the 3 units
    (dict(fragments=0), ValueError),
    (dict(comm_dtype="fp8"), ValueError),
    (dict(merge="average"), ValueError),
    (dict(comm_dtype="int8", gta={"consensus": "sum"}), NotImplementedError),
    (dict(schedule=[1, 2], tau=1), NotImplementedError),
])
def test_invalid_streaming_options(kw, exc):
    with pytest.raises(exc):
        run(steps=1, **kw)


# ---------------------------------------------------------------------------- eager
@pytest.mark.parametrize("P, steps", [(1, 10), (2, 10), (2, 9)])
def test_eager_single_replica_is_a_sync_every_h_steps(P, steps):
    """R = 1: I = D, so C = C + I - D / R stays 0 and every launch steps the anchor with the
    round's own D, then restarts from it: a tau = 0 round at the same step (section 3c).
    Ends mid-window (the final rounds meet), or with P = 2 at a launch (with P > 1 the
    tau = 0 run syncs at the end too)."""
    kw = dict(R=1, S=1, H=3, steps=steps, fragments=P, finish_force=True)
    if P == 2:
        # the run ends right after a fragment's launch: tau = 0 syncs its units once more
        # (D = 0), eager ends them on G without a round (section 3c); the same model
        # unless momentum steps on a zero pseudo-gradient, so none here
        kw["outer_kwargs"] = {"lr": 0.7, "momentum": 0.0, "nesterov": False}
    plain = run(**kw)[0]
    got = run(tau=3, merge="eager", **kw)[0]
    assert diff(plain, got) < 1e-6
    assert diff(plain, run(**{**kw, "finish_force": False, "steps": steps - 1})[0]) > 1e-4


def test_eager_single_replica_aedit_is_the_blocking_aedit():
    """Non-blocking A-EDiT with R = 1 and plain averaging: the eager launch is the blocking
    round, and the final round (D = 0, C = 0) changes nothing."""
    kw = dict(R=1, S=1, steps=3, schedule=[3], outer=None, finish_force=True)
    blocking = run(**kw)[0]
    got = run(tau=1, merge="eager", **kw)[0]
    assert diff(blocking, got) < 1e-6


def test_eager_replicas_keep_their_own_anchors_until_the_end():
    """R = 2, plain averaging, equal weights, fp32: each replica restarts from its own anchor
    (it applied its own share at once), so the replicas differ right after a launch; the
    final round and the consensus leave them identical, on another model than tau = 0."""
    kw = dict(S=1, H=3, steps=9, outer=None)
    apart = run(tau=3, merge="eager", **kw)  # ends right after a launch: theta_m = A_m
    assert diff(apart[0], apart[1]) > 1e-4
    a, b = run(tau=3, merge="eager", finish_force=True, **kw)
    assert equal(a, b)
    assert all(torch.isfinite(p).all() for p in a.values())
    plain = run(finish_force=True, **kw)
    assert equal(plain[0], plain[1])
    assert diff(a, plain[0]) > 1e-4
    # with the outer optimizer, the penalty, int8 and two fragments the end is the same
    a, b = run(H=4, steps=10, tau=4, fragments=2, merge="eager", comm_dtype="int8",
               finish_force=True, **PEN)
    assert equal(a, b) and all(torch.isfinite(p).all() for p in a.values())


@pytest.mark.parametrize("kw", [dict(H=3, steps=3, tau=3),
                                dict(steps=1, schedule=[2, 3], tau=1)])
def test_eager_one_round_then_finish_is_one_plain_round(kw):
    """Plain averaging, one round then finish(force): A_m = A - D_m / R at the launch,
    C_m = I - D_m / R at the merge, and the final round (D = 0, I = 0) gives A_m - C_m =
    A - I on every replica: the plain round's model, with the penalty's weights and
    clipping (the own share at 1 / R is taken back at the merge)."""
    base = dict(outer=None, finish_force=True, **PEN)
    plain = run(**base, **{**kw, "tau": 0})
    got = run(merge="eager", **base, **kw)
    assert equal(got[0], got[1])
    assert max(diff(x, y) for x, y in zip(plain, got)) < 1e-6


def test_eager_others_shares_arrive_one_round_later():
    """Scaling replica 1's parameters before the first round moves replica 0 only from the
    second launch on: its own share is applied at once, the others' at the merge."""
    kw = dict(S=1, H=3, tau=3, merge="eager")
    bad = {0: (1, 3.0)}
    one, one_bad = run(steps=3, **kw), run(steps=3, corrupt=bad, **kw)
    assert equal(one[0], one_bad[0]) and diff(one[1], one_bad[1]) > 1e-4
    two, two_bad = run(steps=6, **kw), run(steps=6, corrupt=bad, **kw)
    assert diff(two[0], two_bad[0]) > 1e-4


@pytest.mark.parametrize("outer", [None, "sgd"])
def test_eager_feeds_every_replica_the_rounds_results_once(outer):
    """Section 3c: over a run each replica's outer optimizer is fed D_m / R + (I - D_m / R)
    per round, i.e. sum_t I(t). Plain averaging: every replica's own anchor, stepped with
    the final C + I, is A - sum_t I(t): the global anchor G every replica ends on; with
    momentum the timing of the own shares differs, so the own anchors differ, and every
    replica ends on G (fed each I once, in order) without exchanging a model."""
    probe: dict = {}
    cfg = RefConfig(R=3, S=1, H=3, steps=8, tau=3, merge="eager", outer=outer,
                    finish_force=True)
    out = run_reference(cfg, probe)
    assert all(equal(out[0], o) for o in out[1:])
    names = unit_names(False, True)
    spread = gap = 0.0
    for u, own in probe["own"].items():
        for j, n in enumerate(names[u]):
            spread = max(spread, float((own[0][j] - own[1][j]).abs().max()),
                         float((own[0][j] - own[2][j]).abs().max()))
            gap = max(gap, float((out[0][n] - own[0][j]).abs().max()))
    if outer is None:
        assert spread < 1e-6 and gap < 1e-6
    else:
        assert spread > 1e-4 and gap > 1e-4


@pytest.mark.parametrize("codec, P, steps", [("topk2", 1, 9), ("topk2", 2, 10),
                                             ("int8", 2, 9), ("fp32", 1, 6)])
def test_eager_end_right_after_a_launch_is_the_last_global_model(codec, P, steps):
    """A run that ends right after a fragment's launch: that fragment trained nothing since,
    so its units end on G with the round in flight merged, the global model an evaluation
    at that step sees, bitwise; no last round flushes the error feedback's residual into it
    (section 3c). The other fragment's units (trained one step since their launch) run the
    last round and differ from it. Every replica ends on one model."""
    probe: dict = {}
    cfg = RefConfig(R=2, S=1, H=3, steps=steps, fragments=P, tau=3, merge="eager",
                    comm_dtype=codec, finish_force=True, global_at=(steps,),
                    outer_kwargs={"lr": 1.0, "momentum": 0.0, "nesterov": False},
                    **({"topk_chunk": 64, "topk_k": 4} if codec == "topk2" else {}))
    out = run_reference(cfg, probe)
    assert equal(out[0], out[1])
    seen = probe["global"][steps]
    names = unit_names(False, True)
    fresh = {u for f in fragment_launches(steps, 3, P) for u in fragment_units(3, P, f)}
    assert fresh  # the case ends right after a launch
    for u, unit in enumerate(names):
        for n in unit:
            if u in fresh:
                assert torch.equal(out[0][n], seen[0][n]), (u, n)
            else:
                assert not torch.equal(out[0][n], seen[0][n]), (u, n)


def test_eager_aedit_ends_on_one_model():
    a, b = run(steps=3, schedule=[2, 3], tau=1, merge="eager", finish_force=True, **PEN)
    assert equal(a, b) and all(torch.isfinite(p).all() for p in a.values())
    a, b = run(steps=3, schedule=[2, 3], tau=1, merge="eager")
    assert diff(a, b) > 1e-4


@pytest.mark.parametrize("kw", [
    dict(tau=2),  # not H = 4
    dict(tau=0),
    dict(tau=4, alpha=0.5),
    dict(schedule=[2, 3], tau=0),
    dict(tau=4, sync=True),
])
def test_eager_validation(kw):
    with pytest.raises(ValueError, match="eager"):
        run(steps=1, merge="eager", **kw)


def test_ref_config_maps_eager():
    case = dict(sync=dict(method="diloco", local_sgd_sync_interval=8, overlap_steps=8,
                          merge="eager"), steps=16)
    got = ref_config(case, 2, 1)
    assert (got.tau, got.merge, got.alpha) == (8, "eager", 0.0)
    run_reference(RefConfig(**{**vars(got), "steps": 1}))  # accepted


def test_reference_mismatches_allow_isolated_float_noise_only():
    """An isolated element off by float noise (one quantum, one AdamW step) passes; a
    shift of a whole tensor, many elements, one large error or a NaN do not."""
    from tests.reference import reference_mismatches

    ref = [{"w": torch.zeros(2000), "b": torch.zeros(32)}]

    def check(w: torch.Tensor, b: torch.Tensor | None = None) -> list[str]:
        return reference_mismatches([{"replica": 0, "params": {
            "w": w, "b": torch.zeros(32) if b is None else b}}], ref)

    w = torch.zeros(2000)
    w[7] = 3e-5  # one isolated element, as a flipped int8 code
    b = torch.zeros(32)
    b[3] = 2.5e-5  # one element of a small tensor, as an AdamW step near v = 0
    assert check(w, b) == []
    assert check(torch.full((2000,), 2e-5))  # the whole tensor moved
    many = torch.zeros(2000)
    many[:3] = 2e-5  # more than 0.1% of 2000 elements
    assert check(many)
    big = torch.zeros(2000)
    big[0] = 1.5e-4  # isolated, but beyond float noise
    assert check(big)
    two = torch.zeros(32)
    two[:2] = 2e-5  # a 32-element tensor gets one isolated element, not two
    assert check(torch.zeros(2000), two)
    nan = torch.zeros(2000)
    nan[5] = float("nan")
    assert "non-finite" in check(nan)[0]
