"""The wire format of quantised pseudo-gradients (editrain.sync.quant)."""

from __future__ import annotations

import pytest
import torch

from editrain.sync import quant
from editrain.sync.config import SyncConfig


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
    with pytest.raises(ValueError, match="the merge is 'keep_local'"):
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
    SyncConfig(local_sgd_sync_interval=4, overlap_steps=3, fragments=4).resolve()
