"""The wire format of quantised and sparse pseudo-gradients (editrain.sync.quant, .sparse)."""

from __future__ import annotations

import re

import pytest
import torch

from editrain.sync import quant, sparse
from editrain.sync.config import SyncConfig
from tests.reference import sparse_decoded


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("n", [1, 2, 7, 127, 128, 129, 1000])
def test_encode_decode_round_trip(dtype, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    message, decoded = quant.encode(x, dtype)
    assert message.dtype == torch.uint8
    assert message.numel() == quant.payload_bytes(n, dtype)
    # The receiver decodes exactly what the sender's error feedback assumed.
    assert torch.equal(quant.decode(message, n, dtype), decoded)
    if dtype == "bf16":
        assert torch.equal(decoded, x.to(torch.bfloat16).float())
        return
    qmax = 127 if dtype == "int8" else 7
    for start in range(0, n, quant.BLOCK):
        block = x[start:start + quant.BLOCK]
        scale = block.abs().max() / qmax
        err = (decoded[start:start + quant.BLOCK] - block).abs().max()
        assert err <= scale / 2 * (1 + 1e-6)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_zero_blocks_and_exact_values(dtype):
    qmax = 127 if dtype == "int8" else 7
    x = torch.zeros(300)
    x[128:256] = torch.arange(128) % (2 * qmax + 1) - qmax  # integers: exact at scale 1
    message, decoded = quant.encode(x, dtype)
    assert torch.equal(decoded, x)
    assert torch.equal(quant.decode(message, 300, dtype), x)


def test_int4_codes_cover_both_signs():
    x = torch.tensor([-7.0, 7.0, -1.0, 0.0, 3.0])
    message, decoded = quant.encode(x, "int4")
    assert torch.equal(decoded, x)
    assert message.numel() == 3 + 4  # 5 nibbles in 3 bytes, one fp32 scale


def test_payload_bytes_against_fp32():
    n = 1_000_000
    assert quant.payload_bytes(n, "fp32") == 4 * n
    assert quant.payload_bytes(n, "bf16") == 2 * n
    assert quant.payload_bytes(n, "int8") / (4 * n) <= 0.3
    assert quant.payload_bytes(n, "int4") / (4 * n) <= 0.15


def test_error_feedback_telescopes():
    """With e <- x - D(Q(x)), the decoded values of all rounds sum to the sum of the
    pseudo-gradients minus the last residual: nothing is lost, only delayed."""
    g = torch.Generator().manual_seed(0)
    e = torch.zeros(500)
    sent = torch.zeros(500)
    total = torch.zeros(500)
    for _ in range(20):
        delta = torch.randn(500, generator=g) * 1e-2
        x = delta + e
        _, decoded = quant.encode(x, "int4")
        e = x - decoded
        sent += decoded
        total += delta
    # float32 sums of 20 values of 1e-2 (order 0.1, spacing 7.5e-9): 1e-6 absolute is over
    # 100 ulps for the 40 additions' roundings (tests/README.md class 3); a lost round is 1e-2
    torch.testing.assert_close(sent + e, total, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs,option", [
    ({"overlap_steps": -1}, "sync.overlap_steps"),
    ({"fragments": 0}, "sync.fragments"),
    ({"merge": "avg"}, "sync.merge"),
    ({"merge_alpha": 1.5}, "sync.merge_alpha"),
    # alpha is refused where it would be ignored: not a blend, or no delayed merge
    ({"merge_alpha": 0.5, "overlap_steps": 1}, "sync.merge_alpha"),
    ({"merge_alpha": 0.5, "merge": "blend"}, "sync.merge_alpha"),
    ({"comm_dtype": "fp8"}, "sync.comm_dtype"),
    ({"method": "sync", "fragments": 2}, "sync.method"),
    ({"method": "aedit", "fragments": 2}, "sync.fragments"),
    ({"comm_dtype": "int8", "gta": {"reducer": "gta"}}, "sync.comm_dtype"),
])
def test_streaming_options_are_validated(kwargs, option):
    with pytest.raises(ValueError, match=option.replace(".", r"\.")):
        SyncConfig(**kwargs)


