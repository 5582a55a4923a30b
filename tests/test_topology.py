"""Rank arithmetic of the ("sync", "shard") mesh, and the mesh itself on 4 gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from editrain.config import load_config
from editrain.errors import ConfigError
from editrain.spawn import run_ranks
from editrain.topology import SHARD_DIM, SYNC_DIM, Topology, init_mesh, topology_of
from tests.rank_threads import each_rank_in_a_thread


# ---------------------------------------------------------------------------- pure arithmetic
def rank_at(t: Topology, replica: int, shard: int, tp: int = 0) -> int:
    """The global rank at ``(replica, shard, tp)``: tp innermost, then shard, then replica."""
    return (replica * t.shard_size + shard) * t.tp_size + tp


def test_two_replicas_of_two_shards():
    t = Topology(world_size=4, shard_size=2)
    assert t.num_replicas == 2
    assert [t.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [t.shard_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert t.replica_ranks(0) == [0, 1] and t.replica_ranks(1) == [2, 3]
    assert t.sync_ranks(0) == [0, 2] and t.sync_ranks(1) == [1, 3]
    assert [rank_at(t, r, s) for r in range(2) for s in range(2)] == [0, 1, 2, 3]


def test_no_sharding():
    t = Topology(4, 1)
    assert t.num_replicas == 4
    assert [t.replica_of(r) for r in range(4)] == [0, 1, 2, 3]
    assert [t.shard_of(r) for r in range(4)] == [0, 0, 0, 0]
    assert [t.replica_ranks(r) for r in range(4)] == [[0], [1], [2], [3]]
    assert t.sync_ranks(0) == [0, 1, 2, 3]


def test_one_replica():
    t = Topology(4, 4)
    assert t.num_replicas == 1
    assert [t.replica_of(r) for r in range(4)] == [0, 0, 0, 0]
    assert [t.shard_of(r) for r in range(4)] == [0, 1, 2, 3]
    assert t.replica_ranks(0) == [0, 1, 2, 3]
    assert [t.sync_ranks(s) for s in range(4)] == [[0], [1], [2], [3]]


@pytest.mark.parametrize("world, shard", [(1, 1), (4, 1), (4, 2), (4, 4), (6, 3), (8, 2),
                                          (12, 4)])
def test_rank_arithmetic_is_consistent(world, shard):
    t = Topology(world, shard)
    assert t.num_replicas * t.shard_size == world
    seen = []
    for rank in range(world):
        r, s = t.replica_of(rank), t.shard_of(rank)
        assert 0 <= r < t.num_replicas and 0 <= s < shard
        assert rank == r * shard + s == rank_at(t, r, s)
        assert rank in t.replica_ranks(r) and rank in t.sync_ranks(s)
        seen.append((r, s))
    assert len(set(seen)) == world
    # Replica groups and sync groups each partition the world.
    rows = sorted(x for r in range(t.num_replicas) for x in t.replica_ranks(r))
    cols = sorted(x for s in range(shard) for x in t.sync_ranks(s))
    assert rows == cols == list(range(world))
    # A replica group and a sync group meet in exactly one rank.
    for r in range(t.num_replicas):
        for s in range(shard):
            assert set(t.replica_ranks(r)) & set(t.sync_ranks(s)) == {rank_at(t, r, s)}


@pytest.mark.parametrize("world, shard, allowed", [(4, 3, "[1, 2, 4]"), (4, 8, "[1, 2, 4]"),
                                                   (6, 4, "[1, 2, 3, 6]"), (4, 0, "[1, 2, 4]"),
                                                   (5, 2, "[1, 5]")])
def test_shard_size_must_divide_the_world(world, shard, allowed):
    with pytest.raises(ValueError) as info:
        Topology(world, shard)
    msg = str(info.value)
    assert "dist.shard_size" in msg and str(world) in msg and allowed in msg


# ---------------------------------------------------------------------------- pipeline stages
def pp_rank_at(t: Topology, replica: int, stage: int, shard: int, tp: int) -> int:
    """The global rank at ``(replica, stage, shard, tp)``: tp innermost, then shard, then
    stage, then replica."""
    return ((replica * t.pp_size + stage) * t.shard_size + shard) * t.tp_size + tp


def test_two_replicas_of_two_stages():
    t = Topology(world_size=4, shard_size=1, pp_size=2)
    assert (t.num_replicas, t.stage_size, t.replica_size, t.shape) == (2, 1, 2, (2, 2, 1, 1))
    assert [t.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [t.stage_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert [t.shard_of(r) for r in range(4)] == [0, 0, 0, 0]
    assert t.replica_ranks(1) == [2, 3] and t.stage_ranks(1, 1) == [3]
    assert t.sync_ranks(0) == [0, 2] and t.sync_ranks(1) == [1, 3]  # per stage
    assert t.pp_ranks(2) == t.pp_ranks(3) == [2, 3]
    # both stages of a replica read the same batch
    assert [t.data_rank(r) for r in range(4)] == [0, 0, 1, 1] and t.data_world == 2


@pytest.mark.parametrize("world, P, S, T", [(4, 2, 1, 1), (8, 2, 2, 1), (8, 2, 1, 2),
                                            (16, 2, 2, 2), (12, 3, 2, 1), (24, 2, 3, 2),
                                            (6, 3, 1, 2), (4, 4, 1, 1)])
def test_pipeline_rank_arithmetic_is_consistent(world, P, S, T):
    t = Topology(world, S, T, P)
    R = world // (P * S * T)
    assert t.num_replicas == R and t.replica_size == P * S * T and t.stage_size == S * T
    assert t.shape == (R, P, S, T)
    seen = set()
    for rank in range(world):
        r, p, s, x = t.replica_of(rank), t.stage_of(rank), t.shard_of(rank), t.tp_of(rank)
        assert rank == pp_rank_at(t, r, p, s, x)
        seen.add((r, p, s, x))
        assert t.position_of(rank) == (p * S + s) * T + x
        # the sync group: the same (stage, shard, tp) in every replica, in replica order
        group = t.sync_ranks(t.position_of(rank))
        assert group == [pp_rank_at(t, q, p, s, x) for q in range(R)]
        # the stage's ranks, the whole replica, the pipeline through this (shard, tp)
        assert t.stage_ranks(r, p) == [pp_rank_at(t, r, p, a, b)
                                       for a in range(S) for b in range(T)]
        assert rank in t.stage_ranks(r, p) and rank in t.replica_ranks(r)
        assert t.replica_ranks(r) == [y for q in range(P) for y in t.stage_ranks(r, q)]
        assert t.pp_ranks(rank) == [pp_rank_at(t, r, q, s, x) for q in range(P)]
        # every stage and tp peer of one replica-shard reads the same batch
        assert t.data_rank(rank) == r * S + s
    assert len(seen) == world
    assert sorted(y for i in range(t.replica_size) for y in t.sync_ranks(i)) == \
        list(range(world))
    assert t.data_world == R * S


def test_without_stages_nothing_changes():
    for world, S, T in [(4, 2, 1), (8, 2, 2), (4, 1, 1)]:
        a, b = Topology(world, S, T), Topology(world, S, T, 1)
        assert a == b and a.shape == ((world // (S * T), S) if T == 1
                                      else (world // (S * T), S, T))
        assert a.stage_size == a.replica_size == S * T
        assert all(a.stage_of(r) == 0 and a.stage_ranks(a.replica_of(r)) ==
                   a.replica_ranks(a.replica_of(r)) for r in range(world))


@pytest.mark.parametrize("world, S, T, P, allowed", [
    (4, 1, 1, 3, "[1, 2, 4]"), (8, 1, 2, 3, "[1, 2, 4]"), (6, 1, 1, 4, "[1, 2, 3, 6]"),
    (4, 1, 1, 0, "[1, 2, 4]")])
def test_pp_size_must_divide_the_world(world, S, T, P, allowed):
    with pytest.raises(ValueError) as info:
        Topology(world, S, T, P)
    msg = str(info.value)
    assert f"dist.pp_size={P}" in msg and allowed in msg, msg
    assert "tp_size" in msg if T > 1 else str(world) in msg


def test_shard_size_must_divide_a_stage():
    with pytest.raises(ValueError) as info:
        Topology(8, 3, 1, 2)
    assert "dist.shard_size=3" in str(info.value) and "[1, 2, 4]" in str(info.value)
    assert "dist.pp_size" in str(info.value)


def _pp_mesh_worker(rank: int, world: int) -> dict:
    info = init_mesh(shard_size=1, backend="gloo", device_type="cpu", pp_size=2,
                     keep_freed_memory=False)
    sums = {}
    for dim in ("sync", "pp", "shard", "tp"):
        t = torch.tensor([float(rank)])
        group = info.mesh.get_group(dim)
        dist.all_reduce(t, group=group)
        sums[dim] = (sorted(dist.get_process_group_ranks(group)), float(t))
    return {"names": tuple(info.mesh.mesh_dim_names), "shape": tuple(info.mesh.shape),
            "topo": info.topo, "topology_of": topology_of(info.mesh), "stage": info.stage,
            "replica": info.replica, "pp_mesh": dist.get_process_group_ranks(
                info.pp_mesh.get_group()), "sums": sums}


def test_init_mesh_with_pipeline_stages():
    out = run_ranks(_pp_mesh_worker, 4)
    expected = Topology(4, 1, 1, 2)
    for rank, o in enumerate(out):
        assert o["names"] == ("sync", "pp", "shard", "tp") and o["shape"] == (2, 2, 1, 1)
        assert o["topo"] == o["topology_of"] == expected
        assert (o["replica"], o["stage"]) == divmod(rank, 2)
        assert o["pp_mesh"] == expected.pp_ranks(rank)
        assert o["sums"]["pp"] == (expected.pp_ranks(rank), sum(expected.pp_ranks(rank)))
        sync = expected.sync_ranks(expected.position_of(rank))
        assert o["sums"]["sync"] == (sync, sum(sync))
        assert o["sums"]["shard"] == o["sums"]["tp"] == ([rank], rank)


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world size"):
        Topology(0, 1)


def test_topology_is_immutable():
    t = Topology(4, 2)
    with pytest.raises(AttributeError):
        t.shard_size = 1  # type: ignore[misc]


# ---------------------------------------------------------------------------- real mesh
def _mesh_worker(rank: int, world: int, shard_size: int) -> dict:
    import editrain.malloc

    malloc_calls: list[int] = []
    editrain.malloc.keep_freed_memory = lambda: malloc_calls.append(1) or True
    info = init_mesh(shard_size=shard_size, backend="gloo", device_type="cpu")
    init_mesh(shard_size=shard_size, backend="gloo", device_type="cpu",
              keep_freed_memory=False)
    mesh = info.mesh
    shard_group = mesh.get_group(SHARD_DIM)
    sync_group = mesh.get_group(SYNC_DIM)
    # Collectives on each sub-group reach exactly the ranks the arithmetic predicts.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=shard_group)
    u = torch.tensor([float(rank)])
    dist.all_reduce(u, group=sync_group)
    try:
        topology_of(mesh)
        wrong_names_error = None
    except ValueError as e:  # pragma: no cover - reported to the test
        wrong_names_error = str(e)
    from torch.distributed.device_mesh import init_device_mesh

    other = init_device_mesh("cpu", (world // shard_size, shard_size),
                             mesh_dim_names=("dp", "tp"))
    try:
        topology_of(other)
        bad_mesh_error = ""
    except ValueError as e:
        bad_mesh_error = str(e)
    return {
        "rank": info.rank,
        "dim_names": tuple(mesh.mesh_dim_names),
        "shape": tuple(mesh.shape),
        "coordinate": tuple(mesh.get_coordinate()),
        "replica": info.replica,
        "shard": info.shard,
        "shard_mesh_size": info.shard_mesh.size(),
        "sync_mesh_size": info.sync_mesh.size(),
        "shard_group_ranks": dist.get_process_group_ranks(shard_group),
        "sync_group_ranks": dist.get_process_group_ranks(sync_group),
        "shard_sum": float(t.item()),
        "sync_sum": float(u.item()),
        "topo": info.topo,
        "topology_of": topology_of(mesh),
        "wrong_names_error": wrong_names_error,
        "bad_mesh_error": bad_mesh_error,
        "device": str(info.device),
        "malloc_calls": len(malloc_calls),
    }


def test_init_mesh_on_four_processes():
    out = run_ranks(_mesh_worker, 4, 2)
    expected = Topology(4, 2)
    for rank, o in enumerate(out):
        assert o["rank"] == rank
        assert o["dim_names"] == ("sync", "shard")
        assert o["shape"] == (2, 2)
        assert o["shard_mesh_size"] == 2 and o["sync_mesh_size"] == 2
        assert o["topo"] == expected and o["topology_of"] == expected
        assert o["replica"] == rank // 2 and o["shard"] == rank % 2
        assert rank == o["replica"] * 2 + o["shard"]
        assert o["coordinate"] == (o["replica"], o["shard"])
        assert o["shard_group_ranks"] == expected.replica_ranks(o["replica"])
        assert o["sync_group_ranks"] == expected.sync_ranks(o["shard"])
        assert o["shard_sum"] == sum(expected.replica_ranks(o["replica"]))
        assert o["sync_sum"] == sum(expected.sync_ranks(o["shard"]))
        assert o["wrong_names_error"] is None
        assert "('sync', 'shard')" in o["bad_mesh_error"] and "init_mesh" in o["bad_mesh_error"]
        assert o["device"] == "cpu"
        # A library user's process gets the trainer's malloc settings, unless it opts out.
        assert o["malloc_calls"] == 1


def test_worker_threads_respect_the_user_then_torchrun_then_cores(monkeypatch):
    """dist.threads_per_proc wins; then OMP_NUM_THREADS (torchrun sets 1); then cores
    shared out over the local processes."""
    from editrain.config import Config
    from editrain.runtime import worker_threads

    cfg = Config()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert worker_threads(cfg) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads(cfg) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert worker_threads(cfg) == 2
    assert worker_threads(cfg, local_world=2) == 4  # the local launcher, before spawning
    cfg.dist.threads_per_proc = 5
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert worker_threads(cfg) == 5


def test_keep_freed_memory_sets_glibc_malloc_unless_the_user_did(monkeypatch):
    """Workers keep freed memory for the next step (no page faults on every step's
    buffers): applied on glibc, left alone when the user set glibc's MALLOC_*_ tuning."""
    import platform
    import sys

    from editrain.malloc import MALLOC_ENV, keep_freed_memory

    for name in MALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is glibc
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False


