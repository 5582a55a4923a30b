"""Tests for editrain.sync.reducers with R replicas simulated in one process.

Each replica's ``reduce`` runs in its own Python thread; a barrier-based fake
all-reduce sums the R tensors in place, and a fake all-gather stacks them in rank order,
the way a real sync group would.
Expected values come from hand calculations or from a float64 single-process
GTA reference written here from the algorithm spec (section 7).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from editrain.sync import reducers
from editrain.sync.reducers import (
    GTAReducer,
    MeanReducer,
    Reducer,
    build_reducer,
    gta_message_bytes,
)
from editrain.sync.sparse import pack_bits

# ---------------------------------------------------------------------------
# fake sync group
# ---------------------------------------------------------------------------


class FakeSyncGroup:
    """In-process stand-in for a sync group of ``world`` ranks.

    ``all_reduce_for(rank)`` returns that rank's in-place sum, ``all_gather_for(rank)``
    its all-gather (``[world, *shape]``, rows in rank order). Every rank must issue
    the same collectives in the same order, exactly as with torch.distributed; a
    mismatch breaks the barrier (timeout) instead of hanging the test run. ``log[r]``
    lists rank r's collectives: ``(shape, dtype)`` for an all-reduce,
    ``("all_gather", shape, dtype)`` for an all-gather.
    """

    def __init__(self, world: int, timeout: float = 20.0) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.log: list[list[tuple[tuple[int, ...], torch.dtype]]] = [[] for _ in range(world)]

    def all_reduce_for(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            self.log[rank].append((tuple(t.shape), t.dtype))
            self.slots[rank] = t
            self.barrier.wait()
            shapes = {tuple(s.shape) for s in self.slots}
            if len(shapes) != 1:
                self.barrier.abort()
                raise RuntimeError(f"mismatched all-reduce shapes {shapes}")
            # Same summation order on every rank, so every rank gets identical bits.
            total = self.slots[0].clone()
            for other in self.slots[1:]:
                total += other
            # Nobody may reuse its slot before everyone has read all of them.
            self.barrier.wait()
            t.copy_(total)

        return all_reduce

    def all_gather_for(self, rank: int):
        def all_gather(t: torch.Tensor) -> torch.Tensor:
            self.log[rank].append(("all_gather", tuple(t.shape), t.dtype))
            self.slots[rank] = t
            self.barrier.wait()
            kinds = {(tuple(s.shape), s.dtype) for s in self.slots}
            if len(kinds) != 1:
                self.barrier.abort()
                raise RuntimeError(f"mismatched all-gather tensors {kinds}")
            out = torch.stack([s.clone() for s in self.slots])
            self.barrier.wait()
            return out

        return all_gather


def run_replicas(reducer, deltas, weights, generators=None):
    """Run ``reducer.reduce`` on every replica concurrently.

    Returns (results, log) where log[r] lists rank r's collectives (FakeSyncGroup.log).
    """
    world = len(deltas)
    group = FakeSyncGroup(world)
    results: list[torch.Tensor | None] = [None] * world
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            gen = generators[rank] if generators is not None else None
            results[rank] = reducer.reduce(
                deltas[rank],
                weights[rank],
                group.all_reduce_for(rank),
                generator=gen,
                weights=list(weights),
                all_gather=group.all_gather_for(rank),
            )
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, group.log


def assert_all_same(results):
    for r in results[1:]:
        assert torch.equal(r, results[0])


# ---------------------------------------------------------------------------
# single-process GTA reference (float64)
# ---------------------------------------------------------------------------


def gta_reference(deltas, weights, keeps, *, consensus, normalize, rescale=None):
    """Section 7 on all replicas at once.

    keeps[j] is replica j's bool sparsification mask (all True for no sparsification);
    rescale is the density for rescaled_random.
    """
    xs = []
    for d, w, keep in zip(deltas, weights, keeps):
        if w == 0:
            xs.append(torch.zeros(d.numel(), dtype=torch.float64))
            continue
        s = torch.where(keep, d.double().reshape(-1), 0.0)
        if rescale is not None:
            s = s / rescale
        xs.append(w * s)
    if consensus == "sum":
        vote = sum(xs)
    else:
        vote = sum(torch.sign(x) for x in xs)
    plus = vote >= 0
    masks = [((x > 0) & plus) | ((x < 0) & ~plus) for x in xs]
    num = sum(x * m for x, m in zip(xs, masks))
    if not normalize:
        return num
    div = sum(w * m.double() for w, m in zip(weights, masks))
    div = torch.where(div < 1e-8, 1.0, div)
    return num / div


def topk_keep(delta, density):
    """Magnitude mask by sorting: the ceil(density * n) largest |delta| (no ties in test data)."""
    flat = delta.reshape(-1)
    k = math.ceil(round(density * flat.numel(), 9))
    order = torch.argsort(flat.abs(), descending=True)
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    keep[order[:k]] = True
    return keep


def random_keep(seed, n, density):
    """The documented random mask: torch.rand(n, generator) < density."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) < density


