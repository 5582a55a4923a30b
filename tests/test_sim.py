"""Heterogeneity simulation: parsing of the ``sim.*`` options, the link cost model (the
node-shared link with a fake clock and across processes) and the compute slowdown (with
``time.sleep`` mocked)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from editrain import sim
from editrain.config import ConfigError, SimSection, load_config
from editrain.sim import (
    ComputeSlowdown,
    SharedLink,
    SimPlan,
    Simulation,
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


# ---------------------------------------------------------------------------- shared link
MB = 1_000_000


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_shared_link_queues_back_to_back_messages(tmp_path):
    clock = FakeClock()
    link = SharedLink(tmp_path / "r0.state", bandwidth=MB, latency=0.01, clock=clock)
    assert link(MB) == pytest.approx(1.01)
    assert link(MB) == pytest.approx(2.01)  # waits for the first to leave
    r = link.reserve(MB // 2)
    assert (r.now, r.start, r.end) == pytest.approx((1000.0, 1002.0, 1002.5))


def test_shared_link_after_it_went_idle(tmp_path):
    clock = FakeClock()
    link = SharedLink(tmp_path / "r0.state", bandwidth=MB, latency=0.01, clock=clock)
    assert link(MB) == pytest.approx(1.01)
    clock.t += 0.25  # still busy for 0.75 s
    assert link(MB) == pytest.approx(1.76)
    clock.t += 10.0  # idle again
    assert link(MB) == pytest.approx(1.01)
    assert link(0) == pytest.approx(1.01)  # an empty message still queues behind
    clock.t += 1.0
    assert link(0) == pytest.approx(0.01)


def test_shared_link_is_shared_through_the_file(tmp_path):
    clock = FakeClock()
    path = tmp_path / "deep" / "dir" / "replica0.state"  # parents are created
    a = SharedLink(path, bandwidth=MB, latency=0.0, clock=clock)
    b = SharedLink(str(path), bandwidth=MB, latency=0.0, clock=clock)
    other = SharedLink(tmp_path / "replica1.state", bandwidth=MB, latency=0.0, clock=clock)
    assert path.exists()
    assert a(MB) == pytest.approx(1.0)
    assert b(MB) == pytest.approx(2.0)
    assert other(MB) == pytest.approx(1.0)  # another replica's link is free
    assert a(2 * MB) == pytest.approx(4.0)


def test_shared_link_without_bandwidth_costs_latency_only(tmp_path):
    link = SharedLink(tmp_path / "r0.state", bandwidth=None, latency=0.005, clock=FakeClock())
    assert [link(n) for n in (0, MB, 10**12)] == pytest.approx([0.005] * 3)
    free = SharedLink(tmp_path / "r1.state", bandwidth=None, latency=0.0, clock=FakeClock())
    assert free(10**12) == 0.0


@pytest.mark.parametrize("content", [b"", b"garbage", b"\xff\xfe\x00", b"nan", b"inf",
                                     b"   ", b"1e400", b"5000.0 some-other-boot\n"])
def test_shared_link_treats_a_bad_state_file_as_idle(tmp_path, content):
    path = tmp_path / "r0.state"
    path.write_bytes(content)
    link = SharedLink(path, bandwidth=MB, latency=0.01, clock=FakeClock())
    assert link(MB) == pytest.approx(1.01)
    assert link(MB) == pytest.approx(2.01)  # and the file is usable afterwards


def test_shared_link_past_busy_until_is_idle(tmp_path):
    clock = FakeClock()
    link = SharedLink(tmp_path / "r0.state", bandwidth=MB, latency=0.0, clock=clock)
    link(MB)
    later = SharedLink(tmp_path / "r0.state", bandwidth=MB, latency=0.0,
                       clock=FakeClock(clock.t + 100))
    assert later(MB) == pytest.approx(1.0)


def test_shared_link_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="bandwidth"):
        SharedLink(tmp_path / "s", bandwidth=0, latency=0.0)
    with pytest.raises(ValueError, match="latency"):
        SharedLink(tmp_path / "s", bandwidth=MB, latency=-1.0)


def test_plan_shared_link(tmp_path):
    assert plan_of().shared_link(tmp_path / "x.state") is None
    plan = plan_of(link_bandwidth="1MB/s", link_latency="5ms")
    link = plan.shared_link(tmp_path / ".link" / "replica0.state")
    assert isinstance(link, SharedLink)
    assert (link.bandwidth, link.latency) == (1e6, pytest.approx(5e-3))
    assert (tmp_path / ".link" / "replica0.state").exists()
    lat = plan_of(link_latency="2ms").shared_link(tmp_path / "lat.state")
    assert lat is not None and lat.bandwidth is None and lat(MB) == pytest.approx(2e-3)


def _reserve_many(path, bandwidth, nbytes, count, barrier, results):
    link = SharedLink(path, bandwidth=bandwidth, latency=0.0)
    barrier.wait(timeout=30)
    results.put([tuple(link.reserve(nbytes)) for _ in range(count)])


def test_shared_link_serialises_processes(tmp_path):
    """Two ranks of one node ask for the link at the same moment with the real clock:
    their transfers are laid end to end, never side by side."""
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs the fork start method")
    ctx = multiprocessing.get_context("fork")
    bandwidth, nbytes, count, procs = 10 * MB, MB // 4, 4, 2  # 0.8 s of link time in all
    path = tmp_path / ".link" / "replica0.state"
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_reserve_many,
                           args=(path, bandwidth, nbytes, count, barrier, results))
               for _ in range(procs)]
    for w in workers:
        w.start()
    slots = [s for _ in workers for s in results.get(timeout=60)]
    for w in workers:
        w.join(timeout=30)
        assert w.exitcode == 0
    assert len(slots) == procs * count
    slots.sort(key=lambda s: s[1])
    for (_, _, prev_end), (_, start, _) in zip(slots, slots[1:]):
        assert start >= prev_end - 1e-9  # no two transfers overlap
    for now, start, end in slots:
        assert start >= now and end - start == pytest.approx(nbytes / bandwidth)
    total = procs * count * nbytes / bandwidth
    assert slots[-1][2] - slots[0][1] >= total * 0.95


def test_shared_link_real_sleep_is_serialised(tmp_path):
    """Sleeping what two back-to-back calls return takes the sum of their transfers."""
    link = SharedLink(tmp_path / "r0.state", bandwidth=10 * MB, latency=0.0)
    t0 = time.monotonic()
    first, second = link(MB), link(MB)  # 0.1 s each
    assert first == pytest.approx(0.1, abs=0.05) and second == pytest.approx(0.2, abs=0.05)
    time.sleep(second)
    assert time.monotonic() - t0 >= 0.19


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


# ---------------------------------------------------------------------------- callbacks
class _Engine:
    """What :meth:`Simulation.before_sync` calls on the engine."""

    def __init__(self) -> None:
        self.scaled: list[float] = []

    def scale_pseudo_gradients(self, factor: float) -> None:
        self.scaled.append(factor)


def test_simulation_corrupts_only_its_replica_at_its_sync(tmp_path):
    plan = plan_of(corrupt_replica=["1@2:50"])
    engines = []
    for replica in (0, 1):
        s = Simulation(plan, replica, offset=0, rank=replica, seed=0, link_path=tmp_path / "l")
        engines.append(_Engine())
        s.attach(engines[-1])
        assert s.sync_hook == s.before_sync
        for index in range(4):
            s.sync_hook(index)
    assert [e.scaled for e in engines] == [[], [50.0]]
    quiet = Simulation(plan_of(), 0, 0, 0, 0, tmp_path / "l")
    assert quiet.sync_hook is None and quiet.link is None  # the engine gets no hook, no link


def test_simulation_slows_the_offset_replica_and_saves_its_draws(sleeps, tmp_path):
    """Stragglers and stalls target replica + sim.replica_offset (corruption does not);
    the stall draws are saved and restored with a checkpoint."""
    plan = plan_of(straggler=["3=2"], random_stall="0.5,1", link_bandwidth="1MB/s")
    s = Simulation(plan, replica=1, offset=2, rank=1, seed=7, link_path=tmp_path / "l")
    assert isinstance(s.link, SharedLink)
    state = s.state_dict()
    first = [s.after_compute(t, 0.25) for t in range(20)]
    assert min(first) == pytest.approx(0.25)  # the straggler's factor 2, every step
    s.load_state_dict(state)
    assert [s.after_compute(t, 0.25) for t in range(20)] == first
    other = Simulation(plan, replica=1, offset=0, rank=1, seed=7, link_path=tmp_path / "l")
    assert other.after_compute(0, 0.25) in (0.0, 1.0)  # not a straggler


def test_simulation_fails_once_at_its_rank_step_and_phase(monkeypatch, tmp_path):
    exits: list[int] = []
    monkeypatch.setattr(sim.os, "_exit", exits.append)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("EDITRAIN_FT_ATTEMPT", raising=False)
    s = Simulation(plan_of(fail="1@3:checkpoint"), 0, 0, rank=1, seed=0,
                   link_path=tmp_path / "l")
    s.after_step(3)
    s.before_checkpoint_commit(2)
    assert exits == []
    s.before_checkpoint_commit(3)
    assert exits == [17]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted run goes on
    s.before_checkpoint_commit(3)
    assert exits == [17]


@pytest.mark.parametrize(("rejoined", "count", "ft_attempt", "fails"), [
    (True, 0, 0, False),   # rank 0 rejoined its launch's run: a restart torch elastic
                           # did not count on this node (a change of the nodes taking part)
    (True, 1, 0, False),
    (False, 0, 0, True),   # a new claim: this attempt's run starts here
    (False, 1, 0, True),   # (a counted restart of an attempt refused before it trained)
    (None, 0, 0, True),    # not told (the local launcher, torchrun without its store):
    (None, 1, 0, False),   # the count decides, as before
    (None, 0, 1, False),   # a replica group the --ft launcher restarted
])
def test_sim_fail_follows_the_attempt_not_the_restart_count(monkeypatch, tmp_path, rejoined,
                                                            count, ft_attempt, fails):
    """sim.fail fires in an attempt that did not go on with its run (rank 0's decision,
    the trainer's ``rejoined``), whatever this node's TORCHELASTIC_RESTART_COUNT. Before,
    it fired whenever the count was 0: a node whose workers torch elastic restarted
    without counting (the healthy nodes after another node's failure, a node joining)
    killed its worker again at the same step, on every such restart."""
    exits: list[int] = []
    monkeypatch.setattr(sim.os, "_exit", exits.append)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
    monkeypatch.setenv("EDITRAIN_FT_ATTEMPT", str(ft_attempt))
    s = Simulation(plan_of(fail="1@3"), 0, 0, rank=1, seed=0, link_path=tmp_path / "l",
                   rejoined=rejoined)
    s.after_step(3)
    assert exits == ([17] if fails else [])


# ---------------------------------------------------------------------------- ranges (#30)
@pytest.mark.parametrize("text", ["1e999MB/s", "2e6GB/s", "1e16B/s",
                                  "0.5B/s", "1e-300MB/s", "1bit/s"])
def test_parse_bandwidth_range(text):
    with pytest.raises(ValueError, match=r"sim.link_bandwidth: .*out of range.*1B/s.*1PB/s"):
        parse_bandwidth(text)


def test_parse_bandwidth_range_limits_are_accepted():
    assert parse_bandwidth("8bit/s") == sim.MIN_BANDWIDTH
    assert parse_bandwidth("1e6GB/s") == sim.MAX_BANDWIDTH


@pytest.mark.parametrize("text", ["1e999", "1e999s", "3601", "1e9ms", "2e10us"])
def test_parse_duration_range(text):
    with pytest.raises(ValueError, match=r"sim.link_latency: .*0 to 3600 s"):
        parse_duration(text)
    with pytest.raises(ValueError, match=r"sim.random_stall: .*0 to 3600 s"):
        parse_duration(text, "random_stall")
    assert parse_duration("3600") == sim.MAX_SECONDS


@pytest.mark.parametrize("spec, match", [
    ("1=1e999", "from 1 to 1000"), ("1=1001", "from 1 to 1000"),
    ("1=2@0-99999999999999999999", r"at most 2\^63 - 1"),
    ("99999999999999999999=2", r"at most 2\^63 - 1"),
])
def test_straggler_range(spec, match):
    with pytest.raises(ValueError, match=rf"sim.straggler: .*{match}"):
        plan_of(straggler=[spec])
    assert plan_of(straggler=["0=1000@0-9223372036854775807"]).stragglers[0].factor == 1000


@pytest.mark.parametrize("spec", ["0.5,1e999", "0.5,3601s", "1,1e7ms"])
def test_random_stall_range(spec):
    with pytest.raises(ValueError, match=r"sim.random_stall: .*3600"):
        plan_of(random_stall=spec)


@pytest.mark.parametrize("spec", ["1@2:1e999", "1@2:-1e999", "1@2:2e6"])
def test_corrupt_scale_range(spec):
    with pytest.raises(ValueError, match=r"sim.corrupt_replica: .*out of range"):
        plan_of(corrupt_replica=[spec])
    assert plan_of(corrupt_replica=["1@2:-1e6"]).corrupt == {2: (1, -1e6)}


@pytest.mark.parametrize("spec", ["1@99999999999999999999", "99999999999999999999@3"])
def test_fail_indices_fit_an_int64(spec):
    with pytest.raises(ValueError, match=r"sim.fail: .*at most 2\^63 - 1"):
        plan_of(fail=spec)


def test_sim_ranges_reach_the_config_check():
    """The sim section's checks (before any process) report them as one-line ConfigErrors."""
    with pytest.raises(ConfigError, match="sim.straggler: factor 1e999"):
        load_config(None, {"sim": {"straggler": ["1=1e999"]}})
    with pytest.raises(ConfigError, match="sim.link_latency"):
        load_config(None, {"sim": {"link_latency": "1e999s"}})
