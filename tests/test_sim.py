"""Heterogeneity simulation: parsing of the ``sim.*`` options, the link cost model and the
compute slowdown (with ``time.sleep`` mocked)."""

from __future__ import annotations

import pytest

from editrain import sim
from editrain.config import ConfigError, SimSection, load_config
from editrain.sim import (
    ComputeSlowdown,
    SimPlan,
    Straggler,
    check_replicas,
    parse_bandwidth,
    parse_duration,
    parse_sim,
)


def plan_of(**kwargs) -> SimPlan:
    return parse_sim(SimSection(**kwargs))


# ---------------------------------------------------------------------------- link
@pytest.mark.parametrize("text, expected", [
    ("100MB/s", 1e8),
    ("1Gbit/s", 1.25e8),
    ("1GB/s", 1e9),
    ("8bit/s", 1.0),
    ("500kB/s", 5e5),
    ("20Mbit/s", 2.5e6),
    ("2.5MB/s", 2.5e6),
    ("100 mb/s", 1e8),
    ("  10B/s ", 10.0),
    ("1e3kB/s", 1e6),
])
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-12)


def test_parse_bandwidth_exact_examples():
    assert parse_bandwidth("100MB/s") == 1e8
    assert parse_bandwidth("1Gbit/s") == 1e9 / 8


