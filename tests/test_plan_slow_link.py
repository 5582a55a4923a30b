"""editrain plan --target on a link too slow for every dense setting (issue 50 item 5):
the search then tries the slow-link settings, the sparse 2-bit codec behind H - 1 steps
first (examples/configs/very_slow_link.toml, what the committed benchmarks show best on
the slowest links), then with the eager merge."""

from __future__ import annotations

from editrain.plan.inputs import Cluster, MethodSpec, ModelSpec
from editrain.plan.model import model_shape, predict
from editrain.plan.search import H_GRID, candidates, search_target

# 2 replicas of 5M parameters at 0.1 s a step over 1 mbit (the real-link benchmark's link).
SLOW = Cluster(nodes=2, gpus_per_node=1, inter_node_gbps=0.001, step_time_s=0.1)
SMALL = ModelSpec(params=5e6, layers=4, dim=256)


def test_slow_link_settings_come_after_every_dense_one():
    base = MethodSpec(method="edit")
    got = candidates(base, 6)
    dense = candidates(base, 6, slow_link=False)
    assert got[:len(dense)] == dense
    tail = got[len(dense):]
    assert [(c.H, c.codec, c.eager, c.overlap, c.fragments) for c in tail[:4]] == [
        (2, "topk2", False, 1, 1), (2, "topk2", True, 2, 1),
        (4, "topk2", False, 3, 1), (4, "topk2", True, 4, 1)]
    assert len(tail) == 2 * len(H_GRID)
    assert all(c.codec in ("fp32", "bf16", "int8", "int4") for c in dense)
    # Not for methods without local rounds to sparsify, nor for torchft's blocking rounds.
    for other in (MethodSpec(method="aedit"), MethodSpec(method="edit", ft=True)):
        assert candidates(other, 6) == candidates(other, 6, slow_link=False)


def test_target_on_a_1mbit_link_picks_the_very_slow_link_setting():
    shape = model_shape(SMALL)
    res = search_target(SLOW, SMALL, [MethodSpec(method="edit")], 0.95, shape)["edit"]
    hit = res["found"]
    assert hit is not None and hit.utilisation >= 0.95
    got = hit.method
    assert got.codec == "topk2" and not got.eager and got.overlap == got.H - 1, hit.label
    assert hit.label == f"edit H={got.H} tau={got.H - 1} topk2"
    # Every dense setting falls short there: the slow-link tier was needed.
    for cand in candidates(MethodSpec(method="edit"), len(shape.units), slow_link=False):
        assert predict(SLOW, SMALL, cand, shape, check_memory=False).utilisation < 0.95, \
            cand.label