def test_three_d_rank_arithmetic():
    """("sync", "shard", "tp"): tp innermost; a replica is S x T ranks, a sync group the
    ranks at one position of every replica; tp peers share a data rank."""
    t = Topology(8, 2, 2)
    assert (t.num_replicas, t.replica_size, t.shape) == (2, 4, (2, 2, 2))
    coords = [(t.replica_of(r), t.shard_of(r), t.tp_of(r)) for r in range(8)]
    assert coords == [(r, s, p) for r in range(2) for s in range(2) for p in range(2)]
    assert all(rank_at(t, *c) == r for r, c in enumerate(coords))
    assert t.replica_ranks(1) == [4, 5, 6, 7]
    assert t.sync_ranks(3) == [3, 7] and [t.position_of(r) for r in (3, 7)] == [3, 3]
    assert [t.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert t.data_world == 4
    assert Topology(4, 2).shape == (2, 2)  # tp 1: the 2-D mesh


def test_tp_size_must_divide():
    with pytest.raises(ValueError, match=r"dist.tp_size=3 must divide the world size 8"):
        Topology(8, 1, 3)
    with pytest.raises(ValueError,
                       match=r"dist.shard_size=3 must divide world size / dist.tp_size = 4"):
        Topology(8, 3, 2)


@pytest.mark.parametrize("sizes, message", [
    (dict(shard_size=3), "dist.shard_size=3 must divide the world size 4"),
    (dict(shard_size=1, tp_size=3), "dist.tp_size=3 must divide the world size 4"),
    (dict(shard_size=1, pp_size=3), "dist.pp_size=3 must divide the world size 4"),
])
def test_init_mesh_checks_sizes_before_starting_the_group(monkeypatch, sizes, message):
    """A size that cannot divide WORLD_SIZE is refused with Topology's message before the
    default group (or torch elastic's store, or malloc's settings) is touched: under
    torchrun the other ranks would otherwise wait in the rendezvous for this one."""
    import editrain.malloc

    def started(*args, **kwargs):
        raise AssertionError("the default process group was started before the check")

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", started)
    monkeypatch.setattr(editrain.malloc, "keep_freed_memory", started)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError) as info:
        init_mesh(backend="gloo", device_type="cpu", **sizes)
    assert message in str(info.value) and "allowed values: [1, 2, 4]" in str(info.value)