def gather_one(t):
    """The all-gather of a sync group of one replica."""
    return t.unsqueeze(0).clone()


F32_VS_F64 = dict(rtol=1e-6, atol=1e-6)
"""A float32 reducer's result against the float64 formula (tests/README.md class 2 with a
floor): a weighted sum over 3-4 replicas of randn values (up to about 3) rounds a handful of
times in float32, under 8 ulps of the largest term (rtol 1e-6); where the terms cancel the
result is small and atol 1e-6 carries it. A wrong weight, sign or mask moves an element by
1e-2 and more."""


def rand_deltas(world, n, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for _ in range(world)]


# ---------------------------------------------------------------------------
# MeanReducer
# ---------------------------------------------------------------------------


def test_mean_reducer_is_the_weighted_sum_with_one_collective():
    deltas = rand_deltas(3, 17, seed=0)
    weights = [0.2, 0.3, 0.5]
    results, log = run_replicas(MeanReducer(), deltas, weights)
    assert_all_same(results)
    expected = sum(w * d.double() for w, d in zip(weights, deltas))
    torch.testing.assert_close(results[0].double(), expected, **F32_VS_F64)
    assert results[0].dtype == torch.float32
    assert log == [[((17,), torch.float32)]] * 3
    assert MeanReducer.collectives_per_call == 1


def test_mean_reducer_hand_values_and_excluded_replica():
    deltas = [
        torch.tensor([1.0, 2.0], dtype=torch.float64),
        torch.tensor([3.0, -4.0], dtype=torch.float64),
        torch.tensor([math.nan, math.inf], dtype=torch.float64),  # excluded
    ]
    results, _ = run_replicas(MeanReducer(), deltas, [0.25, 0.75, 0.0])
    assert_all_same(results)
    # 0.25 * [1, 2] + 0.75 * [3, -4] = [2.5, -2.5]; the NaN replica contributes nothing.
    assert results[0].tolist() == [2.5, -2.5]


# ---------------------------------------------------------------------------
# GTAReducer: hand-made cases
# ---------------------------------------------------------------------------

# Three replicas, four entries, weights 0.5 / 0.25 / 0.25. Weighted x = w * d:
#   x0 = [ 2.00,  0.5, -1.0,  0.00]
#   x1 = [-0.25,  0.5,  0.5,  0.75]
#   x2 = [-0.25, -1.0,  0.5, -0.25]
# sum   of x:     [1.5, 0, 0, 0.5]  -> elected [+, + (tie), + (tie), +]
# count of signs: [-1, +1, +1, 0]   -> elected [-, +, +, + (tie)]
# Entry 0 is where the two consensus methods disagree.
HAND_DELTAS = [
    [4.0, 1.0, -2.0, 0.0],
    [-1.0, 2.0, 2.0, 3.0],
    [-1.0, -4.0, 2.0, -1.0],
]
HAND_WEIGHTS = [0.5, 0.25, 0.25]
# Agreeing entries per column (sum): {x0}, {x0, x1}, {x1, x2}, {x1} (x0 is 0, dropped)
#   numerator  [2, 1, 1, 0.75]; divisor [0.5, 0.75, 0.5, 0.25]
# count changes only column 0: {x1, x2} -> numerator -0.5, divisor 0.5.
HAND_EXPECTED = {
    ("sum", True): [4.0, 4.0 / 3.0, 2.0, 3.0],
    ("sum", False): [2.0, 1.0, 1.0, 0.75],
    ("count", True): [-1.0, 4.0 / 3.0, 2.0, 3.0],
    ("count", False): [-0.5, 1.0, 1.0, 0.75],
}


