"""Tests for editrain.sync.penalty: EWMA detector, detector bank, weights, clipping.

Expected values are worked out by hand or by a small float64 loop written
here from the algorithm spec (docs/algorithm.md sections 5 and 6), never by
calling the code under test.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from editrain.sync.penalty import (
    DetectorBank,
    EWMADetector,
    clip_coefficient,
    compute_weights,
    finite_mask,
)

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def wiggle(i: int, base: float = 1.0, amp: float = 0.05) -> float:
    """Deterministic bounded noise: no value ever strays more than amp from base,
    so any flag on these values is a detector bug, not bad luck."""
    return base + amp * math.sin(1.3 * i)


def reference_observe(values, alpha, warmup, threshold):
    """Section 6 of the spec as a plain float64 loop.

    Returns the per-value (outlier, z) and the final (mean, var, count, window).
    """
    mean = var = 0.0
    count = 0
    window: list[float] = []

    def z_of(v):
        if count < warmup or var == 0.0:
            return 0.0
        return (v - mean) / math.sqrt(var)

    def pstd(xs):
        if not xs:
            return 1.0
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))

    out = []
    for v in values:
        z = z_of(v)
        flagged = count >= warmup and z > threshold * max(1.0, pstd(window))
        fed = mean + threshold * math.sqrt(var) if flagged else v
        count += 1
        a = max(alpha, 1.0 / count)  # started from the first observations
        d = fed - mean
        mean = mean + a * d
        var = (1 - a) * (var + a * d * (fed - mean))
        window.append(z_of(fed))
        window = window[-warmup:] if warmup > 0 else []
        out.append((flagged, z))
    return out, (mean, var, count, window)


def warmed_detector(n: int = 300, **kwargs) -> EWMADetector:
    """A default-config detector that has seen n bounded-noise norms around 1.0."""
    det = EWMADetector(**kwargs)
    for i in range(n):
        flagged, _ = det.observe(wiggle(i))
        assert not flagged
    return det


# ---------------------------------------------------------------------------
# EWMADetector
# ---------------------------------------------------------------------------


def test_detector_hand_values():
    # warmup 1: only the first value is in warm-up, and the window holds the last z-score.
    det = EWMADetector(alpha=0.5, warmup=1, threshold=5.0)
    assert det.observe(2.0) == (False, 0.0)
    # The first update starts the statistics from the value: rate 1, mean 2, var 0.
    assert det.mean == 2.0 and det.var == 0.0 and det.count == 1
    assert list(det.window) == [0.0]  # var == 0: z is 0

    # z before the update is 0 (var == 0) -> accepted. Rate max(0.5, 1/2) = 0.5:
    # d = 2, mean = 3, var = 0.5 * (0 + 0.5 * 2 * 1) = 0.5; window gets 1 / sqrt(0.5).
    assert det.observe(4.0) == (False, 0.0)
    assert det.mean == 3.0 and det.var == 0.5 and det.count == 2
    assert list(det.window) == pytest.approx([math.sqrt(2.0)], rel=1e-15)

    # z(10) = 7 / sqrt(0.5) = 9.9 > 5 * max(1, std(window) = 0) -> outlier.
    flagged, z = det.observe(10.0)
    assert flagged
    assert z == pytest.approx(7.0 * math.sqrt(2.0), rel=1e-15)
    # Winsorised feed: v = 3 + 5 sqrt(0.5), d = 5 sqrt(0.5), rate 0.5 (1/3 < 0.5):
    # mean = 3 + 2.5 sqrt(0.5), var = 0.5 * (0.5 + 0.5 * d * d / 2) = 1.8125.
    assert det.mean == pytest.approx(3.0 + 2.5 * math.sqrt(0.5), rel=1e-15)
    assert det.var == pytest.approx(1.8125, rel=1e-15)
    assert det.count == 3
    # z of the fed value under the new statistics: 2.5 sqrt(0.5) / sqrt(1.8125).
    assert det.window[-1] == pytest.approx(2.5 * math.sqrt(0.5) / math.sqrt(1.8125), rel=1e-14)


def test_detector_starts_from_its_first_observations():
    """Norms around 1 with spread 0.05: started from 0 (the rule before), the first norms'
    distance to 0 kept the std estimate far too large at the end of warm-up; started from
    the first observations it is the spread of the norms."""
    gen = torch.Generator().manual_seed(7)
    values = (1.0 + 0.05 * torch.randn(120, generator=gen, dtype=torch.float64)).tolist()
    det = EWMADetector(alpha=0.02, warmup=120, threshold=3.0)
    for v in values:
        det.observe(v)
    assert det.mean == pytest.approx(1.0, abs=0.02)
    assert 0.035 < math.sqrt(det.var) < 0.065, math.sqrt(det.var)
    # equal weights while count < 1 / alpha: exactly the running mean and the West
    # variance of the first observations
    first = EWMADetector(alpha=0.02, warmup=120, threshold=3.0)
    for v in values[:10]:
        first.update(v)
    assert first.mean == pytest.approx(sum(values[:10]) / 10, rel=1e-14)


def test_detector_warmup_window_holds_zeros_until_count_reaches_warmup():
    det = EWMADetector(alpha=0.5, warmup=2, threshold=1.0)
    assert det.observe(2.0) == (False, 0.0)
    # count = 1 < warmup: z is 0 and even a large value is not flagged.
    assert det.observe(4.0) == (False, 0.0)
    # The second update ends with count == warmup, so its z-score is real: mean 3, var 0.5.
    assert list(det.window) == pytest.approx([0.0, math.sqrt(2.0)], rel=1e-15)
    # The window keeps only the last `warmup` z-scores.
    det.observe(2.6)
    assert len(det.window) == 2


def test_detector_matches_float64_reference_loop():
    gen = torch.Generator().manual_seed(1234)
    values = (1.0 + 0.1 * torch.randn(200, generator=gen, dtype=torch.float64)).tolist()
    for i in (40, 41, 90, 150, 151, 152):
        values[i] += 2.0  # spikes exercise the winsorised path
    alpha, warmup, threshold = 0.1, 25, 2.5
    expected, (mean, var, count, window) = reference_observe(values, alpha, warmup, threshold)

    det = EWMADetector(alpha=alpha, warmup=warmup, threshold=threshold)
    got = [det.observe(v) for v in values]

    assert [f for f, _ in got] == [f for f, _ in expected]
    assert sum(f for f, _ in expected) >= 4  # the spikes really were flagged
    assert [z for _, z in got] == pytest.approx([z for _, z in expected], rel=1e-12, abs=1e-12)
    assert det.mean == pytest.approx(mean, rel=1e-13)
    assert det.var == pytest.approx(var, rel=1e-13)
    assert det.count == count == 200
    assert list(det.window) == pytest.approx(window, rel=1e-12, abs=1e-12)


def test_window_spread_widens_the_threshold():
    # sigma = 0.1 around mean 1, so z(1.5) = 5 and z(1.7) = 7; threshold 3.
    state = {"mean": 1.0, "var": 0.01, "count": 10, "window": [-2.0, 2.0, -2.0, 2.0]}
    det = EWMADetector(alpha=0.1, warmup=4, threshold=3.0)
    det.load_state_dict(state)
    # std(window) = 2 widens the test to z > 6.
    assert det.window_std() == 2.0
    assert not det.is_outlier(1.5)
    assert det.is_outlier(1.7)
    # A narrow window (std 0.05) never tightens it below z > 3.
    det.load_state_dict({**state, "window": [0.1, 0.2, 0.1, 0.2]})
    assert det.window_std() == pytest.approx(0.05, rel=1e-12)
    assert det.is_outlier(1.5)
    assert not det.is_outlier(1.25)


def test_nothing_flagged_during_warmup():
    det = EWMADetector()  # warmup 120
    for i in range(120):
        assert not det.is_outlier(1e9)
        v = 1e6 if i % 7 == 3 else wiggle(i)  # huge spikes, but still warming up
        assert det.observe(v) == (False, 0.0)
    assert det.count == 120
    # Warm-up is over: the next huge value can be flagged.
    assert det.is_outlier(1e9)


def test_spike_after_warmup_is_flagged_and_normal_values_are_not():
    det = warmed_detector()
    flagged, z = det.observe(3.0)
    assert flagged and z > 3.0
    # The detector stays calibrated: ordinary values are accepted again.
    for i in range(300, 400):
        assert not det.observe(wiggle(i))[0]


def test_three_spikes_in_a_row_are_all_flagged():
    det = warmed_detector()
    flags = [det.observe(3.0)[0] for _ in range(3)]
    assert flags == [True, True, True]
    # Each winsorised update moves the mean up by only alpha * threshold * sigma.
    assert det.mean < 1.05

    # Defect 2 contrast: feeding the reference's +1e6-penalised value inflates the
    # variance so much that the following spikes pass unnoticed.
    ref = warmed_detector()
    ref_flags = []
    for _ in range(3):
        flagged = ref.is_outlier(3.0)
        ref.update(3.0 + 1e6 if flagged else 3.0)
        ref_flags.append(flagged)
    assert ref_flags == [True, False, False]


def test_lasting_level_shift_is_eventually_accepted():
    det = warmed_detector()
    flags = [det.observe(wiggle(i, base=1.5))[0] for i in range(300, 800)]
    assert flags[0]  # the jump itself looks anomalous at first
    assert not any(flags[100:])  # ... and is accepted as the new normal
    assert det.mean == pytest.approx(1.5, abs=0.01)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"alpha": 0.0}, "ewma_alpha"),
        ({"alpha": 1.5}, "ewma_alpha"),
        ({"alpha": math.nan}, "ewma_alpha"),
        ({"warmup": -1}, "ewma_warmup_steps"),
        ({"warmup": 2.5}, "ewma_warmup_steps"),
        ({"threshold": 0.0}, "ewma_threshold"),
        ({"threshold": -3.0}, "ewma_threshold"),
    ],
)
def test_detector_validates_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EWMADetector(**kwargs)
    with pytest.raises(ValueError, match=name):
        DetectorBank(2, 2, **kwargs)


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"warmup": -1}, "ewma_warmup_steps: must be >= 0, got -1"),
    ({"warmup": 2.0}, "ewma_warmup_steps: expected an integer, got 2.0"),
    ({"warmup": True}, "ewma_warmup_steps: expected an integer, got true"),
    ({"alpha": "0.1"}, 'ewma_alpha: expected a number, got "0.1"'),
    ({"alpha": 1.5}, "ewma_alpha: must be in (0, 1], got 1.5"),
    ({"threshold": math.inf}, "ewma_threshold: must be a finite number > 0, got inf"),
])
def test_detector_arguments_are_refused_in_the_words_of_every_option(kwargs, said):
    """The detector checked its warm-up by hand ("ewma_warmup_steps must be an integer >=
    0"), and a string alpha failed inside a comparison (TypeError); one check now
    (errors.plain_scalar / plain_count), worded "OPTION: ..." as every option is."""
    for make in (EWMADetector, lambda **kw: DetectorBank(2, 2, **kw)):
        with pytest.raises(ValueError) as e:
            make(**kwargs)
        assert str(e.value) == said


def test_detector_takes_numpy_scalars_as_plain_numbers():
    np = pytest.importorskip("numpy")
    args = (np.float32(0.5), np.int64(3), np.float32(2.0))
    for det in (EWMADetector(*args), DetectorBank(1, 1, *args)):
        assert (type(det.alpha), type(det.warmup), type(det.threshold)) == (float, int, float)
    assert DetectorBank(1, 1, *args).detector(0, 0).warmup == 3


def test_detector_update_rejects_non_finite():
    det = EWMADetector()
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            det.observe(bad)
    assert det.state_dict() == {"mean": 0.0, "var": 0.0, "count": 0, "window": []}


def test_window_std_is_population_std_and_one_when_empty():
    det = EWMADetector(warmup=4)
    assert det.window_std() == 1.0
    det.window.extend([1.0, 2.0, 3.0, 4.0])
    # ddof=0: sqrt(((1.5^2 + 0.5^2) * 2) / 4) = sqrt(1.25)
    assert det.window_std() == pytest.approx(math.sqrt(1.25), rel=1e-15)
    # warmup 0: the window never holds anything, so its std stays 1.
    det0 = EWMADetector(warmup=0)
    for i in range(5):
        det0.observe(wiggle(i))
    assert len(det0.window) == 0 and det0.window_std() == 1.0 and det0.count == 5


def test_detector_state_dict_round_trip_continues_identically():
    det = EWMADetector(alpha=0.1, warmup=10, threshold=2.0)
    for i in range(30):
        det.observe(wiggle(i) + (3.0 if i == 20 else 0.0))
    clone = EWMADetector(alpha=0.1, warmup=10, threshold=2.0)
    clone.load_state_dict(json.loads(json.dumps(det.state_dict())))
    for i in range(30, 60):
        v = wiggle(i) + (3.0 if i % 9 == 0 else 0.0)
        assert clone.observe(v) == det.observe(v)
    assert clone.state_dict() == det.state_dict()


# ---------------------------------------------------------------------------
# finite_mask and DetectorBank
# ---------------------------------------------------------------------------


def test_finite_mask():
    norms = torch.tensor([[1.0, math.nan], [math.inf, -math.inf], [0.0, 2.0]])
    expected = torch.tensor([[True, False], [False, False], [True, True]])
    assert torch.equal(finite_mask(norms), expected)


def test_bank_matches_one_detector_per_unit_and_replica():
    num_replicas, num_units = 3, 2
    bank = DetectorBank(num_units, num_replicas, alpha=0.2, warmup=5, threshold=2.0)
    loose = [[EWMADetector(0.2, 5, 2.0) for _ in range(num_units)] for _ in range(num_replicas)]
    for step in range(20):
        norms = torch.tensor(
            [
                [wiggle(step + 3 * r + u, base=1 + r + u) for u in range(num_units)]
                for r in range(3)
            ],
            dtype=torch.float32,
        )
        if step == 12:
            norms[1, 0] = 50.0  # an outlier for (unit 0, replica 1) only
        included, outlier, z = bank.observe(norms)
        assert included.dtype == torch.bool and outlier.dtype == torch.bool
        assert z.dtype == torch.float64 and z.shape == (num_replicas, num_units)
        for r in range(num_replicas):
            for u in range(num_units):
                flagged, z_ru = loose[r][u].observe(float(norms[r, u]))
                assert bool(outlier[r, u]) == flagged
                assert bool(included[r, u]) == (not flagged)
                assert z[r, u].item() == z_ru
        if step == 12:
            assert outlier.tolist() == [[False, False], [True, False], [False, False]]


@pytest.mark.parametrize("warmup", [0, 100])
def test_bank_excludes_non_finite_and_never_feeds_them(warmup):
    bank = DetectorBank(num_units=2, num_replicas=3, alpha=0.1, warmup=warmup, threshold=3.0)
    for step in range(10):
        bank.observe(torch.tensor([[wiggle(step + r + u) for u in range(2)] for r in range(3)]))
    before = copy.deepcopy(bank.state_dict())

    norms = torch.tensor(
        [[1.0, math.nan], [math.inf, 1.01], [0.99, -math.inf]], dtype=torch.float64
    )
    included, outlier, z = bank.observe(norms)
    assert included.tolist() == [[True, False], [False, True], [True, False]]
    assert outlier.tolist() == [[False] * 2] * 3  # not judged, only excluded
    assert torch.isnan(z).tolist() == [[False, True], [True, False], [False, True]]

    after = bank.state_dict()
    for r, u in [(0, 1), (1, 0), (2, 1)]:
        assert after["detectors"][str(u)][str(r)] == before["detectors"][str(u)][str(r)]
    for r, u in [(0, 0), (1, 1), (2, 0)]:
        assert after["detectors"][str(u)][str(r)]["count"] == 11


def test_bank_rejects_wrong_shape():
    bank = DetectorBank(num_units=4, num_replicas=2)
    with pytest.raises(ValueError, match=r"\[R, L\]"):
        bank.observe(torch.ones(4, 2))


def feed(bank: DetectorBank, steps: range, num_replicas: int, num_units: int):
    """Feed a deterministic norm matrix per step (with occasional spikes); return outputs."""
    outs = []
    for s in steps:
        norms = torch.tensor(
            [
                [wiggle(s + 5 * r + u, base=1.0 + 0.5 * u) for u in range(num_units)]
                for r in range(num_replicas)
            ],
            dtype=torch.float64,
        )
        if s % 11 == 0:
            norms[s % num_replicas, s % num_units] += 4.0
        outs.append(bank.observe(norms))
    return outs


def test_bank_state_dict_round_trip_continues_identically():
    kwargs = dict(alpha=0.1, warmup=8, threshold=2.5)
    bank = DetectorBank(3, 2, **kwargs)
    feed(bank, range(40), 2, 3)
    sd = bank.state_dict()
    # Plain data: survives JSON unchanged.
    sd = json.loads(json.dumps(sd))
    assert sd["num_units"] == 3 and sd["num_replicas"] == 2

    resumed = DetectorBank(3, 2, **kwargs)
    resumed.load_state_dict(sd)
    a = feed(bank, range(40, 80), 2, 3)
    b = feed(resumed, range(40, 80), 2, 3)
    assert any(bool(o.any()) for _, o, _ in a)  # the continuation really flags something
    for (inc_a, out_a, z_a), (inc_b, out_b, z_b) in zip(a, b):
        assert torch.equal(inc_a, inc_b) and torch.equal(out_a, out_b) and torch.equal(z_a, z_b)
    assert resumed.state_dict() == bank.state_dict()


def test_bank_resize_keeps_surviving_replicas():
    bank = DetectorBank(2, 3, alpha=0.1, warmup=4, threshold=3.0)
    feed(bank, range(10), 3, 2)
    old = bank.state_dict()["detectors"]

    bank.resize(2)
    assert bank.num_replicas == 2
    new = bank.state_dict()["detectors"]
    for u in ("0", "1"):
        assert set(new[u]) == {"0", "1"}
        assert new[u]["0"] == old[u]["0"] and new[u]["1"] == old[u]["1"]

    bank.resize(4)
    new = bank.state_dict()["detectors"]
    for u in ("0", "1"):
        assert new[u]["1"] == old[u]["1"]
        assert new[u]["3"] == {"mean": 0.0, "var": 0.0, "count": 0, "window": []}
    assert bank.observe(torch.ones(4, 2))[0].shape == (4, 2)


def test_bank_load_state_dict_with_different_replica_count():
    saved = DetectorBank(2, 3, alpha=0.1, warmup=4, threshold=3.0)
    feed(saved, range(10), 3, 2)
    sd = saved.state_dict()

    bigger = DetectorBank(2, 4, alpha=0.1, warmup=4, threshold=3.0)
    with pytest.raises(ValueError, match="allow_resize"):
        bigger.load_state_dict(sd)
    bigger.load_state_dict(sd, allow_resize=True)
    got = bigger.state_dict()
    assert got["num_replicas"] == 4
    for u in ("0", "1"):
        for r in ("0", "1", "2"):
            assert got["detectors"][u][r] == sd["detectors"][u][r]
        assert got["detectors"][u]["3"]["count"] == 0

    smaller = DetectorBank(2, 1, alpha=0.1, warmup=4, threshold=3.0)
    smaller.load_state_dict(sd, allow_resize=True)
    assert smaller.state_dict()["detectors"]["1"]["0"] == sd["detectors"]["1"]["0"]

    with pytest.raises(ValueError, match="units"):
        DetectorBank(5, 3).load_state_dict(sd, allow_resize=True)


# ---------------------------------------------------------------------------
# compute_weights
# ---------------------------------------------------------------------------

ALL3 = torch.ones(3, 1, dtype=torch.bool)


def test_weights_softmax_with_temperature_exact():
    # With T = 0.5 and norms 0, T ln 2, T ln 4: exp(-n/T) = 1, 1/2, 1/4 -> 4/7, 2/7, 1/7.
    t = 0.5
    norms = torch.tensor([[0.0], [t * math.log(2.0)], [t * math.log(4.0)]])
    w = compute_weights(norms.double(), ALL3, norm_softmax=True, temperature=t)
    assert w.dtype == torch.float64
    torch.testing.assert_close(w[:, 0], torch.tensor([4 / 7, 2 / 7, 1 / 7], dtype=torch.float64))

    # T = 2, norms 1, 2, 3: weights proportional to e^-0.5, e^-1, e^-1.5.
    w = compute_weights(
        torch.tensor([[1.0], [2.0], [3.0]]), ALL3, norm_softmax=True, temperature=2.0
    )
    e = [math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]
    expected = torch.tensor([x / sum(e) for x in e], dtype=torch.float64)
    torch.testing.assert_close(w[:, 0], expected, rtol=0, atol=1e-15)


def test_weights_softmax_is_stable_for_large_norms():
    norms = torch.tensor([[1e4], [1e4 + 1.0], [1e6]], dtype=torch.float64)
    w = compute_weights(norms, ALL3, norm_softmax=True)
    e = 1.0 / (1.0 + math.exp(-1.0))
    torch.testing.assert_close(
        w[:, 0], torch.tensor([e, 1 - e, 0.0], dtype=torch.float64), rtol=0, atol=1e-15
    )


def test_weights_uniform():
    norms = torch.tensor([[1.0, 5.0], [2.0, 6.0], [3.0, 7.0], [4.0, 8.0]])
    w = compute_weights(norms, torch.ones(4, 2, dtype=torch.bool), norm_softmax=False)
    assert torch.equal(w, torch.full((4, 2), 0.25, dtype=torch.float64))


def test_weights_renormalised_over_included_replicas():
    # Defect 3: with one of three replicas excluded, the other two get 1/2 each, not 1/3.
    norms = torch.tensor([[1.0], [math.nan], [1.0]])
    included = torch.tensor([[True], [False], [True]])
    w = compute_weights(norms, included, norm_softmax=False)
    assert w[:, 0].tolist() == [0.5, 0.0, 0.5]

    # Softmax over the two included replicas only (T = 1, norms 0 and ln 3 -> 3/4, 1/4);
    # the excluded replica's huge norm must not take part.
    norms = torch.tensor([[0.0], [1e9], [math.log(3.0)]], dtype=torch.float64)
    w = compute_weights(norms, included, norm_softmax=True)
    torch.testing.assert_close(
        w[:, 0], torch.tensor([0.75, 0.0, 0.25], dtype=torch.float64), rtol=0, atol=1e-15
    )


def test_weights_per_unit_and_all_excluded_column():
    norms = torch.tensor([[1.0, 1.0, math.inf], [2.0, math.nan, 1.0]])
    included = torch.tensor([[True, True, False], [True, False, False]])
    for softmax in (False, True):
        w = compute_weights(norms, included, norm_softmax=softmax)
        assert w[:, 1].tolist() == [1.0, 0.0]  # one survivor takes it all
        assert w[:, 2].tolist() == [0.0, 0.0]  # nobody included: all zero
        assert not torch.isnan(w).any()
        assert w[:, 0].sum().item() == pytest.approx(1.0, abs=1e-12)


def test_weights_with_step_counts():
    norms = torch.ones(3, 2)
    steps = torch.tensor([1, 3, 4])
    # Unit 0: all included. s = [1, 3, 4] / 8, w = 1/3 -> 0.5/3 + 0.5 s.
    # Unit 1: replica 2 excluded. s = [1, 3] / 4, w = 1/2 -> r = 0.25: 0.75/2 + 0.25 s.
    included = torch.tensor([[True, True], [True, True], [True, False]])
    w = compute_weights(norms, included, norm_softmax=False, step_counts=steps)
    expected0 = [0.5 / 3 + 0.5 * 1 / 8, 0.5 / 3 + 0.5 * 3 / 8, 0.5 / 3 + 0.5 * 4 / 8]
    torch.testing.assert_close(w[:, 0], torch.tensor(expected0, dtype=torch.float64))

    w = compute_weights(
        norms, included, norm_softmax=False, step_counts=steps, step_weight_ratio=0.25
    )
    expected1 = [0.375 + 0.25 * 0.25, 0.375 + 0.25 * 0.75, 0.0]
    torch.testing.assert_close(w[:, 1], torch.tensor(expected1, dtype=torch.float64))

    # Ratio 1: pure step weights; ratio 0: step counts have no influence.
    w = compute_weights(norms, included, norm_softmax=False, step_counts=steps, step_weight_ratio=1)
    torch.testing.assert_close(w[:, 0], torch.tensor([1 / 8, 3 / 8, 4 / 8], dtype=torch.float64))
    w = compute_weights(norms, included, norm_softmax=False, step_counts=steps, step_weight_ratio=0)
    torch.testing.assert_close(w[:, 0], torch.full((3,), 1 / 3, dtype=torch.float64))


def test_weights_zero_included_steps_fall_back_to_uniform():
    norms = torch.ones(3, 1)
    included = torch.tensor([[True], [True], [False]])
    steps = torch.tensor([0, 0, 7])  # only the excluded replica did steps
    w = compute_weights(
        norms, included, norm_softmax=False, step_counts=steps, step_weight_ratio=1.0
    )
    assert w[:, 0].tolist() == [0.5, 0.5, 0.0]


def test_weights_sum_to_one_over_included():
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        norms = torch.rand(5, 6, generator=gen, dtype=torch.float64) * 10
        included = torch.rand(5, 6, generator=gen) < 0.7
        included[trial % 5, :] = True  # keep every column non-empty
        norms[~included] = math.nan  # excluded norms are never read
        steps = torch.randint(0, 10, (5,), generator=gen)
        for softmax in (False, True):
            w = compute_weights(
                norms,
                included,
                norm_softmax=softmax,
                temperature=0.3 + trial / 10,
                step_counts=steps if trial % 2 else None,
            )
            assert torch.all(w[~included] == 0)
            torch.testing.assert_close(
                w.sum(0), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-12
            )


def test_weights_validation():
    norms, inc = torch.ones(2, 1), torch.ones(2, 1, dtype=torch.bool)
    for t in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="weight_softmax_temperature"):
            compute_weights(norms, inc, norm_softmax=True, temperature=t)
    for r in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="step_weight_ratio"):
            compute_weights(norms, inc, norm_softmax=False, step_weight_ratio=r)
    with pytest.raises(ValueError, match="finite"):
        compute_weights(torch.tensor([[math.nan], [1.0]]), inc, norm_softmax=True)
    with pytest.raises(ValueError, match="step_counts"):
        compute_weights(norms, inc, norm_softmax=False, step_counts=torch.tensor([1, 2, 3]))


# ---------------------------------------------------------------------------
# clip_coefficient
# ---------------------------------------------------------------------------


def test_clip_coefficient_values():
    assert clip_coefficient(2.0, None) == 1.0
    assert clip_coefficient(2.0, 1.0) == 1.0 / (2.0 + 1e-6)
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(0.0, 1.0) == 1.0
    # Right at the cap the 1e-6 keeps the factor just below 1.
    assert clip_coefficient(1.0, 1.0) == 1.0 / (1.0 + 1e-6)
    assert math.isnan(clip_coefficient(math.nan, 1.0))

    norm = torch.tensor([4.0, 0.25], dtype=torch.float64)
    got = clip_coefficient(norm, 2.0)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
    assert got.tolist() == [2.0 / (4.0 + 1e-6), 1.0]
    assert torch.equal(clip_coefficient(norm, None), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_clip_coefficient_validation(bad):
    with pytest.raises(ValueError, match="clip_pseudo_grad"):
        clip_coefficient(1.0, bad)