def test_sizes_take_numpy_integers_as_plain_ints_and_refuse_other_types():
    """``init_mesh(shard_size=np.int64(2))`` is what a Python caller writes after
    ``np.arange``: the sizes are stored as plain ints (the mesh shape and rank lists
    stay plain). A float divides like an integer (``4 % 2.0 == 0``) but is no mesh size, a
    bool is a slip: both are refused by the option's name, every size alike (only
    ``pp_size`` was type-checked before)."""
    np = pytest.importorskip("numpy")
    t = Topology(np.int64(8), np.int64(2), np.int32(1), np.int16(2))
    assert t.shape == (2, 2, 2, 1) and t.replica_ranks(1) == [4, 5, 6, 7]
    assert all(type(v) is int for v in (t.world_size, t.shard_size, t.tp_size, t.pp_size))
    for sizes, option in [((8, 2.0), "dist.shard_size"), ((8, True), "dist.shard_size"),
                          ((8, 1, np.float64(2)), "dist.tp_size"),
                          ((8, 1, 1, True), "dist.pp_size"), ((8.0, 1), "world size")]:
        with pytest.raises(ValueError, match=rf"^{option}: expected an integer, got "):
            Topology(*sizes)


@pytest.mark.parametrize("make", [
    lambda np: True, lambda np: np.True_, lambda np: 2.0, lambda np: np.float64(2.0),
    lambda np: "2", lambda np: torch.tensor(2), lambda np: np.array(2)])