@pytest.mark.parametrize(("consensus", "normalize"), list(HAND_EXPECTED))
@pytest.mark.parametrize("int8_mask", [False, True])
def test_gta_hand_values(consensus, normalize, int8_mask):
    reducer = GTAReducer(consensus_method=consensus, normalize=normalize, int8_mask=int8_mask)
    deltas = [torch.tensor(d, dtype=torch.float64) for d in HAND_DELTAS]
    results, log = run_replicas(reducer, deltas, HAND_WEIGHTS)
    assert_all_same(results)
    expected = torch.tensor(HAND_EXPECTED[(consensus, normalize)], dtype=torch.float64)
    # float64 hand values through a few operations on 4 elements: 4.5 ulps (class 2)
    torch.testing.assert_close(results[0], expected, rtol=1e-15, atol=0)
    # Two collectives: the sign election, then numerator (+ divisor) packed in one.
    second = ((2, 4) if normalize else (1, 4), torch.float64)
    assert log == [[((4,), torch.float64), second]] * 3


def test_gta_hand_values_float32():
    reducer = GTAReducer(consensus_method="count")
    deltas = [torch.tensor(d, dtype=torch.float32) for d in HAND_DELTAS]
    results, _ = run_replicas(reducer, deltas, HAND_WEIGHTS)
    assert_all_same(results)
    assert results[0].dtype == torch.float32
    expected = torch.tensor(HAND_EXPECTED[("count", True)], dtype=torch.float32)
    # float32 defaults (rtol 1.3e-6 = 11 ulps, atol 1e-5) on hand values of order 1
    torch.testing.assert_close(results[0], expected)


@pytest.mark.parametrize("consensus", ["sum", "count"])
def test_gta_excluded_replica_contributes_nothing(consensus):
    # Replica 2 is excluded (weight 0) and holds garbage. Had its delta been used,
    # its NaN would poison entry 0 and its -100s would flip the count vote on entry 1.
    deltas = [
        torch.tensor([1.0, -2.0, 3.0, 0.0], dtype=torch.float64),
        torch.tensor([3.0, 2.0, -1.0, 4.0], dtype=torch.float64),
        torch.tensor([math.nan, -100.0, -100.0, -100.0], dtype=torch.float64),
    ]
    weights = [0.5, 0.5, 0.0]
    # x0 = [0.5, -1, 1.5, 0], x1 = [1.5, 1, -0.5, 2]: every vote is + (ties included).
    # Kept: {x0, x1}, {x1}, {x0}, {x1} -> numerator [2, 1, 1.5, 2], divisor [1, .5, .5, .5].
    results, _ = run_replicas(GTAReducer(consensus_method=consensus), deltas, weights)
    assert_all_same(results)
    assert results[0].tolist() == [2.0, 2.0, 3.0, 4.0]

    plain = GTAReducer(consensus_method=consensus, normalize=False)
    results, _ = run_replicas(plain, deltas, weights)
    assert results[0].tolist() == [2.0, 1.0, 1.5, 2.0]


def test_gta_entries_nobody_keeps_stay_zero():
    deltas = [torch.tensor([0.0, 1.0], dtype=torch.float64)] * 2
    results, _ = run_replicas(GTAReducer(), deltas, [0.5, 0.5])
    # Entry 0: divisor 0 -> replaced by 1, result 0 rather than 0/0 = NaN.
    assert results[0].tolist() == [0.0, 1.0]


# ---------------------------------------------------------------------------
# GTAReducer: sparsification (density < 1) really synchronises (defect 1)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("consensus", ["sum", "count"])
@pytest.mark.parametrize("normalize", [True, False])
def test_gta_magnitude_sparsification_is_reduced(consensus, normalize):
    world, n, density = 3, 37, 0.5  # keeps ceil(18.5) = 19 entries per replica
    deltas = rand_deltas(world, n, seed=1)
    weights = [0.5, 0.3, 0.2]
    reducer = GTAReducer(
        consensus_method=consensus,
        sparsification_method="magnitude",
        density=density,
        normalize=normalize,
    )
    results, log = run_replicas(reducer, deltas, weights)

    assert_all_same(results)
    keeps = [topk_keep(d, density) for d in deltas]
    assert all(int(k.sum()) == 19 for k in keeps)
    expected = gta_reference(deltas, weights, keeps, consensus=consensus, normalize=normalize)
    torch.testing.assert_close(results[0].double(), expected, **F32_VS_F64)
    # The reference implementation returned each replica's own sparsified delta.
    for d, k in zip(deltas, keeps):
        assert not torch.allclose(results[0], torch.where(k, d, 0.0))
    # One all-gather of 19 positions of 6 bits (15 bytes) and 19 fp32 values (76 bytes).
    assert log == [[("all_gather", (15 + 76,), torch.uint8)]] * world


