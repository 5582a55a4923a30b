"""The planner: the job model's pieces against hand-computed cases, the inputs'
validation, the search, the calibration on a synthetic run with known parameters, and
``editrain plan`` end to end (no training anywhere: every test here takes milliseconds)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from editrain.cli import main
from editrain.errors import ConfigError
from editrain.plan.calibrate import (
    calibrate,
    fit_compute,
    fit_link,
    job_rows,
    peer_lag_s,
    run_vocab_size,
)
from editrain.plan.inputs import GBIT, Cluster, MethodSpec, ModelSpec, load_inputs, parse_method
from editrain.plan.model import (
    Round,
    allgather_s,
    expected_max_stall_s,
    layerwise_exposure_s,
    memory_per_rank,
    model_shape,
    payload_bytes,
    predict,
    replica_factors,
    ring_allreduce_s,
    timeline,
)
from editrain.plan.search import bandwidth_for, candidates, search_target
from editrain.sync import sparse


def cluster(**kw) -> Cluster:
    base = dict(nodes=2, gpus_per_node=1, inter_node_gbps=8.0, step_time_s=0.1)
    return Cluster(**{**base, **kw})


# ---------------------------------------------------------------------------- link costs
def test_ring_allreduce_by_hand():
    # 8 ranks, 1 GB, 10 GB/s, 1 ms: 2 * 7 hops of latency + 2 * 7/8 of the bytes.
    assert ring_allreduce_s(1e9, 8, 1e10, 1e-3) == pytest.approx(14e-3 + 0.175)
    assert ring_allreduce_s(1e9, 8, 1e10, 1e-3, per="collective") == pytest.approx(1e-3 + 0.175)
    assert ring_allreduce_s(1e9, 1, 1e10, 1e-3) == 0.0
    # Two ranks: each sends the whole buffer once (as docs/streaming.md section 5 counts).
    assert ring_allreduce_s(4e6, 2, 1e6, 0.0) == pytest.approx(4.0)


def test_allgather_by_hand():
    assert allgather_s(1e8, 4, 1e9, 5e-4) == pytest.approx(3 * 5e-4 + 0.3)
    assert allgather_s(1e8, 4, 1e9, 5e-4, per="collective") == pytest.approx(5e-4 + 0.3)


def test_payload_bytes_match_the_engine_codecs():
    from editrain.sync.quant import payload_bytes as engine_bytes

    for n in (1, 127, 128, 129, 1000, 65536):
        for codec in ("fp32", "bf16", "int8", "int4"):
            assert payload_bytes(n, codec) == engine_bytes(n, codec), (n, codec)
    assert payload_bytes(256, "fp4") == 128 + 8


def test_expected_max_stall_by_hand():
    # One step, two replicas, p = 0.5: P(at least one stalls) = 0.75.
    assert expected_max_stall_s(1, 2, 0.5, 1.0) == pytest.approx(0.75)
    # One replica: the mean of Binomial(10, 0.3) stalls.
    assert expected_max_stall_s(10, 1, 0.3, 2.0) == pytest.approx(2.0 * 3.0)
    assert expected_max_stall_s(10, 4, 0.0, 2.0) == 0.0
    # The most-stalled of many replicas stalls more than the mean.
    assert expected_max_stall_s(16, 8, 0.1, 1.0) > 1.6


# ---------------------------------------------------------------------------- shape
def test_preset_shape_counts_the_models_parameters():
    from editrain.models import Llama, num_parameters, preset_config

    for preset, vocab, tied in (("tiny", 512, None), ("small", 2048, False)):
        spec = ModelSpec(preset=preset, vocab_size=vocab, tie_embeddings=tied)
        shape = model_shape(spec)
        kw = {"vocab_size": vocab} | ({} if tied is None else {"tie_embeddings": tied})
        assert shape.params == num_parameters(Llama(preset_config(preset, **kw)))
        assert sum(shape.fwd_share) == pytest.approx(1.0)
    untied = model_shape(ModelSpec(preset="tiny", tie_embeddings=False))
    assert [n for n, _ in untied.units] == ["root", "tok_embeddings", "block0", "block1",
                                            "output"]


def test_counts_shape_and_flops():
    shape = model_shape(ModelSpec(params=1e9, layers=20, dim=2048))
    assert shape.params == pytest.approx(1e9, rel=1e-6)
    assert len(shape.units) == 21  # root + 20 blocks
    # 6 N + 12 L d s
    assert shape.flops_per_token(1024) == pytest.approx(6 * shape.params + 12 * 20 * 2048 * 1024)


# ---------------------------------------------------------------------------- timeline
def test_timeline_blocking_round():
    # H = 4 steps of 1 s, then a blocking 2 s round: 6 s per 4 steps.
    tl = timeline(1.0, [0.2], [Round(0, 0, [(0, 2.0)])], H=4, overlap=0, layerwise=False)
    assert tl.wall_per_step_s == pytest.approx(1.5)
    assert tl.wait_per_step_s == pytest.approx(0.5)
    assert tl.link_busy_per_step_s == pytest.approx(0.5)


def test_timeline_overlap_hides_what_fits():
    hidden = timeline(1.0, [0.2], [Round(0, 0, [(0, 1.5)])], H=4, overlap=2, layerwise=False)
    assert hidden.wait_per_step_s == pytest.approx(0.0)
    # 3 s of communication behind 2 s of compute: 1 s exposed per round.
    exposed = timeline(1.0, [0.2], [Round(0, 0, [(0, 3.0)])], H=4, overlap=2,
                       layerwise=False)
    assert exposed.wait_per_step_s == pytest.approx(0.25)
    assert exposed.wall_per_step_s == pytest.approx(1.25)


def test_timeline_layerwise_waits_unit_by_unit():
    # Forward 0.5 s per unit; unit 0's reduction takes 0.2 s, unit 1's another 0.2 s: the
    # forward of unit 0 starts at 0.2 and ends at 0.7, unit 1 (done at 0.4) runs to 1.2.
    tl = timeline(1.5, [0.5, 0.5], [Round(0, 0, [(0, 0.2), (1, 0.2)])], H=4, overlap=0,
                  layerwise=True)
    assert tl.wait_per_step_s == pytest.approx(0.2 / 4)
    assert layerwise_exposure_s([0.5, 0.5], [(0, 0.2), (1, 0.2)]) == pytest.approx(0.2)
    # A statistics job (-1) is waited for before the first unit.
    assert layerwise_exposure_s([0.5, 0.5], [(-1, 0.3), (0, 0.0), (1, 0.0)]) == \
        pytest.approx(0.3)


def test_timeline_a_round_in_time_waits_exactly_nothing():
    """A layer-wise round that arrives before its forwards waits 0, not the rounding of
    the forwards summed unit by unit against their total (-1.4e-17 s here; `editrain plan`
    printed -2.873e-12 exposed comm ms/step for a setting --target found)."""
    tl = timeline(0.3, [0.1, 0.1, 0.1], [Round(0, 0, [(0, 0.0), (1, 0.0), (2, 0.0)])], H=4,
                  overlap=0, layerwise=True)
    assert tl.wait_per_step_s == 0.0  # bitwise: no step waited


def test_timeline_fragments_share_the_link_fifo():
    # Two fragments, H = 4, launched after steps 2 and 4, 3 s each, overlap 1: each round
    # is waited for 2 s at its merge (the link is idle 1 s of every 4).
    rounds = [Round(0, 2, [(0, 3.0)]), Round(1, 0, [(1, 3.0)])]
    tl = timeline(1.0, [0.1, 0.1], rounds, H=4, overlap=1, layerwise=False)
    assert tl.wall_per_step_s == pytest.approx(2.0)
    # Four fragments, H = 8, overlap 4: rounds queue behind each other and the link
    # (3 s per 2 steps of 1 s) sets the pace.
    rounds = [Round(f, 2 * (f + 1) % 8, [(f, 3.0)]) for f in range(4)]
    tl = timeline(1.0, [0.1] * 4, rounds, H=8, overlap=4, layerwise=False, cycles=12)
    assert tl.wall_per_step_s == pytest.approx(1.5, rel=0.02)
    assert tl.link_busy_per_step_s == pytest.approx(1.5, rel=0.02)
    assert tl.rounds_in_flight_max >= 2


def test_timeline_eager_hides_a_whole_round():
    tl = timeline(1.0, [0.1], [Round(0, 0, [(0, 3.9)])], H=4, overlap=0, layerwise=False,
                  eager=True)
    assert tl.wait_per_step_s == pytest.approx(0.0)


# ---------------------------------------------------------------------------- predict
def test_sync_step_by_hand():
    c = cluster(inter_node_gbps=8.0)  # 1e9 B/s
    m = ModelSpec(params=1e8, layers=4, dim=512, dtype="bf16", batch_size=4, seq_len=128)
    p = predict(c, m, MethodSpec(method="sync"))
    # Two replicas: each node sends the bf16 gradients once: 2e8 B at 1e9 B/s.
    assert p.exposed_comm_s == pytest.approx(0.2, rel=1e-3)
    assert p.wall_per_step_s == pytest.approx(0.3, rel=1e-3)
    assert p.utilisation == pytest.approx(1 / 3, rel=1e-3)
    assert p.tokens_per_s == pytest.approx(2 * 4 * 128 / 0.3, rel=1e-3)
    assert p.bytes_per_round == pytest.approx(2e8, rel=1e-3)
    # Reducing during the backward hides most of it (the last unit's stays).
    overlapped = predict(c, m, MethodSpec(method="sync", grad_overlap=True))
    assert overlapped.exposed_comm_s < 0.2
    # The bandwidth for 50%: 0.1 s of communication.
    assert bandwidth_for(c, m, MethodSpec(method="sync"), 0.5) == \
        pytest.approx(8.0 * 2, rel=0.01)


def test_diloco_round_by_hand():
    c = cluster(inter_node_gbps=8.0, inter_node_latency_ms=10.0, latency_per="collective")
    m = ModelSpec(params=1e8, layers=4, dim=512)
    p = predict(c, m, MethodSpec(method="diloco", H=10))
    # fp32 all-reduce of 4e8 B (5 units: 5 collectives) every 10 steps.
    round_s = 4e8 / 1e9 + 5 * 0.01
    assert p.round_link_s == pytest.approx(round_s, rel=1e-3)
    # edit adds one statistics all-gather per round.
    edit = predict(c, m, MethodSpec(method="edit", H=10))
    assert edit.round_link_s == pytest.approx(round_s + 0.01, rel=1e-3)
    assert p.wall_per_step_s == pytest.approx(0.1 + round_s / 10, rel=1e-3)
    assert p.exposed_comm_s == pytest.approx(round_s / 10, rel=1e-3)
    int8 = predict(c, m, MethodSpec(method="diloco", H=10, codec="int8"))
    assert int8.bytes_per_round == pytest.approx(payload_bytes(1e8 / 4, "int8") * 4, rel=1e-2)
    # the sparse codec: its counted message (editrain.sync.sparse), under 1/100 of fp32
    topk2 = predict(c, m, MethodSpec(method="diloco", H=10, codec="topk2"))
    assert topk2.bytes_per_round == pytest.approx(
        sparse.payload_bytes(int(1e8 / 4), "topk2") * 4, rel=1e-2)
    assert topk2.bytes_per_round <= p.bytes_per_round / 100


def test_stragglers_hold_back_blocking_methods_not_aedit():
    c = cluster(straggler_spread=1.0, inter_node_gbps=1e5)  # replica 1 is 2x slower
    assert replica_factors(c, 2) == [1.0, 2.0]
    m = ModelSpec(params=1e7, layers=2, dim=256)
    edit = predict(c, m, MethodSpec(method="edit", H=16))
    # Both replicas run at the slow one's pace: (1 + 2) / 2 of 2 busy.
    assert edit.utilisation == pytest.approx(0.75, rel=0.01)
    blocking = predict(c, m, MethodSpec(method="aedit", H=16))
    # Window 1.6 s: 16 steps and 8 steps, both done at 1.6 s.
    assert blocking.utilisation == pytest.approx(1.0, rel=0.01)
    assert blocking.tokens_per_s == pytest.approx(edit.tokens_per_s * 1.5, rel=0.01)
    nb = predict(c, m, MethodSpec(method="aedit", H=16, overlap=2))
    assert nb.exposed_comm_s == 0 and nb.utilisation == pytest.approx(1.0)


def test_memory_per_rank():
    m = ModelSpec(params=8e8, layers=8, dim=1024, batch_size=8, seq_len=128)
    c = cluster(nodes=1, gpus_per_node=8)
    from editrain.plan.model import layout

    lay = layout(c, MethodSpec(method="edit"))
    assert (lay.replicas, lay.shard_size) == (1, 8)
    n = 1e8  # parameters per GPU
    edit = memory_per_rank(model_shape(m), m, MethodSpec(method="edit"), lay)
    assert edit.parts["anchor"] == pytest.approx(4 * n, rel=1e-3)
    # EDiT's default outer SGD has no momentum; DiLoCo's Nesterov SGD has, and so has an
    # edit setting that asks for it.
    assert "outer_momentum" not in edit.parts
    for spec in (MethodSpec(method="diloco"), MethodSpec(method="edit", outer_momentum=True)):
        assert memory_per_rank(model_shape(m), m, spec, lay).parts["outer_momentum"] == \
            pytest.approx(4 * n, rel=1e-3)
    assert "outer_momentum" not in memory_per_rank(
        model_shape(m), m, MethodSpec(method="diloco", codec="topk2"), lay).parts
    assert "error_feedback" not in edit.parts
    sync = memory_per_rank(model_shape(m), m, MethodSpec(method="sync"), lay)
    assert "anchor" not in sync.parts
    int8 = memory_per_rank(model_shape(m), m, MethodSpec(method="edit", codec="int8"), lay)
    assert int8.parts["error_feedback"] == pytest.approx(4 * n, rel=1e-3)
    off = memory_per_rank(model_shape(m), m, MethodSpec(method="edit", cpu_offload=True), lay)
    assert "anchor" not in off.parts and off.host["anchor"] == pytest.approx(4 * n, rel=1e-3)
    assert off.gpu_bytes < edit.gpu_bytes


def test_compute_from_flops_and_mfu():
    c = Cluster(nodes=1, gpus_per_node=1, inter_node_gbps=1, gpu_peak_tflops=100, mfu=0.5)
    m = ModelSpec(params=1e9, layers=16, dim=2048, batch_size=4, seq_len=1024)
    p = predict(c, m, MethodSpec(method="sync"))
    flops = 4 * 1024 * model_shape(m).flops_per_token(1024)
    assert p.compute_s == pytest.approx(flops / 50e12)


# ---------------------------------------------------------------------------- inputs
@pytest.mark.parametrize("change, message", [
    ({"inter_node_gbps": 0}, "cluster.inter_node_gbps: must be > 0, got 0"),
    ({"inter_node_gbps": -1.0}, "cluster.inter_node_gbps: must be > 0, got -1.0"),
    ({"mfu": 1.5, "gpu_peak_tflops": 10, "step_time_s": None},
     "cluster.mfu: must be <= 1 (a share of the peak), got 1.5"),
    ({"step_time_s": None}, "cluster.gpu_peak_tflops: missing"),
    ({"nodes": 0}, "cluster.nodes: must be >= 1, got 0"),
    ({"stall_prob": 2.0}, "cluster.stall_prob: must be <= 1"),
    ({"latency_per": "x"}, "cluster.latency_per: must be one of hop, collective"),
    ({"inter_node_gbps": "fast"}, 'cluster.inter_node_gbps: expected a number, got "fast"'),
])
def test_bad_cluster_names_the_field(change, message):
    with pytest.raises(ConfigError) as e:
        cluster(**change)
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("make", "option"), [
    (lambda v: cluster(nodes=v), "cluster.nodes"),
    (lambda v: ModelSpec(preset="tiny", seq_len=v), "model.seq_len"),
    (lambda v: MethodSpec(H=v), "method.H"),
])
def test_plan_counts_take_numpy_integers_and_are_refused_in_the_options_words(make, option):
    """The plan's counts refused numpy integers ("cluster.nodes: must be an integer, got
    np.int64(2)") that the training config takes; one check now (errors.plain_count):
    numpy integers stored as int, a bool or float refused in the config options' words."""
    np = pytest.importorskip("numpy")
    spec = make(np.int64(2))
    assert type(getattr(spec, option.split(".")[1])) is int
    for wrong, said in ((True, "expected an integer, got true"),
                        (2.0, "expected an integer, got 2.0"), (0, "must be >= 1, got 0")):
        with pytest.raises(ConfigError) as e:
            make(wrong)
        assert str(e.value) == f"{option}: {said}"