def test_a_mesh_size_is_refused_in_the_words_of_the_config_option(make):
    """The same rule (an integer, numpy's taken; a bool, float or tensor not) was checked
    twice and worded twice: ``init_mesh``'s sizes said "dist.shard_size must be an integer,
    got ... (numpy.bool)", the config option "dist.shard_size: expected an integer, got
    ...". One check now (errors.plain_scalar): one message from both."""
    np = pytest.importorskip("numpy")
    value = make(np)
    with pytest.raises(ConfigError) as mesh:
        Topology(8, value)
    with pytest.raises(ConfigError) as option:
        load_config(None, {"dist": {"shard_size": value}})
    assert str(mesh.value) == str(option.value)
    assert str(mesh.value).startswith("dist.shard_size: expected an integer, got ")
    for plain in (np.int64(2), np.uint8(2), np.int32(2)):
        assert type(Topology(8, plain).shard_size) is int
        assert type(load_config(None, {"dist": {"shard_size": plain}}).dist.shard_size) is int


# ------------------------------------------------- one attempt's store namespace under torch elastic
class PerThreadEnviron(dict):
    """``os.environ`` with each thread's own overrides (a thread is one rank of a torchrun
    attempt here, with its own ``RANK`` and ``TORCHELASTIC_RESTART_COUNT``)."""

    def __init__(self, base) -> None:
        import threading

        super().__init__(base)
        self.local = threading.local()

    def own(self) -> dict:
        return getattr(self.local, "env", {})

    def __getitem__(self, key):
        own = self.own()
        return own[key] if key in own else super().__getitem__(key)

    def __contains__(self, key) -> bool:
        return key in self.own() or super().__contains__(key)

    def get(self, key, default=None):
        return self[key] if key in self else default