@pytest.mark.parametrize("method", ["random", "rescaled_random"])
@pytest.mark.parametrize("consensus", ["sum", "count"])
def test_gta_random_sparsification_is_reduced(method, consensus):
    world, n, density = 4, 50, 0.4
    deltas = rand_deltas(world, n, seed=2)
    weights = [0.1, 0.2, 0.3, 0.4]
    seeds = [100 + r for r in range(world)]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    reducer = GTAReducer(consensus_method=consensus, sparsification_method=method, density=density)
    results, _ = run_replicas(reducer, deltas, weights, generators=gens)

    assert_all_same(results)
    keeps = [random_keep(s, n, density) for s in seeds]
    expected = gta_reference(
        deltas,
        weights,
        keeps,
        consensus=consensus,
        normalize=True,
        rescale=density if method == "rescaled_random" else None,
    )
    torch.testing.assert_close(results[0].double(), expected, **F32_VS_F64)
    # Entries kept by no replica are exactly zero.
    dropped = ~torch.stack(keeps).any(0)
    assert dropped.any() and torch.all(results[0][dropped] == 0)


def test_gta_random_mask_follows_the_generator():
    deltas = rand_deltas(2, 64, seed=3)
    reducer = GTAReducer(sparsification_method="random", density=0.5)

    def go(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return run_replicas(reducer, deltas, [0.5, 0.5], generators=gens)[0][0]

    assert torch.equal(go([1, 2]), go([1, 2]))
    assert not torch.equal(go([1, 2]), go([3, 4]))


@pytest.mark.parametrize(
    ("density", "kept"),
    [(0.07, 7), (0.55, 55), (0.123, 13), (0.001, 1), (1.0, 100)],
)
def test_gta_magnitude_keep_count_on_one_replica(density, kept):
    # ceil(density * 100): 0.07 * 100 is 7.000000000000001 in binary and must keep 7, not 8.
    gen = torch.Generator().manual_seed(5)
    magnitudes = torch.randperm(100, generator=gen).double() + 1.0  # distinct, no ties
    signs = torch.where(torch.rand(100, generator=gen) < 0.5, -1.0, 1.0).double()
    delta = magnitudes * signs
    reducer = GTAReducer(sparsification_method="magnitude", density=density)
    # One replica: the sum over the group is the tensor itself.
    got = reducer.reduce(delta, 1.0, lambda t: None, weights=[1.0], all_gather=gather_one)
    # With one replica and normalize, the result is the sparsified delta itself:
    # the entries of magnitude > 100 - kept survive.
    expected = torch.where(magnitudes > 100 - kept, delta, 0.0)
    assert int((got != 0).sum()) == kept
    assert torch.equal(got, expected)


def test_gta_single_replica_rescaled_random():
    delta = torch.arange(1.0, 21.0, dtype=torch.float64)
    reducer = GTAReducer(sparsification_method="rescaled_random", density=0.5)
    got = reducer.reduce(
        delta,
        0.7,
        lambda t: None,
        generator=torch.Generator().manual_seed(9),
        weights=[0.7],
        all_gather=gather_one,
    )
    keep = random_keep(9, 20, 0.5)
    # normalize divides w * d / density by w: d / density on kept entries (float64, two
    # roundings against one: 1e-15 relative is 4.5 ulps)
    torch.testing.assert_close(got, torch.where(keep, delta / 0.5, 0.0), rtol=1e-15, atol=0)


def test_gta_int8_mask_changes_no_value():
    deltas = rand_deltas(3, 40, seed=4)
    weights = [0.6, 0.0, 0.4]
    out = {}
    for int8 in (False, True):
        reducer = GTAReducer(
            consensus_method="count",
            sparsification_method="magnitude",
            density=0.6,
            int8_mask=int8,
        )
        out[int8] = run_replicas(reducer, deltas, weights)[0][0]
    assert torch.equal(out[False], out[True])


def test_reducers_keep_shape_and_leave_delta_untouched():
    deltas = [torch.randn(3, 5, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    originals = [d.clone() for d in deltas]
    for reducer in (
        MeanReducer(),
        GTAReducer(),
        GTAReducer(sparsification_method="rescaled_random", density=0.5),
    ):
        results, _ = run_replicas(reducer, deltas, [0.5, 0.5])
        assert results[0].shape == (3, 5)
        for d, o in zip(deltas, originals):
            assert torch.equal(d, o)


# ---------------------------------------------------------------------------
# GTAReducer: the sparse transport (density < 1 gathers compact messages)
# ---------------------------------------------------------------------------


def dense_formulas_fp32(xs, weights, *, consensus, normalize):
    """Section 7 steps 3-4 on dense fp32 vectors ``xs[j] = w_j * delta_j^sparse``, summed
    in replica order: what the sparse transport must reproduce bit for bit."""
    vote = torch.zeros_like(xs[0])
    for x in xs:
        vote = vote + (x if consensus == "sum" else torch.sign(x))
    plus = vote >= 0
    num = torch.zeros_like(xs[0])
    div = torch.zeros_like(xs[0])
    for x, w in zip(xs, weights):
        m = torch.where(plus, x > 0, x < 0)
        num = num + x * m
        div = div + m.float() * w
    if not normalize:
        return num
    return num / torch.where(div < 1e-8, torch.ones_like(div), div)


TRANSPORT_N = 301  # positions of 9 bits


@pytest.mark.parametrize("method", ["magnitude", "random", "rescaled_random"])
@pytest.mark.parametrize("consensus", ["sum", "count"])
@pytest.mark.parametrize("normalize", [True, False])
def test_gta_sparse_transport_equals_the_dense_formulas(method, consensus, normalize):
    world, n, density = 4, TRANSPORT_N, 0.3
    deltas = rand_deltas(world, n, seed=7)
    deltas[2] = torch.full((n,), math.nan)  # excluded: never read
    weights = [0.25, 0.45, 0.0, 0.3]
    seeds = [40 + r for r in range(world)]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    reducer = GTAReducer(consensus_method=consensus, sparsification_method=method,
                         density=density, normalize=normalize)
    results, log = run_replicas(reducer, deltas, weights, generators=gens)
    assert_all_same(results)
    got = results[0]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()

    if method == "magnitude":
        keeps = [topk_keep(d, density) for d in deltas]
    else:
        keeps = [random_keep(s, n, density) for s in seeds]
    rescale = density if method == "rescaled_random" else None
    # Independent of the reducer: float64 over all replicas at once ...
    expected = gta_reference(deltas, weights, keeps, consensus=consensus,
                             normalize=normalize, rescale=rescale)
    torch.testing.assert_close(got.double(), expected, **F32_VS_F64)
    # ... and the dense formulas in fp32, replica order: the same bits.
    xs = []
    for d, w, keep in zip(deltas, weights, keeps):
        s = torch.where(keep, d, 0.0) if w else torch.zeros(n)
        xs.append((s / density if rescale else s) * w)
    assert torch.equal(got, dense_formulas_fp32(xs, weights, consensus=consensus,
                                                normalize=normalize))
    assert not torch.equal(got, xs[0] / weights[0])  # the replicas really merged

    # Bytes sized by what is kept: 9-bit positions, fp32 values.
    if method == "magnitude":
        slots = 91  # ceil(0.3 * 301), the same on every replica, the excluded one too
        assert log == [[("all_gather", (103 + 4 * slots,), torch.uint8)]] * world
    else:
        slots = max(int(keeps[j].sum()) for j in range(world) if weights[j])
        message = -(-9 * slots // 8) + 4 * slots
        assert log == [[("all_gather", (1,), torch.int64),
                        ("all_gather", (message,), torch.uint8)]] * world
    # ... well under the numel * 4 bytes of a dense fp32 tensor (under half of it).
    assert 4 * slots + (9 * slots + 7) // 8 < 0.5 * 4 * n


def test_gta_messages_hold_packed_positions_then_values():
    # One replica of 10 entries at density 0.3 keeps the 3 largest |x|: positions 1, 4, 8
    # (4 bits each, LSB first) then their fp32 values w * delta.
    delta = torch.tensor([0.1, -5.0, 0.2, 0.3, 4.0, -0.4, 0.5, 0.6, -3.0, 0.7])
    sent = []

    def gather(t):
        sent.append(t.clone())
        return gather_one(t)

    reducer = GTAReducer(sparsification_method="magnitude", density=0.3, normalize=False)
    got = reducer.reduce(delta, 0.5, lambda t: None, weights=[0.5], all_gather=gather)
    assert got.tolist() == [0.0, -2.5, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, -1.5, 0.0]
    assert len(sent) == 1 and sent[0].dtype == torch.uint8
    msg = sent[0]
    assert len(msg) == gta_message_bytes(10, 3) == 2 + 12
    # 1 | 4 << 4 = 0x41, then 8 in the low nibble of the second byte.
    assert msg[:2].tolist() == [0x41, 0x08]
    assert msg[2:].clone().view(torch.float32).tolist() == [-2.5, 2.0, -1.5]


def test_gta_excluded_replica_sends_zeros_of_the_same_size():
    deltas = rand_deltas(3, 50, seed=8)
    deltas[1] = torch.full((50,), math.inf)
    group = FakeSyncGroup(3)
    sent: list[list[torch.Tensor]] = [[] for _ in range(3)]
    results = [None] * 3

    def worker(rank):
        inner = group.all_gather_for(rank)

        def gather(t):
            sent[rank].append(t.clone())
            return inner(t)

        reducer = GTAReducer(sparsification_method="magnitude", density=0.2)
        results[rank] = reducer.reduce(deltas[rank], [0.5, 0.0, 0.5][rank],
                                       group.all_reduce_for(rank),
                                       weights=[0.5, 0.0, 0.5], all_gather=gather)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_all_same(results)
    # 10 positions of 6 bits (8 bytes) and 10 fp32 values on every replica.
    assert [len(m) for m, in sent] == [8 + 40] * 3
    assert not sent[1][0].any() and sent[0][0].any()
    keeps = [topk_keep(d, 0.2) for d in deltas]
    expected = gta_reference(deltas, [0.5, 0.0, 0.5], keeps, consensus="sum", normalize=True)
    torch.testing.assert_close(results[0].double(), expected, **F32_VS_F64)


def test_gta_magnitude_ties_keep_the_lower_positions():
    # |delta| = 2 at 3 positions, 1 at 5: keeping 5 takes every 2 and the first two 1s.
    delta = torch.tensor([1.0, -2.0, 1.0, -1.0, 2.0, 1.0, -2.0, 1.0])
    reducer = GTAReducer(sparsification_method="magnitude", density=5 / 8)
    got = reducer.reduce(delta, 1.0, lambda t: None, weights=[1.0], all_gather=gather_one)
    assert got.tolist() == [1.0, -2.0, 1.0, 0.0, 2.0, 0.0, -2.0, 0.0]
    # Every entry tied: the first k.
    got = reducer.reduce(torch.full((8,), -3.0), 1.0, lambda t: None, weights=[1.0],
                         all_gather=gather_one)
    assert got.tolist() == [-3.0] * 5 + [0.0] * 3


def test_gta_random_nobody_keeps_anything():
    # Both replicas excluded: counts are gathered (both 0) and no message follows.
    deltas = rand_deltas(2, 20, seed=9)
    reducer = GTAReducer(sparsification_method="random", density=0.5)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    results, log = run_replicas(reducer, deltas, [0.0, 0.0], generators=gens)
    assert all(r.tolist() == [0.0] * 20 for r in results)
    assert log == [[("all_gather", (1,), torch.int64)]] * 2
    # An excluded replica draws nothing: its generator is untouched.
    assert torch.equal(gens[0].get_state(), torch.Generator().manual_seed(1).get_state())


def test_gta_sparse_positions_pack_block_by_block(monkeypatch):
    monkeypatch.setattr(reducers, "_PACK_BLOCK", 16)
    pos = torch.randperm(1000, generator=torch.Generator().manual_seed(3))[:77].sort().values
    packed = reducers._pack_positions(pos, 10)
    assert torch.equal(packed, pack_bits(pos, 10))  # the same bytes as one call
    assert torch.equal(reducers._unpack_positions(packed, 77, 10), pos)
    # A transport across several blocks still matches the dense formulas.
    deltas = rand_deltas(2, 200, seed=10)
    reducer = GTAReducer(sparsification_method="magnitude", density=0.4)
    results, _ = run_replicas(reducer, deltas, [0.5, 0.5])
    keeps = [topk_keep(d, 0.4) for d in deltas]
    expected = gta_reference(deltas, [0.5, 0.5], keeps, consensus="sum", normalize=True)
    torch.testing.assert_close(results[0].double(), expected, **F32_VS_F64)


def test_gta_sparse_transport_needs_weights_and_all_gather():
    reducer = GTAReducer(sparsification_method="magnitude", density=0.5)
    with pytest.raises(ValueError, match="weights and all_gather"):
        reducer.reduce(torch.ones(4), 1.0, lambda t: None)
    with pytest.raises(ValueError, match="2 weights for 1 replicas"):
        reducer.reduce(torch.ones(4), 1.0, lambda t: None, weights=[1.0, 0.0],
                       all_gather=gather_one)


# ---------------------------------------------------------------------------
# construction and validation
# ---------------------------------------------------------------------------


def test_build_reducer():
    for name in (None, "linear", "mean"):
        assert isinstance(build_reducer(name), MeanReducer)
    # GTA options at their defaults (or None) are fine with the mean reducer.
    assert isinstance(
        build_reducer(None, consensus_method=None, sparsification_method=None, density=1.0),
        MeanReducer,
    )
    gta = build_reducer(
        "gta",
        consensus_method="count",
        sparsification_method="magnitude",
        density=0.25,
        normalize=False,
        int8_mask=True,
    )
    assert isinstance(gta, GTAReducer) and isinstance(gta, Reducer)
    assert (gta.consensus_method, gta.sparsification_method, gta.density) == (
        "count",
        "magnitude",
        0.25,
    )
    assert (gta.normalize, gta.int8_mask) == (False, True)
    assert GTAReducer.collectives_per_call == 2


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"consensus_method": "max"}, "consensus_method"),
        ({"consensus_method": None}, "consensus_method"),
        ({"sparsification_method": "topk"}, "sparsification_method"),
        ({"sparsification_method": "magnitude", "density": 0.0}, "density"),
        ({"sparsification_method": "magnitude", "density": 1.5}, "density"),
        ({"sparsification_method": "random", "density": math.nan}, "density"),
        ({"sparsification_method": "random", "density": "0.5"}, "density"),
        ({"density": 0.5}, "density"),  # density without a sparsification method
    ],
)
def test_gta_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GTAReducer(**kwargs)
    with pytest.raises(ValueError, match=name):
        build_reducer("gta", **kwargs)


def test_build_reducer_validation():
    with pytest.raises(ValueError, match="reducer"):
        build_reducer("ties")
    with pytest.raises(ValueError, match='reducer = "gta"'):
        build_reducer("mean", sparsification_method="magnitude", density=0.5)
    with pytest.raises(TypeError, match="dencity"):
        build_reducer("gta", dencity=0.5)


@pytest.mark.parametrize("weight", [-0.1, math.nan, math.inf])
@pytest.mark.parametrize("reducer", [MeanReducer(), GTAReducer()])
def test_bad_weight_is_rejected(reducer, weight):
    with pytest.raises(ValueError, match="weight"):
        reducer.reduce(torch.ones(3), weight, lambda t: None)


def test_gta_reducer_takes_a_numpy_density_and_refuses_a_bool():
    """A numpy density (``np.float32(0.5)``) was refused as "not a number"; it is stored as
    a plain float. A bool is still no density."""
    np = pytest.importorskip("numpy")
    reducer = GTAReducer(sparsification_method="magnitude", density=np.float32(0.5))
    assert type(reducer.density) is float and reducer.density == 0.5
    with pytest.raises(ValueError, match="density must be a number in"):
        GTAReducer(sparsification_method="magnitude", density=True)