def test_merge_alpha_is_accepted_where_it_blends():
    assert SyncConfig(merge="blend", merge_alpha=0.5, overlap_steps=1).merge_alpha == 0.5
    assert SyncConfig(merge="blend", merge_alpha=0.0).merge_alpha == 0.0  # theta <- A
    with pytest.raises(ValueError, match="the merge is \"keep_local\""):
        SyncConfig(merge_alpha=0.5, overlap_steps=1)
    with pytest.raises(ValueError, match="with overlap_steps = 0"):
        SyncConfig(merge="blend", merge_alpha=0.5)


@pytest.mark.parametrize("kwargs,option", [
    ({"local_sgd_sync_interval": 4, "overlap_steps": 4}, "sync.overlap_steps"),
    ({"local_sgd_sync_interval": 4, "fragments": 5}, "sync.fragments"),
])
def test_streaming_options_checked_against_h(kwargs, option):
    with pytest.raises(ValueError, match=option.replace(".", r"\.")):
        SyncConfig(**kwargs).resolve()


@pytest.mark.parametrize("kwargs,message", [
    # the fragment schedule: a whole round in flight, no less and no more
    ({"local_sgd_sync_interval": 4, "overlap_steps": 3}, "must be local_sgd_sync_interval"),
    ({"local_sgd_sync_interval": 4, "overlap_steps": 0}, "must be local_sgd_sync_interval"),
    ({"method": "aedit", "overlap_steps": 0}, "needs a round in flight"),
    ({"method": "aedit", "overlap_steps": 2, "min_total_global_steps": 5},
     "sync.min_total_global_steps"),
    ({"local_sgd_sync_interval": 4, "overlap_steps": 4, "merge_alpha": 0.5},
     "sync.merge_alpha"),
])
def test_eager_merge_is_refused_where_it_cannot_apply(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyncConfig(merge="eager", **kwargs)


def test_eager_merge_is_accepted_with_a_whole_round_in_flight():
    cfg = SyncConfig(merge="eager", local_sgd_sync_interval=4, overlap_steps=4, fragments=2)
    assert cfg.resolve().merge == "eager"
    # its outer SGD without momentum unless set; the sparse codecs' recipe wins over it
    assert cfg.resolve().outer_optim_kwargs == {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    assert SyncConfig(merge="eager", local_sgd_sync_interval=4, overlap_steps=4,
                      comm_dtype="topk2").resolve().outer_optim_kwargs["lr"] == 2.0
    given = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert SyncConfig(merge="eager", local_sgd_sync_interval=4, overlap_steps=4,
                      outer_optim_kwargs=given).resolve().outer_optim_kwargs == given
    assert SyncConfig(method="aedit", merge="eager", overlap_steps=1).streaming
    with pytest.raises(ValueError, match="= 4 only with sync.merge = 'eager'"):
        SyncConfig(local_sgd_sync_interval=4, overlap_steps=4)


def test_fault_tolerant_mode_refuses_the_eager_merge():
    from editrain.sync.setup import check_fault_tolerant

    cfg = SyncConfig(merge="eager", local_sgd_sync_interval=4, overlap_steps=4).resolve()
    with pytest.raises(ValueError, match="merge = 'eager' is not supported"):
        check_fault_tolerant(cfg, 1)
    SyncConfig(local_sgd_sync_interval=4, overlap_steps=3, fragments=4).resolve()


# ------------------------------------------------------------------ sparse codecs
SPARSE = ["topk2", "topk1"]


@pytest.mark.parametrize("codec", SPARSE)
@pytest.mark.parametrize("n,chunk,k", [(1, 4096, 64), (7, 4, 2), (100, 16, 3), (64, 64, 64),
                                       (5000, 4096, 64), (12_345, 1000, 10)])
def test_sparse_round_trip_and_size(codec, n, chunk, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + chunk)) * 3
    message, decoded = quant.encode(x, codec, chunk, k)
    assert message.dtype == torch.uint8
    assert message.numel() == quant.payload_bytes(n, codec, chunk, k)
    assert torch.equal(quant.decode(message, n, codec, chunk, k), decoded)
    # Only the kept values are non-zero: k per full chunk, in proportion in the last one.
    full, tail = divmod(n, chunk)
    kept = full * min(k, chunk) + (min(tail, -(-k * tail // chunk)) if tail else 0)
    assert int((decoded != 0).sum()) <= kept
    assert sparse.kept_values(n, chunk, k) == kept


@pytest.mark.parametrize("codec", SPARSE)
def test_sparse_codec_matches_the_reference_written_apart(codec):
    """The vectorised codec against tests/reference.py's chunk-by-chunk loops, bitwise, on
    inputs with ties (repeated magnitudes and exact zeros) and a short last chunk."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3 * 128 + 50, generator=g)
    x[10:40] = 0.0
    x[200:260] = torch.tensor([0.5, -0.5] * 30)
    for chunk, k in ((128, 7), (128, 40), (64, 64), (4096, 64)):
        _, decoded = quant.encode(x, codec, chunk, k)
        want = sparse_decoded(x, sparse.BITS[codec], chunk, k)
        assert torch.equal(decoded, want), (codec, chunk, k)


def test_sparse_exact_values():
    x = torch.tensor([0.0, 3.0, -1.0, 2.0, 0.5, -4.0, 0.0, 0.25])
    # one chunk of 8 keeps 4 values: 3, -1, 2, -4; each alone in its group with 2 bits
    _, d2 = quant.encode(x, "topk2", 8, 4)
    assert d2.tolist() == [0.0, 3.0, -1.0, 2.0, 0.0, -4.0, 0.0, 0.0]
    # 1 bit: the lower half (-4, -1) sends its mean -2.5, the upper half (2, 3) 2.5
    _, d1 = quant.encode(x, "topk1", 8, 4)
    assert d1.tolist() == [0.0, 2.5, -2.5, 2.5, 0.0, -2.5, 0.0, 0.0]
    # two chunks of 4 keep 2 each: (3, 2) then (-4, 0.5); 1 bit: each its own group
    _, d = quant.encode(x, "topk1", 4, 2)
    assert d.tolist() == [0.0, 3.0, 0.0, 2.0, 0.5, -4.0, 0.0, 0.0]
    # magnitude ties keep the lower index: 0.5 at 0 and 1 of [0.5, -0.5, 0.5]
    _, d = quant.encode(torch.tensor([0.5, -0.5, 0.5]), "topk2", 3, 2)
    assert d.tolist() == [0.5, -0.5, 0.0]
    # a message of zeros decodes to zeros (an excluded replica's)
    message, d = quant.encode(torch.zeros(300), "topk2", 64, 8)
    assert not d.any() and not quant.decode(message, 300, "topk2", 64, 8).any()


def test_sparse_default_sends_under_a_hundredth_of_fp32():
    n = 1_000_000
    assert quant.payload_bytes(n, "topk2") / (4 * n) <= 1 / 100
    assert quant.payload_bytes(n, "topk1") / (4 * n) <= 1 / 100
    # positions cost 12 bits at chunk 4096: 64 x (12 + 2) bits + 4 fp32 means per chunk
    assert quant.payload_bytes(4096, "topk2") == 64 * 12 // 8 + 64 * 2 // 8 + 16


def test_sparse_codec_keeps_a_nan_visible():
    x = torch.tensor([1.0, float("nan"), -2.0, 0.5] * 4)
    message, decoded = quant.encode(x, "topk2", 4, 2)
    assert decoded.isnan().any()  # not silently dropped
    assert message.numel() == quant.payload_bytes(16, "topk2", 4, 2)


@pytest.mark.parametrize("bits", [1, 2, 3, 7, 12, 13])
def test_pack_bits_round_trip(bits):
    values = torch.randint(0, 2 ** bits, (1001,), generator=torch.Generator().manual_seed(bits))
    packed = sparse.pack_bits(values, bits)
    assert packed.numel() == -(-1001 * bits // 8)
    assert torch.equal(sparse.unpack_bits(packed, 1001, bits), values)


def test_sparse_error_feedback_with_decay_keeps_what_was_not_sent():
    """e <- x - D(C(x)) with x = delta + decay * e: over rounds every value is sent
    eventually; the residual holds exactly what the decoded messages left out."""
    g = torch.Generator().manual_seed(3)
    e = torch.zeros(512)
    sent = torch.zeros(512)
    for _ in range(6):
        delta = torch.randn(512, generator=g)
        x = delta + e * 0.95
        message, decoded = quant.encode(x, "topk2", 128, 8)
        e = x - decoded
        unsent = decoded == 0
        assert torch.equal(e[unsent], x[unsent])  # unsent values stay whole in e
        # two float32 roundings (e = x - decoded, then the sum), on values up to about 4:
        # allclose's default rtol 1e-5 (80 ulps) carries it, the 1e-6 is for zeros
        assert torch.allclose(decoded + e, x, atol=1e-6)
        sent += decoded
    assert int((sent != 0).sum()) > 6 * 4 * 8 * 0.8  # different values each round


def test_sparse_codecs_default_to_plain_outer_sgd():
    """Without outer_optim_kwargs a sparse codec's outer SGD has no momentum (lr 2); given
    ones win; the other codecs keep the method's outer SGD."""
    got = SyncConfig(method="edit", comm_dtype="topk2").resolve().outer_optim_kwargs
    assert got == {"lr": 2.0, "momentum": 0.0, "nesterov": False}
    given = SyncConfig(method="diloco", comm_dtype="topk1",
                       outer_optim_kwargs={"lr": 0.5, "momentum": 0.9, "nesterov": True})
    assert given.resolve().outer_optim_kwargs == {"lr": 0.5, "momentum": 0.9, "nesterov": True}
    assert SyncConfig(method="edit", comm_dtype="int8").resolve().outer_optim_kwargs == {
        "lr": 1.0, "momentum": 0.0, "nesterov": False}
    assert SyncConfig(method="diloco", comm_dtype="int8").resolve().outer_optim_kwargs == {
        "lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert SyncConfig(method="post_local_sgd", comm_dtype="topk2").resolve() \
        .outer_optim_kwargs == {}  # plain averaging: no outer optimizer


def test_sparse_options_are_checked():
    from editrain.errors import ConfigError
    ok = SyncConfig(method="edit", comm_dtype="topk1", topk_chunk=256, topk_k=4,
                    error_decay=0.9)
    assert (ok.sparse_chunk, ok.sparse_k, ok.ef_decay) == (256, 4, 0.9)
    assert SyncConfig(method="edit", comm_dtype="topk2").ef_decay == 0.95
    assert SyncConfig(method="edit", comm_dtype="int8").ef_decay == 1.0
    for kw, words in [
        (dict(topk_k=3), "sync.topk_k: applies to the sparse codecs"),
        (dict(comm_dtype="topk2", topk_chunk=0), "sync.topk_chunk: must be >= 1, got 0"),
        (dict(comm_dtype="topk2", topk_k=65, topk_chunk=64), "must be <= sync.topk_chunk (64)"),
        (dict(comm_dtype="topk2", error_decay=0.0), "sync.error_decay: must be in (0, 1]"),
        (dict(comm_dtype="int8", error_feedback=False, error_decay=0.5),
         "sync.error_decay: decays the error feedback"),
        (dict(error_decay=0.5), "sync.error_decay: decays the error feedback"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            SyncConfig(method="edit", **kw)