@pytest.fixture
def agent_store(monkeypatch):
    """torch elastic's agent store as the workers see it (a TCPStore in this process), and
    an environment whose RANK and restart count each thread sets for itself."""
    import os

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environ = PerThreadEnviron(os.environ)
    environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(server.port), WORLD_SIZE="3")
    monkeypatch.setattr(os, "environ", environ)
    yield server, environ


def attempt_stores(environ, counts: dict[int, int], timeout_s: float = 20.0) -> dict:
    """Each rank's (of ``counts``: rank -> its TORCHELASTIC_RESTART_COUNT) attempt store
    (:func:`editrain.topology._attempt_store`), made in a thread of its own, the ranks
    starting in the order given; an error in place of a rank's store."""
    from datetime import timedelta

    from editrain.topology import _attempt_store

    def rank(r: int, count: int) -> object:
        environ.local.env = {"RANK": str(r), "TORCHELASTIC_RESTART_COUNT": str(count)}
        return _attempt_store(timedelta(seconds=timeout_s))

    stores, _ = each_rank_in_a_thread(rank, counts, stagger_s=0.1, timeout_s=timeout_s + 10)
    return stores


def same_namespace(stores: dict) -> bool:
    """Whether a key rank 0 sets in its attempt store is read by every other rank in its."""
    from datetime import timedelta

    stores[0].set("rank0_was_here", "1")
    for store in stores.values():
        store.set_timeout(timedelta(seconds=1))
        try:
            store.get("rank0_was_here")
        except dist.DistStoreError:
            return False
    return True