def test_plan_numbers_take_numpy_floats_as_plain_floats():
    np = pytest.importorskip("numpy")
    c = cluster(inter_node_gbps=np.float32(10), straggler_spread=np.float64(0.25))
    assert (type(c.inter_node_gbps), c.inter_node_gbps, c.straggler_spread) == (float, 10.0, 0.25)
    with pytest.raises(ConfigError, match=r"^cluster.stall_s: expected a number, got true$"):
        cluster(stall_s=True)


def test_plan_file_errors(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[cluster]\nnodes = 2\ngpus_per_node = 8\n")
    with pytest.raises(ConfigError, match=r"^cluster.inter_node_gbps: missing"):
        load_inputs(path)
    path.write_text("[cluster]\nnodes = 2\ngpus_per_node = 8\ninter_node_gbps = 1\n"
                    "step_time_s = 1\nspeed = 3\n")
    with pytest.raises(ConfigError, match=r"^cluster.speed: unknown field"):
        load_inputs(path)
    with pytest.raises(ConfigError, match=r"^method.codec: must be one of"):
        load_inputs(None, {"cluster": {"nodes": 2, "gpus_per_node": 1, "inter_node_gbps": 1,
                                       "step_time_s": 1}}, ["edit:codec=int3"])
    with pytest.raises(ConfigError, match=r"^model: give exactly one"):
        ModelSpec(preset="1b", params=1e9, layers=2)
    with pytest.raises(ConfigError, match=r"^method.overlap: must be < H"):
        MethodSpec(H=4, overlap=4)


def test_parse_method():
    assert parse_method("edit:H=64,fragments=4,codec=int8,ft=true") == {
        "method": "edit", "H": 64, "fragments": 4, "codec": "int8", "ft": True}
    assert MethodSpec(**parse_method("edit:H=64,fragments=4,overlap=1,codec=int8")).label == \
        "edit H=64 P=4 tau=1 int8"


@pytest.mark.parametrize(("spec", "got"), [
    ("edit:H=5,,fragments=2", "an empty entry"), ("edit:H=5,", "an empty entry"),
    ("edit:", "an empty entry"), ("edit:H=5, ,fragments=2", "an empty entry"),
    ("edit:H=", 'entry "H="'), ("edit:=5", 'entry "=5"'), ("edit:H", 'entry "H"'),
    ("edit:H=5,fragments", 'entry "fragments"'), ("edit: = ", 'entry "="'),
])
def test_a_malformed_method_spec_is_refused_naming_it(spec, got):
    """``--method edit:H=5,,fragments=2`` skipped the empty entry without a word, ``H=``
    and ``=5`` reached MethodSpec as a text H and a field named ''."""
    with pytest.raises(ConfigError) as info:
        parse_method(spec)
    assert str(info.value) == (f"method: \"{spec}\": expected NAME:key=value,key=value (every "
                               f"entry a key and its value), got {got}")


def test_a_method_spec_key_given_twice_keeps_its_last_value():
    """The command line's rule (editrain/argv.py): the last value stands."""
    assert parse_method("edit:H=5,H=6") == {"method": "edit", "H": 6}
    assert parse_method("edit") == {"method": "edit"}


def test_model_that_does_not_fit_names_the_field():
    c = cluster(gpu_memory_gb=16.0, nodes=1, gpus_per_node=8)
    m = ModelSpec(preset="7b", batch_size=8, seq_len=2048)
    with pytest.raises(ConfigError, match=r"^cluster.gpu_memory_gb: 7b with edit H=32 needs"):
        predict(c, m, MethodSpec(method="edit"))


# ---------------------------------------------------------------------------- search
def test_search_finds_the_cheapest_setting_in_order():
    c = cluster(inter_node_gbps=0.5, nodes=4)
    m = ModelSpec(params=2e8, layers=8, dim=1024)
    res = search_target(c, m, [MethodSpec(method="edit")], 0.95)["edit"]
    hit = res["found"]
    assert hit is not None and hit.utilisation >= 0.95
    shape = model_shape(m)
    for cand in candidates(MethodSpec(method="edit"), len(shape.units)):
        if cand.label == hit.label:
            break
        assert predict(c, m, cand, shape).utilisation < 0.95, cand.label
    with pytest.raises(ConfigError, match="--target"):
        search_target(c, m, [MethodSpec()], 1.5)


def test_bandwidth_for_is_monotone():
    c = cluster()
    m = ModelSpec(params=1e9, layers=24, dim=2048, dtype="bf16")
    meth = MethodSpec(method="diloco", H=100, fragments=8, overlap=1, codec="fp4")
    needs = [bandwidth_for(c, m, meth, u) for u in (0.5, 0.8, 0.95)]
    assert needs[0] < needs[1] < needs[2]


# ---------------------------------------------------------------------------- calibration
def write_synthetic_run(path, compute_s=0.05, overhead_s=0.004, latency_s=0.005,
                        bandwidth=2e6, slow=1.5, steps=40, H=4, own_latency_s=0.0,
                        own_bandwidth=None, simulated=True, final_round=False):
    """A run directory as ``editrain train`` writes it, from known parameters: rounds of
    varying size (fragments of unequal units) on a link of ``bandwidth`` and
    ``latency_s`` per collective, replica 1 ``slow`` times slower. ``simulated``: the
    link is a simulated one (its share logged as ``link_delay_s``), else the machine's.
    ``final_round``: one more round after the last step, in a row of its own (as the end's
    ``finish()`` logs it), on the same link."""
    (path / "ranks").mkdir(parents=True)
    (path / "config.toml").write_text(
        '[model]\npreset = "tiny"\n[data]\nvocab_size = 512\n'
        "[train]\nbatch_size = 8\nseq_len = 64\n"
        '[dist]\nnproc = 2\nshard_size = 1\n[sync]\nmethod = "edit"\n'
        "local_sgd_sync_interval = 4\nfragments = 2\noverlap_steps = 1\n"
        + ('[sim]\nlink_bandwidth = "2MB/s"\nlink_latency = "5ms"\n' if simulated else ""))
    rows, ranks = [], {0: [], 1: []}
    t = train = 0.0
    for step in range(1, steps + 1):
        sync = None
        wait = 0.0
        if step % (H // 2) == 0:
            nbytes = 10_000 + 37_000 * (step % 3) + 1000 * step
            coll = 2 + step % 2
            delay = coll * latency_s + nbytes / bandwidth
            own = coll * own_latency_s + (nbytes / own_bandwidth if own_bandwidth else 0.0)
            sync = {"sync": step, "step": step, "bytes_sent": nbytes, "sync_collectives": coll,
                    "comm_time_s": delay + own, "link_delay_s": delay if simulated else 0.0,
                    "wait_s": 0.0}
        dt = compute_s + wait + overhead_s
        t += dt
        train += dt
        row = {"step": step, "tokens": 1024 * step, "loss": 5.0, "compute_s": compute_s,
               "sync_wait_s": wait, "grad_sync_s": 0.0, "step_time_s": compute_s + wait,
               "wall_time_s": t, "train_time_s": train}
        if sync:
            row["sync"] = sync
        rows.append(row)
        for r in (0, 1):
            ranks[r].append({"rank": r, "replica": r, "step": step, "wall_time_s": t,
                             "compute_s": compute_s * (slow if r else 1.0)})
    if final_round:
        nbytes, coll = 123_000, 4
        delay = coll * latency_s + nbytes / bandwidth
        t, train = t + delay, train + delay
        rows.append({"step": steps, "tokens": 1024 * steps, "wall_time_s": t,
                     "train_time_s": train,
                     "sync": {"sync": steps + 1, "step": steps, "bytes_sent": nbytes,
                              "sync_collectives": coll, "comm_time_s": delay,
                              "link_delay_s": delay if simulated else 0.0, "wait_s": delay}})
    write_run_files(path, rows, ranks)


def test_calibration_recovers_known_parameters(tmp_path):
    write_synthetic_run(tmp_path / "run")
    cal = calibrate([tmp_path / "run"])
    assert cal.step_time_s == pytest.approx(0.05)
    assert cal.step_overhead_s == pytest.approx(0.004, abs=1e-9)
    assert cal.bandwidth_bytes_per_s == pytest.approx(2e6, rel=1e-6)
    assert cal.latency_s == pytest.approx(0.005, rel=1e-6)
    assert cal.latency_fitted and cal.residual_rms_s < 1e-9
    assert cal.straggler_spread == pytest.approx(0.5)
    c = cal.cluster()
    assert (c.nodes, c.gpus_per_node, c.latency_per) == (2, 1, "collective")
    assert c.inter_bytes_per_s == pytest.approx(2e6, rel=1e-6)
    s = cal.samples[0]
    assert (s.method.method, s.method.H, s.method.fragments, s.method.overlap) == \
        ("edit", 4, 2, 1)
    assert (s.model.preset, s.model.vocab_size, s.model.batch_size) == ("tiny", 512, 8)
    assert "inter_node_gbps = " in cal.to_toml()


def test_calibration_counts_the_round_the_end_logs_in_a_row_of_its_own(tmp_path):
    """The round ``finish()`` completes after the last step has a row of its own, without
    a loss: it is one more sample of the link (before, a run's rows were read for rounds
    only where they held a loss, so the last round was never seen), and the step times and
    overhead, read from the steps, are those of the run without it."""
    write_synthetic_run(tmp_path / "plain")
    write_synthetic_run(tmp_path / "final", final_round=True)
    plain, final = calibrate([tmp_path / "plain"]), calibrate([tmp_path / "final"])
    assert len(final.samples[0].syncs) == len(plain.samples[0].syncs) + 1
    assert final.samples[0].syncs[-1] == (4.0, 123_000.0, pytest.approx(4 * 0.005 + 0.0615))
    assert final.step_time_s == plain.step_time_s
    assert final.step_overhead_s == pytest.approx(plain.step_overhead_s, abs=1e-12)
    assert final.bandwidth_bytes_per_s == pytest.approx(2e6, rel=1e-6)
    assert final.latency_s == pytest.approx(0.005, rel=1e-6)


def test_calibration_separates_the_machines_own_cost(tmp_path):
    write_synthetic_run(tmp_path / "run", own_latency_s=0.001, own_bandwidth=8e6)
    cal = calibrate([tmp_path / "run"])
    assert cal.bandwidth_bytes_per_s == pytest.approx(1 / (1 / 2e6 + 1 / 8e6), rel=1e-6)
    assert cal.latency_s == pytest.approx(0.006, rel=1e-6)
    assert cal.own_bandwidth_bytes_per_s == pytest.approx(8e6, rel=1e-6)
    assert cal.own_latency_s == pytest.approx(0.001, rel=1e-6)
    # Another simulated link on the same machine: its costs plus the machine's own.
    link = cal.with_link(1e6, 0.005)
    assert link["inter_node_gbps"] * GBIT == pytest.approx(1 / (1 / 1e6 + 1 / 8e6), rel=1e-6)
    assert link["inter_node_latency_ms"] == pytest.approx(6.0)


def test_bench_plan_groups_on_an_unlimited_link_share_the_machines_own_cost(tmp_path):
    """The machine's own cost per collective and per byte is fitted where a simulated link
    separates it (the ``link`` group) and used by a group whose runs cannot (no simulated
    link): the same machine."""
    from editrain.bench.plan import group_rows
    from editrain.bench.runs import read_run as read_bench_run

    write_synthetic_run(tmp_path / "link", own_latency_s=0.001, own_bandwidth=8e6)
    write_synthetic_run(tmp_path / "plain", latency_s=0.002, bandwidth=5e6, simulated=False)
    for name in ("link", "plain"):  # finished runs
        (tmp_path / name / "summary.json").write_text(json.dumps({"steps_run": 40}))
    run = {name: read_bench_run(name, tmp_path / name, {}, 1.0, None)
           for name in ("link", "plain")}
    link = ("2MB/s", "5ms")
    machine, _, _ = group_rows([("cal", "link", ({}, link, {}), run["link"])], 4, False)
    assert machine.own_latency_s == pytest.approx(0.001, rel=1e-6)
    assert machine.own_bandwidth_bytes_per_s == pytest.approx(8e6, rel=1e-6)
    alone, _, own = group_rows([("cal", "plain", ({}, None, {}), run["plain"])], 4, False)
    assert (alone.own_bandwidth_bytes_per_s, alone.own_latency_s) == (None, 0.0)
    shared, _, shared_own = group_rows([("cal", "plain", ({}, None, {}), run["plain"])], 4,
                                       False, machine)
    assert shared.own_latency_s == machine.own_latency_s
    assert shared.own_bandwidth_bytes_per_s == machine.own_bandwidth_bytes_per_s
    assert shared.latency_s == alone.latency_s  # its own rounds' fit stays its own
    # On an unlimited link the prediction now charges the machine's cost per collective
    # and per byte (the link a held-out run of the group is predicted on).
    assert alone.with_link(None, 0.0)["inter_node_latency_ms"] == 0.0
    unlimited = shared.with_link(None, 0.0)
    assert unlimited["inter_node_latency_ms"] == pytest.approx(1.0)
    assert unlimited["inter_node_gbps"] * GBIT == pytest.approx(8e6, rel=1e-6)
    assert shared_own["plain"]["ok"] and own["plain"]["ok"]


def write_run_files(path, rows, ranks) -> None:
    """A run's ``metrics.jsonl`` (``rows``) and ``ranks/rank{r}.jsonl`` (``ranks[r]``)."""
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r, lines in ranks.items():
        (path / "ranks" / f"rank{r}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines))


def write_overlap_run(path, fragments=1, H=8, step_s=0.03, cost_s=0.012, steps=40,
                      overlap=0, method="edit"):
    """A run (edit: layer-wise) whose rounds slow the compute by ``cost_s`` spread over
    the steps they run beside (overlap + 1 after the launch); other steps take
    ``step_s``; both replicas alike; no link."""
    (path / "ranks").mkdir(parents=True)
    (path / "config.toml").write_text(
        '[model]\npreset = "tiny"\n[train]\nbatch_size = 8\nseq_len = 64\n'
        f'[dist]\nnproc = 2\nshard_size = 1\n[sync]\nmethod = "{method}"\n'
        f"local_sgd_sync_interval = {H}\nfragments = {fragments}\n"
        f"overlap_steps = {overlap}\n")
    launches = [k for k in range(1, steps + 1) if k % (H // fragments) == 0]
    extra = {k: 0.0 for k in range(1, steps + 1)}
    for k in launches:
        for j in range(k + 1, k + overlap + 2):
            if j in extra:
                extra[j] += cost_s / (overlap + 1)
    rows, ranks, t = [], {0: [], 1: []}, 0.0
    for step in range(1, steps + 1):
        c = step_s + extra[step]
        t += c
        row = {"step": step, "tokens": 1024 * step, "loss": 5.0, "compute_s": c,
               "sync_wait_s": 0.0, "grad_sync_s": 0.0, "wall_time_s": t, "train_time_s": t}
        if step - overlap - 1 in launches:  # logged at the merge (in the next forward)
            launch = step - overlap - 1
            # a delayed round's entry: the step of its merge and that of its launch
            row["sync"] = {"step": launch + overlap, "bytes_sent": 1000,
                           "sync_collectives": 2, "comm_time_s": 0.001, "wait_s": 0.0,
                           **({"launch_step": launch} if overlap else {})}
        rows.append(row)
        for r in (0, 1):
            ranks[r].append({"rank": r, "replica": r, "step": step, "wall_time_s": t,
                             "compute_s": c})
    write_run_files(path, rows, ranks)


def test_calibration_recovers_the_cost_of_rounds_beside_the_compute(tmp_path):
    # One setting: within the run. Steps 5..40; rounds launched at 8, 16, 24, 32 slow
    # steps 9, 17, 25, 33 by 12 ms (the one at 40 has no step left): 4 rounds in 36 steps.
    write_overlap_run(tmp_path / "p1")
    cal = calibrate([tmp_path / "p1"])
    s = cal.samples[0]
    assert s.compute_s == pytest.approx(0.03 + 4 * 0.012 / 36)
    assert s.quiet_compute_s == pytest.approx(0.03)
    assert s.rounds_per_step == pytest.approx(4 / 36)
    assert cal.step_time_s == pytest.approx(0.03)
    assert cal.overlap_cpu_s == pytest.approx(0.012)
    assert cal.overlap_fit == "within runs"
    assert cal.cluster().overlap_cpu_s == pytest.approx(0.012)
    assert "overlap_cpu_s = 0.01" in cal.to_toml()
    # Two rates (1 and 4 fragments; the latter with overlap 1, its cost spread over two
    # steps, so that no step is free of a round): across the settings.
    write_overlap_run(tmp_path / "p4", fragments=4, overlap=1)
    two = calibrate([tmp_path / "p1", tmp_path / "p4"])
    assert two.samples[1].quiet_compute_s is None
    assert two.overlap_fit == "across settings"
    assert two.step_time_s == pytest.approx(0.03)
    assert two.overlap_cpu_s == pytest.approx(0.012)
    # A blocking setting (diloco) has no round beside the compute: its mean is its step.
    write_overlap_run(tmp_path / "none", cost_s=0.0, method="diloco")
    blocking = calibrate([tmp_path / "none"])
    assert blocking.samples[0].rounds_per_step == 0.0
    assert (blocking.overlap_cpu_s, blocking.overlap_fit) == (0.0, "none")
    assert blocking.step_time_s == pytest.approx(0.03)


def test_fit_compute_by_hand():
    assert fit_compute([(0.0, 0.03, 0.03), (0.25, 0.04, None)]) == \
        pytest.approx((0.03, 0.04, "across settings"))
    step, cost, how = fit_compute([(0.125, 0.032, 0.03), (0.125, 0.036, 0.032)])
    assert how == "within runs"
    assert step == pytest.approx(0.031) and cost == pytest.approx(0.024)  # medians
    # Compute falling with more rounds is not a cost: none, the median mean.
    assert fit_compute([(0.0, 0.04, 0.04), (0.25, 0.03, None)]) == \
        pytest.approx((0.035, 0.0, "none"))


def test_rounds_beside_the_compute_slow_only_overlapping_settings():
    c = cluster(overlap_cpu_s=0.016, inter_node_gbps=1e5)  # a link too fast to matter
    m = ModelSpec(params=1e7, layers=4, dim=256)
    plain = cluster(inter_node_gbps=1e5)
    # Blocking rounds and sync: nothing added.
    for spec in (MethodSpec(method="diloco", H=8), MethodSpec(method="post_local_sgd", H=8),
                 MethodSpec(method="sync"),
                 MethodSpec(method="edit", H=8, layerwise=False)):
        assert predict(c, m, spec).compute_s == pytest.approx(0.1), spec.label
        assert predict(c, m, spec).tokens_per_s == \
            pytest.approx(predict(plain, m, spec).tokens_per_s)
    # Layer-wise edit: one round per 8 steps, 16 ms: 2 ms per step.
    edit = predict(c, m, MethodSpec(method="edit", H=8))
    assert edit.compute_s == pytest.approx(0.102)
    base = predict(plain, m, MethodSpec(method="edit", H=8))
    assert edit.wall_per_step_s == pytest.approx(base.wall_per_step_s + 0.002, rel=1e-6)
    # Utilisation counts the slowdown as compute (as compute_s measures it).
    assert edit.utilisation == pytest.approx(0.102 / edit.wall_per_step_s)
    # Four fragments with overlap 2: four rounds per 8 steps: 8 ms per step.
    frag = predict(c, m, MethodSpec(method="edit", H=8, fragments=4, overlap=2))
    assert frag.compute_s == pytest.approx(0.108)
    # diloco overlapped (overlap > 0) pays it; eager too.
    assert predict(c, m, MethodSpec(method="diloco", H=8, overlap=1)).compute_s == \
        pytest.approx(0.102)
    assert predict(c, m, MethodSpec(method="diloco", H=8, eager=True)).compute_s == \
        pytest.approx(0.102)
    # A-EDiT: one round per window of H nominal steps, 2 ms per step on each replica.
    nb = predict(c, m, MethodSpec(method="aedit", H=8, overlap=2))
    assert nb.compute_s == pytest.approx(0.102)
    assert nb.tokens_per_s == pytest.approx(2 * m.batch_size * m.seq_len / 0.102)


def test_calibration_leaves_out_the_wait_for_a_late_replica(tmp_path):
    # Rank 1 launches every round 30 ms after rank 0, whose first collective waits for
    # it: its comm_time_s holds 30 ms that are neither the link's nor the machine's.
    run = tmp_path / "run"
    write_synthetic_run(run, own_latency_s=0.001, own_bandwidth=8e6)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if "sync" in r:
            r["sync"]["comm_time_s"] += 0.03
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for rank in (0, 1):
        path = run / "ranks" / f"rank{rank}.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        for x in lines:
            x["unix_time"] = 1e9 + x["wall_time_s"] + (0.03 if rank else 0.0)
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cal = calibrate([run])  # (unix times of 1e9 s hold about 1e-7 s)
    assert cal.bandwidth_bytes_per_s == pytest.approx(1 / (1 / 2e6 + 1 / 8e6), rel=1e-4)
    assert cal.own_bandwidth_bytes_per_s == pytest.approx(8e6, rel=1e-4)
    assert cal.own_latency_s == pytest.approx(0.001, rel=1e-4)
    # Rank 0 last: no wait; a missing clock: none assumed.
    assert peer_lag_s({0: {4: 10.5}, 1: {4: 10.0}}, 4) == 0.0
    assert peer_lag_s({0: {4: 10.0}, 1: {4: 10.25}, 2: {4: 10.5}}, 4) == 0.5
    assert peer_lag_s({0: {4: 10.0}}, 4) == 0.0


def test_calibration_reads_the_wait_for_a_late_replica_where_each_round_launched(tmp_path):
    """Rank 0 waits inside a round's first collective for ranks that launched it later:
    a delayed (streaming) round launched at its ``launch_step``, not at its entry's
    ``step`` (its merge); of the rounds the end launches one after the other (rows of their
    own after the last step), the first waits for the ranks' arrival there, the next start
    on ranks its collectives brought together. Before, the lag was read at the merge step
    (none: rank 1 lags at the launches) and taken off every end round again."""
    def lagged(run, lag):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        last = max(r["step"] for r in rows)
        end = [r for r in rows if "loss" not in r]
        end.append(dict(end[-1], sync=dict(end[-1]["sync"], sync=last + 2, bytes_sent=51_000,
                                           sync_collectives=2,
                                           comm_time_s=2 * 0.005 + 51_000 / 2e6)))
        rows = [r for r in rows if "loss" in r] + end
        for r in rows:
            s = r.get("sync")
            if s and "loss" in r:  # launched one step before its merge
                s["launch_step"] = s["step"] - 1
            if s and (r is end[0] or "loss" in r):
                s["comm_time_s"] += lag  # the waits: at the launches and the end's first
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for rank in (0, 1):
            path = run / "ranks" / f"rank{rank}.jsonl"
            lines = [json.loads(x) for x in path.read_text().splitlines()]
            for x in lines:
                late = rank and (x["step"] % 2 or x["step"] == last)
                x["unix_time"] = 1e9 + x["wall_time_s"] + (lag if late else 0.0)
            path.write_text("".join(json.dumps(x) + "\n" for x in lines))

    for name, lag in (("plain", 0.0), ("late", 0.03)):
        write_synthetic_run(tmp_path / name, simulated=False, final_round=True)
        lagged(tmp_path / name, lag)
    plain, late = calibrate([tmp_path / "plain"]), calibrate([tmp_path / "late"])
    assert [s[2] for s in late.samples[0].syncs] == pytest.approx(
        [s[2] for s in plain.samples[0].syncs], abs=1e-6)
    assert late.bandwidth_bytes_per_s == pytest.approx(plain.bandwidth_bytes_per_s, rel=1e-4)
    assert late.latency_s == pytest.approx(plain.latency_s, rel=1e-4)


def test_fit_link_with_one_kind_of_round_assumes_the_latency():
    rounds = [(3.0, 1e6, 3 * 0.01 + 1e6 / 5e6)] * 4
    bw, lat, rms, fitted = fit_link(rounds, latency_s=0.01)
    assert not fitted and lat == 0.01 and bw == pytest.approx(5e6)
    bw0, lat0, _, _ = fit_link(rounds)
    assert lat0 == 0.0 and bw0 < 5e6  # the latency is folded into the bandwidth


def test_calibration_of_a_resumed_run_reads_its_latest_job_only(tmp_path):
    """A run of 2 replicas (replica 1 1.5x slower) to step 24, resumed elastically from its
    step-8 checkpoint on 1 replica to step 30 (config.toml is the latest job's): replica
    1's file still holds steps 9 to 24 of the timeline the job left, and metrics.jsonl the
    first job's rows. Before, those were read with the latest job's (a straggler spread of
    a replica it does not have, the first job's compute beside its own)."""
    from editrain import rundir

    run = tmp_path / "run"
    write_synthetic_run(run, steps=24)
    rundir.write_record(run, rundir.RunRecord("r", "b2", history=[
        {"branch": "b1"}, {"branch": "b2", "from_step": 8}]))
    text = (run / "config.toml").read_text().replace("nproc = 2", "nproc = 1")
    (run / "config.toml").write_text(text)
    t = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["wall_time_s"]
    with open(run / "metrics.jsonl", "a") as rows, open(run / "ranks" / "rank0.jsonl",
                                                          "a") as rank0:
        for step in range(9, 31):
            t += 0.021
            rows.write(json.dumps({"step": step, "loss": 5.0, "compute_s": 0.02,
                                   "wall_time_s": t, "train_time_s": t}) + "\n")
            rank0.write(json.dumps({"rank": 0, "replica": 0, "step": step, "wall_time_s": t,
                                    "compute_s": 0.02}) + "\n")
    start, rows, ranks = job_rows(run, 1)
    assert start == 8 and [r["step"] for r in rows] == list(range(9, 31))
    assert list(ranks) == [0] and all(r["compute_s"] == 0.02 for r in ranks[0])
    cal = calibrate([run])
    assert (cal.cluster().nodes, cal.straggler_spread) == (1, 0.0)
    assert cal.step_time_s == pytest.approx(0.02)  # (class 6: float64 sums of one value)
    assert cal.step_overhead_s == pytest.approx(0.001)
    # The vocabulary: the summary's, else the newest checkpoint's, else the configured.
    assert run_vocab_size(run, {"data": {"vocab_size": 512}}) == 512
    for step, vocab in ((20, 290), (30, 300)):
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "editrain.json").write_text(json.dumps({"step": step, "vocab_size": vocab}))
    assert run_vocab_size(run, {}) == 300
    (run / "summary.json").write_text(json.dumps({"steps": 30, "vocab_size": 310}))
    assert cal.samples[0].model.vocab_size == 512 and calibrate([run]).samples[0] \
        .model.vocab_size == 310


CONFIG_EDITS = [
    ("nproc = 2", "nproc = true", "dist.nproc: expected an integer, got true"),
    ("shard_size = 1", "shard_size = 1.5", "dist.shard_size: expected an integer, got 1.5"),
    ("fragments = 2", "fragments = true", "sync.fragments: expected an integer, got true"),
    ("local_sgd_sync_interval = 4", 'local_sgd_sync_interval = "4"',
     'sync.local_sgd_sync_interval: expected an integer, got "4"'),
    ("overlap_steps = 1", "overlap_steps = 1.9",
     "sync.overlap_steps: expected an integer, got 1.9"),
    ("batch_size = 8", "batch_size = 8.5", "train.batch_size: expected an integer, got 8.5"),
    ("seq_len = 64", "seq_len = -64", "train.seq_len: must be >= 1, got -64"),
    ("overlap_steps = 1", 'overlap_steps = 1\nerror_feedback = "false"',
     'sync.error_feedback: expected true or false, got "false"'),
    ("overlap_steps = 1", "overlap_steps = 1\ncpu_offload = 1",
     "sync.cpu_offload: expected true or false, got 1"),
    ('preset = "tiny"', 'preset = "tiny"\ntie_embeddings = "yes"',
     'model.tie_embeddings: expected true or false, got "yes"'),
]


@pytest.mark.parametrize(("old", "new", "why"), CONFIG_EDITS,
                         ids=[new.split("\n")[-1] for _, new, _ in CONFIG_EDITS])
def test_calibrate_reads_a_runs_config_toml_strictly(tmp_path, old, new, why):
    """``plan --calibrate`` read a run's config.toml with ``int()`` and ``bool()``: a
    ``true`` count was 1, ``1.5`` shards 1, ``"4"`` rounds of 4 steps, the text "false"
    error feedback on. Each is refused, naming the file and the option."""
    run = tmp_path / "run"
    write_synthetic_run(run)
    text = (run / "config.toml").read_text()
    assert old in text
    (run / "config.toml").write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        calibrate([run])
    assert str(info.value) == f"plan: \"{run / 'config.toml'}\": {why}"


def test_calibrate_rejects_a_non_run(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        calibrate([tmp_path])


# ---------------------------------------------------------------------------- CLI
PLAN_TOML = """\
[cluster]
nodes = 4
gpus_per_node = 8
gpu_peak_tflops = 989
mfu = 0.4
gpu_memory_gb = 80
inter_node_gbps = 10
inter_node_latency_ms = 0.05
straggler_spread = 0.1

[model]
preset = "1b"
seq_len = 2048
batch_size = 32
micro_batch = 1

[[method]]
method = "sync"

[[method]]
method = "edit"
H = 128
"""


def test_cli_end_to_end(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(PLAN_TOML)
    out = tmp_path / "out"
    assert main(["plan", str(path), "--out", str(out), "--target", "0.9"]) == 0
    text = capsys.readouterr().out
    assert "| sync | 4x8x1 |" in text and "| edit H=128 | 4x8x1 |" in text
    assert "Cheapest setting reaching utilisation 0.9" in text
    assert (out / "utilisation_vs_bandwidth.png").stat().st_size > 1000
    record = json.loads((out / "plan.json").read_text())
    sync, edit = record["predictions"]
    assert edit["utilisation"] > sync["utilisation"]
    assert record["search"]["edit"]["found"]["utilisation"] >= 0.9
    # Command-line values override the file; --method replaces its methods.
    assert main(["plan", str(path), "--out", str(out), "--no-plot", "--json",
                 "--cluster.inter_node_gbps=400", "--method", "edit:H=32,codec=int4"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["cluster"]["inter_node_gbps"] == 400
    assert [p["label"] for p in record["predictions"]] == ["edit H=32 int4"]


def test_cli_bad_cluster_is_one_line(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(PLAN_TOML.replace("inter_node_gbps = 10", "inter_node_gbps = 0"))
    assert main(["plan", str(path), "--out", str(tmp_path / "o"), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err == "editrain: error: cluster.inter_node_gbps: must be > 0, got 0\n"
    path.write_text(PLAN_TOML.replace("mfu = 0.4", "mfu = 1.2"))
    assert main(["plan", str(path), "--out", str(tmp_path / "o"), "--no-plot"]) == 2
    assert capsys.readouterr().err.startswith("editrain: error: cluster.mfu: must be <= 1")
    path.write_text(PLAN_TOML.replace("micro_batch = 1", "micro_batch = 32"))
    assert main(["plan", str(path), "--out", str(tmp_path / "o"), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("editrain: error: cluster.gpu_memory_gb:") and err.count("\n") == 1
    assert main(["plan", str(path), "--bogus=1", "--no-plot"]) == 2
    assert "unexpected argument" in capsys.readouterr().err


def test_cli_options_take_their_value_after_a_space(tmp_path, capsys):
    """--model.preset 7b as editrain train writes options: the value is the option's, not
    PLAN.toml (it said "PLAN.toml: file not found: '7b'")."""
    path = tmp_path / "c.toml"
    path.write_text(PLAN_TOML)
    spaced = ["plan", "--cluster.inter_node_gbps", "400", str(path), "--json", "--no-plot",
              "--out", str(tmp_path / "o"), "--method", "edit:H=32"]
    assert main(spaced) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["inter_node_gbps"] == 400
    joined = [a if a != "--cluster.inter_node_gbps" else "--cluster.inter_node_gbps=400"
              for a in spaced if a != "400"]
    assert main(joined) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["inter_node_gbps"] == 400


def test_plan_sizes_beyond_what_it_models_are_one_line(tmp_path, capsys):
    """A cluster of 10**9 nodes ran without end (the plan follows every replica)."""
    path = tmp_path / "c.toml"
    path.write_text(PLAN_TOML)
    code = main(["plan", str(path), "--no-plot", "--out", str(tmp_path / "o"),
                 "--cluster.nodes", str(10**9)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("editrain: error: cluster.nodes: 1,000,000,000 nodes x 8 GPUs is "
                          "more than the 1,000,000 GPUs the planner models")
    ModelSpec(params=1e10, layers=10**5)
    with pytest.raises(ConfigError, match=r"^model.layers: must be at most 100,000 .*got "
                                          r"1,000,000$"):
        ModelSpec(params=1e10, layers=10**6)


def test_cli_calibrate(tmp_path, capsys):
    write_synthetic_run(tmp_path / "run")
    out = tmp_path / "out"
    assert main(["plan", "--calibrate", str(tmp_path / "run"), "--out", str(out),
                 "--no-plot", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert "2.000 MB/s" in record["calibration"]
    assert record["predictions"][0]["label"] == "run (as run)"
    assert main(["plan", "--calibrate", str(tmp_path / "run"), "--out", str(out),
                 "--no-plot", "--method", "diloco:H=8",
                 f"--cluster.inter_node_gbps={1e6 / GBIT}"]) == 0
    text = capsys.readouterr().out
    assert "| diloco H=8 | 2x1x1 |" in text
    assert math.isfinite(json.loads((out / "plan.json").read_text())["predictions"][0][
        "tokens_per_s"])


# ---------------------------------------------------------------------------- docs
def test_planning_md_holds_the_current_tables():
    from pathlib import Path

    from editrain.plan.published import edit_scale_table_md, published_table_md

    text = (Path(__file__).resolve().parent.parent / "docs" / "planning.md").read_text()
    assert published_table_md() in text, "regenerate the published table in docs/planning.md"
    assert edit_scale_table_md() in text, "regenerate the EDiT-scale table in docs/planning.md"


def test_published_data_parallel_row_within_20_percent():
    from editrain.plan.published import published_table

    dp = published_table()[0]
    assert dp["row"] == "1B data-parallel"
    assert all(0.95 < r < 1.2 for r in dp["ratio"][:4]), dp["ratio"]


# ---------------------------------------------------------------------------- bench plan
def test_bench_plan_judges_the_median_over_held_out_settings():
    from editrain.bench.plan import _judge

    def row(ratio, diff):
        return {"ok": True, "tokens_ratio": ratio, "utilisation_diff": diff,
                "predicted": {"tokens_per_s": 100.0 * ratio, "utilisation": 0.5 + diff,
                              "exposed_comm_s": 0.01},
                "measured": {"tokens_per_s": 100.0, "utilisation": 0.5,
                             "exposed_comm_s": 0.01}}

    targets, findings, headline = _judge({"a": row(1.05, 0.01), "b": row(0.97, -0.03),
                                          "c": row(1.4, 0.2)})
    assert [t["met"] for t in targets] == [True, True]  # medians 0.05 and 0.03
    assert any("c (1.400x)" in f for f in findings)
    assert headline and "within 5.0%" in headline[0]
    targets, _, _ = _judge({"a": row(1.2, 0.1), "b": row(0.8, 0.01), "c": row(1.0, 0.07)})
    assert [t["met"] for t in targets] == [False, False]


def test_bench_plan_tables_keep_a_failed_run_and_leave_out_a_group_without_calibration():
    """A run that failed keeps its row (its name and link, every number n/a); a group none
    of whose calibration runs finished has no row in the calibration table. (The golden
    record, tests/test_bench_declared.py, has neither: its made-up runs all finish.)"""
    from editrain.bench.plan import SCENARIO
    from editrain.bench.scenario import Ctx

    failed = {"ok": False, "error": "boom", "link": "1MB/s+5ms"}
    ctx = Ctx(results={"held_out": {"x": failed}, "in_sample": {},
                       "groups": {"link": {"error": "no calibration run finished"}}})
    held, in_sample, calibration = (table.render(ctx)[1] for table in SCENARIO.tables)
    assert held.splitlines()[2] == "| x | 1MB/s+5ms |" + " n/a |" * 10
    assert len(in_sample.splitlines()) == len(calibration.splitlines()) == 2  # no rows


def test_bench_plan_utilisation_covers_the_throughput_window(tmp_path):
    from editrain.bench.plan import _window_utilisation
    from editrain.bench.runs import Run

    rows = [{"step": s, "wall_time_s": 0.1 * s + (0.3 if s > 8 else 0.0),
             "compute_s": 0.05} for s in range(1, 17)]
    run = Run("x", tmp_path, {}, ranks={0: rows, 1: rows})
    # Steps 5..12: 8 steps of 0.05 s compute in 0.8 s + 0.3 s of waiting.
    got = _window_utilisation(run, {"from_step": 4, "to_step": 12}, 4, False)
    assert got == [pytest.approx(0.4 / 1.1)] * 2


def test_calibrate_reads_every_replica_of_a_tensor_parallel_run(tmp_path):
    """nproc 4 with tp 2: 2 replicas of global ranks 0-1 and 2-3 (tp innermost), replica 1
    three times slower. Calibrate kept the ranks below replicas x shards (0 and 1, both
    replica 0's) and saw no straggler; every rank of the job is read now."""
    from editrain.plan.calibrate import read_run as read_calibration

    run = tmp_path / "run"
    (run / "ranks").mkdir(parents=True)
    (run / "config.toml").write_text('[dist]\nnproc = 4\ntp_size = 2\nshard_size = 1\n'
                                     '[sync]\nmethod = "diloco"\nlocal_sgd_sync_interval = 4\n')
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, 13):
            f.write(json.dumps({"step": s, "tokens": 64 * s, "loss": 3.0, "compute_s": 0.1,
                                "wall_time_s": 0.11 * s, "train_time_s": 0.11 * s}) + "\n")
    for rank in range(4):
        with open(run / "ranks" / f"rank{rank}.jsonl", "w") as f:
            for s in range(1, 13):
                f.write(json.dumps({"rank": rank, "replica": rank // 2, "step": s,
                                    "wall_time_s": 0.11 * s, "unix_time": 1000 + 0.11 * s,
                                    "compute_s": 0.1 if rank < 2 else 0.3}) + "\n")
    sample = read_calibration(run)
    assert sample.replicas == 2
    # (means of a few float64 sums: tests/README.md class 6)
    assert sample.factors == pytest.approx([1.0, 3.0])


def test_calibrate_refuses_a_pipeline_parallel_run(tmp_path):
    """A pp run is read with its stages (tests/test_plan_pipeline.py); one whose pipeline
    training itself refuses (the tiny preset ties its embeddings, which the first and last
    stage would share) is refused, naming the option."""
    write_synthetic_run(tmp_path)
    config = tmp_path / "config.toml"
    config.write_text(config.read_text().replace("shard_size = 1\n",
                                                 "shard_size = 1\npp_size = 2\n"))
    with pytest.raises(ConfigError, match=r"method.pp: 2 stages need untied embeddings .*"
                                          r"model.tie_embeddings = false"):
        calibrate([tmp_path])


def test_calibrate_refuses_runs_of_different_jobs(tmp_path):
    """Several runs are fitted as one job's compute (with and without rounds beside it)
    and the plan scales from the first run's job: runs of another batch or layout were
    mixed into that fit silently. Other methods and links are what several runs are for."""
    for name in ("a", "b", "c"):
        write_synthetic_run(tmp_path / name)
    b, c = tmp_path / "b" / "config.toml", tmp_path / "c" / "config.toml"
    b.write_text(b.read_text().replace("batch_size = 8", "batch_size = 16"))
    c.write_text(c.read_text().replace("nproc = 2\nshard_size = 1",
                                       "nproc = 4\nshard_size = 2"))
    with pytest.raises(ConfigError, match=r"b\" ran another job than .*a\" \(model.batch_size 8 "
                                          r"vs 16\): calibrate from runs of one model"):
        calibrate([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(ConfigError, match=r"shard_size 1 vs 2\)"):
        calibrate([tmp_path / "a", tmp_path / "c"])
    same = tmp_path / "d"
    write_synthetic_run(same, simulated=False)  # another link: still one job
    assert len(calibrate([tmp_path / "a", same]).samples) == 2


HOSTILE_NUMBERS = (True, "1", math.nan, math.inf, -1)
"""Values no field of a metrics row the calibration reads may hold: a bool (``float(True)``
was 1), a string (``float("1")`` parsed it), NaN and infinity, a negative."""
HOSTILE_FIELDS = (
    # (file, row index, path to the field, bad values beyond HOSTILE_NUMBERS)
    ("metrics", 9, ("sync", "bytes_sent"), (2.5,)),
    ("metrics", 9, ("sync", "comm_time_s"), ()),
    ("metrics", 9, ("sync", "link_delay_s"), ()),
    ("metrics", 9, ("sync", "sync_collectives"), (2.5,)),
    ("metrics", 9, ("sync", "launch_step"), (9.5,)),
    ("metrics", 9, ("sync", "step"), (9.5,)),
    ("metrics", 9, ("step",), (10.5,)),
    ("metrics", 10, ("compute_s",), ()),
    ("metrics", 10, ("sync_wait_s",), ()),
    ("metrics", 10, ("grad_sync_s",), ()),
    ("metrics", 10, ("train_time_s",), ()),
    ("rank1", 12, ("compute_s",), ()),
    ("rank1", 12, ("replica",), (1.5,)),
    ("rank1", 12, ("sim_stall_s",), ()),
    ("rank1", 12, ("unix_time",), ()),
    ("rank1", 12, ("step",), (13.5,)),
)


def _hostile_cases():
    for file, index, path, extra in HOSTILE_FIELDS:
        for value in (*HOSTILE_NUMBERS, *extra):
            yield pytest.param(file, index, path, value, id=f"{file}-{'.'.join(path)}-{value!r}")


@pytest.mark.parametrize("file,index,path,value", list(_hostile_cases()))
def test_calibration_skips_a_row_whose_field_is_not_what_editrain_writes(
        tmp_path, file, index, path, value):
    """A row of ``metrics.jsonl`` or a rank's file whose field the calibration reads holds
    what editrain never writes (a bool, a string, NaN, infinity, a negative time, a float
    count or step) is skipped as no measurement, as the other readers of those files skip
    a row they cannot read: the calibration is that of the run without the row. Before,
    ``float()`` / ``int()`` took ``true`` as 1, parsed ``"1"``, truncated a step of 9.5,
    and let NaN, infinity and negative seconds into the fit (or crashed on a string)."""
    source, hostile, without = (tmp_path / n for n in ("source", "hostile", "without"))
    write_synthetic_run(source, own_latency_s=0.001, own_bandwidth=8e6)
    for rank in (0, 1):  # every rank's clock and stall, as the trainer logs them
        log = source / "ranks" / f"rank{rank}.jsonl"
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        log.write_text("".join(json.dumps({**x, "sim_stall_s": 0.0, "unix_time": 1e9
                                           + x["wall_time_s"]}) + "\n" for x in lines))
    shutil.copytree(source, hostile)
    shutil.copytree(source, without)
    name = "metrics.jsonl" if file == "metrics" else f"ranks/{file}.jsonl"
    rows = [json.loads(x) for x in (source / name).read_text().splitlines()]
    target = rows[index]
    for key in path[:-1]:
        target = target[key]
    assert path[-1] in target or path[-1] in ("launch_step",)
    target[path[-1]] = value
    (hostile / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (without / name).write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows)
                                        if i != index))
    got, want = calibrate([hostile]).samples[0], calibrate([without]).samples[0]
    assert got.syncs == want.syncs
    assert (got.compute_s, got.overhead_s, got.factors, got.quiet_compute_s) == \
        (want.compute_s, want.overhead_s, want.factors, want.quiet_compute_s)
    assert all(math.isfinite(x) and x >= 0 for s in got.syncs for x in s)