@pytest.mark.parametrize("text", ["fast", "100", "100MB", "0MB/s", "-5MB/s", "100XB/s",
                                  "MB/s", "", "1,5MB/s"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(ValueError) as info:
        parse_bandwidth(text)
    msg = str(info.value)
    assert "sim.link_bandwidth" in msg and "100MB/s" in msg


@pytest.mark.parametrize("text, expected", [
    ("5ms", 5e-3), ("0.2s", 0.2), ("300us", 3e-4), ("2", 2.0), ("0", 0.0), (" 1.5 ms", 1.5e-3),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text", ["soon", "5min", "-1s", "ms", "5 m s"])
def test_parse_duration_rejects_naming_the_option(text):
    with pytest.raises(ValueError, match="sim.link_latency"):
        parse_duration(text)
    with pytest.raises(ValueError, match="sim.random_stall"):
        parse_duration(text, "random_stall")


def test_link_delay():
    plan = plan_of(link_bandwidth="100MB/s", link_latency="5ms")
    assert plan.has_link
    assert plan.bandwidth == 1e8 and plan.latency == pytest.approx(5e-3)
    assert plan.link_delay(0) == pytest.approx(5e-3)
    assert plan.link_delay(10**8) == pytest.approx(1.005)
    assert plan.link_delay(2_000_000) == pytest.approx(0.025)


def test_link_delay_latency_or_bandwidth_only():
    lat = plan_of(link_latency="2ms")
    assert lat.has_link and lat.bandwidth is None
    assert lat.link_delay(10**9) == pytest.approx(2e-3)
    bw = plan_of(link_bandwidth="1Gbit/s")
    assert bw.has_link and bw.latency == 0.0
    assert bw.link_delay(125_000_000) == pytest.approx(1.0)


def test_nothing_configured():
    plan = plan_of()
    assert not plan.has_link
    assert plan.link_delay(12345) == 0.0
    assert plan.stragglers == [] and plan.stall_prob == 0.0 and plan.corrupt == {}


# ---------------------------------------------------------------------------- stragglers
def test_straggler_specs():
    plan = plan_of(straggler=["1=2", "0=3.5@100-200", " 2=1 "])
    assert plan.stragglers == [
        Straggler(replica=1, factor=2.0, start=0, stop=None),
        Straggler(replica=0, factor=3.5, start=100, stop=200),
        Straggler(replica=2, factor=1.0, start=0, stop=None),
    ]


def test_straggler_window_is_half_open():
    s = plan_of(straggler=["0=3@10-20"]).stragglers[0]
    assert [s.active(t) for t in (0, 9, 10, 15, 19, 20, 100)] == [
        False, False, True, True, True, False, False]
    always = plan_of(straggler=["0=3"]).stragglers[0]
    assert always.active(0) and always.active(10**6)


@pytest.mark.parametrize("spec", ["1", "1=", "=2", "a=2", "1=0.5", "1=2@5", "1=2@20-10",
                                  "1=2@5-5", "1:2", "-1=2", "1=2@-3-4"])
def test_straggler_rejects(spec):
    with pytest.raises(ValueError) as info:
        plan_of(straggler=[spec])
    msg = str(info.value)
    assert "sim.straggler" in msg
    assert "REPLICA=FACTOR" in msg or "FROM < TO" in msg


# ---------------------------------------------------------------------------- stalls
@pytest.mark.parametrize("spec, prob, seconds", [
    ("0.1,2", 0.1, 2.0), ("0.5, 300ms", 0.5, 0.3), ("1,0.01s", 1.0, 0.01), ("0,5", 0.0, 5.0),
])
def test_random_stall(spec, prob, seconds):
    plan = plan_of(random_stall=spec)
    assert plan.stall_prob == pytest.approx(prob)
    assert plan.stall_seconds == pytest.approx(seconds)


@pytest.mark.parametrize("spec", ["0.1", "1.5,2", "x,2", "0.1,soon", ",2"])
def test_random_stall_rejects(spec):
    with pytest.raises(ValueError, match="sim.random_stall"):
        plan_of(random_stall=spec)


# ---------------------------------------------------------------------------- corruption
def test_corrupt_replica_specs():
    plan = plan_of(corrupt_replica=["1@20", "0@3:50", "1@7:-2.5", "0@9:1e2"])
    assert plan.corrupt == {20: (1, 30.0), 3: (0, 50.0), 7: (1, -2.5), 9: (0, 100.0)}


@pytest.mark.parametrize("spec", ["1", "@3", "1@", "a@3", "1@3:", "1@3:x", "1=3"])
def test_corrupt_replica_rejects(spec):
    with pytest.raises(ValueError) as info:
        plan_of(corrupt_replica=[spec])
    assert "sim.corrupt_replica" in str(info.value) and "REPLICA@SYNC" in str(info.value)


# ---------------------------------------------------------------------------- topology checks
def test_check_replicas():
    check_replicas(plan_of(straggler=["1=2"], corrupt_replica=["1@2"]), num_replicas=2)
    with pytest.raises(ValueError, match="sim.straggler.*replica 2"):
        check_replicas(plan_of(straggler=["2=2"]), num_replicas=2)
    with pytest.raises(ValueError, match="sim.corrupt_replica.*replica 5"):
        check_replicas(plan_of(corrupt_replica=["5@2"]), num_replicas=2)


# ---------------------------------------------------------------------------- through the config
@pytest.mark.parametrize("option, value", [
    ("link_bandwidth", "lots"), ("link_latency", "never"), ("straggler", "1=slow"),
    ("random_stall", "often"), ("corrupt_replica", "everyone"),
])
def test_bad_specs_fail_when_the_config_is_loaded(option, value):
    with pytest.raises(ConfigError, match=f"sim.{option}"):
        load_config(None, {"sim": {option: value}})


def test_good_specs_through_the_config():
    cfg = load_config(None, {"sim": {"link_bandwidth": "100MB/s", "link_latency": "5ms",
                                     "straggler": "1=2@5-10", "random_stall": "0.1,1s",
                                     "corrupt_replica": ["0@4:10"]}})
    plan = parse_sim(cfg.sim)
    assert plan.bandwidth == 1e8 and plan.latency == pytest.approx(5e-3)
    assert plan.stragglers == [Straggler(1, 2.0, 5, 10)]
    assert (plan.stall_prob, plan.stall_seconds) == (0.1, 1.0)
    assert plan.corrupt == {4: (0, 10.0)}


# ---------------------------------------------------------------------------- slowdown
@pytest.fixture
def sleeps(monkeypatch):
    """Record ``time.sleep`` calls made by the simulation instead of sleeping."""
    calls: list[float] = []
    monkeypatch.setattr(sim.time, "sleep", calls.append)
    return calls


def test_straggler_sleeps_factor_minus_one_times_compute(sleeps):
    plan = plan_of(straggler=["1=3"])
    slow = ComputeSlowdown(plan, replica=1, seed=0)
    assert slow.after_compute(0, 0.5) == pytest.approx(1.0)
    assert slow.after_compute(1, 0.2) == pytest.approx(0.4)
    assert sleeps == pytest.approx([1.0, 0.4])
    assert slow.total_s == pytest.approx(1.4)


def test_other_replicas_do_not_sleep(sleeps):
    fast = ComputeSlowdown(plan_of(straggler=["1=3"]), replica=0, seed=0)
    assert fast.after_compute(0, 0.5) == 0.0
    assert sleeps == [] and fast.total_s == 0.0


def test_factor_one_does_not_sleep(sleeps):
    slow = ComputeSlowdown(plan_of(straggler=["0=1"]), replica=0, seed=0)
    assert slow.after_compute(0, 0.5) == 0.0
    assert sleeps == []


def test_straggler_only_inside_its_window(sleeps):
    slow = ComputeSlowdown(plan_of(straggler=["0=2@2-4"]), replica=0, seed=0)
    slept = [slow.after_compute(t, 0.1) for t in range(6)]
    assert slept == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.0, 0.0])
    assert sleeps == pytest.approx([0.1, 0.1])


def test_two_stragglers_on_one_replica_add_up(sleeps):
    slow = ComputeSlowdown(plan_of(straggler=["0=2", "0=1.5@0-1"]), replica=0, seed=0)
    assert slow.after_compute(0, 1.0) == pytest.approx(1.5)
    assert slow.after_compute(1, 1.0) == pytest.approx(1.0)


def test_certain_stall_sleeps_its_seconds(sleeps):
    slow = ComputeSlowdown(plan_of(random_stall="1,250ms"), replica=0, seed=0)
    assert [slow.after_compute(t, 0.1) for t in range(3)] == pytest.approx([0.25] * 3)
    assert sleeps == pytest.approx([0.25] * 3)


def test_zero_probability_never_stalls(sleeps):
    slow = ComputeSlowdown(plan_of(random_stall="0,5"), replica=0, seed=0)
    assert sum(slow.after_compute(t, 0.1) for t in range(50)) == 0.0
    assert sleeps == []


def test_random_stalls_are_shared_by_a_replica_and_seeded(sleeps):
    plan = plan_of(random_stall="0.3,1")

    def pattern(replica: int, seed: int) -> list[bool]:
        slow = ComputeSlowdown(plan, replica=replica, seed=seed)
        return [slow.after_compute(t, 0.0) > 0 for t in range(200)]

    a = pattern(1, 7)
    # Every rank of replica 1 builds its own ComputeSlowdown: they must stall together.
    assert pattern(1, 7) == a
    assert 20 < sum(a) < 100  # about 30% of 200 steps
    assert pattern(0, 7) != a  # another replica stalls on other steps
    assert pattern(1, 8) != a  # another seed gives another pattern


def test_straggler_and_stall_combine(sleeps):
    slow = ComputeSlowdown(plan_of(straggler=["0=2"], random_stall="1,0.5"), replica=0, seed=0)
    assert slow.after_compute(0, 0.25) == pytest.approx(0.75)
    assert sleeps == pytest.approx([0.75])