def test_every_rank_of_an_attempt_shares_one_store_namespace_whatever_its_restart_count(
        agent_store):
    """torch elastic does not count a restart caused by a change of the nodes taking part,
    so after one node's failure the nodes' TORCHELASTIC_RESTART_COUNT differ (the failing
    node's agent counts, the healthy ones restart their workers uncounted). Every rank of
    the attempt still finds the others' keys in one namespace, and a new one at each
    attempt: the dead attempt's gloo keys are not read. Before, the namespace was the
    count: rank 1 at count 1 and ranks 0 and 2 at count 0 looked in different namespaces
    (the process group never formed), and an uncounted restart at the same count read the
    dead attempt's keys."""
    server, environ = agent_store
    first = attempt_stores(environ, {0: 0, 1: 0, 2: 0})
    assert all(isinstance(s, dist.Store) for s in first.values()), first
    assert same_namespace(first)
    first[1].set("gloo_address_of_a_dead_rank", "unreachable")

    # rank 1's node failed (its count 1); ranks 0 and 2 were healthy there (count 0)
    second = attempt_stores(environ, {1: 1, 0: 0, 2: 0})
    assert all(isinstance(s, dist.Store) for s in second.values()), second
    assert same_namespace(second)
    for store in second.values():
        assert not store.check(["gloo_address_of_a_dead_rank"])  # the dead attempt's

    # an uncounted restart at the same counts as the attempt before
    third = attempt_stores(environ, {2: 0, 0: 0, 1: 1})
    assert not third[2].check(["rank0_was_here"])  # the second attempt's
    assert same_namespace(third)


def test_a_rank_that_never_asks_for_the_attempt_is_named_by_rank_0(agent_store):
    """Rank 0 waits as long as the process group would for the others to ask for the
    attempt's id, then names the ranks that did not (here rank 2 never started)."""
    server, environ = agent_store
    stores = attempt_stores(environ, {0: 0, 1: 0}, timeout_s=1.0)
    assert isinstance(stores[1], dist.Store)
    assert isinstance(stores[0], TimeoutError)
    assert "rank(s) 2 did not ask for this attempt's id" in str(stores[0])


def test_without_the_agent_store_the_process_group_keeps_its_own(monkeypatch):
    """No TORCHELASTIC_USE_AGENT_STORE=True: nothing changes (init_process_group's own
    store)."""
    from datetime import timedelta

    from editrain.topology import _attempt_store

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert _attempt_store(timedelta(seconds=1)) is None
