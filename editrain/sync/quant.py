"""Low-precision pseudo-gradients on the wire: per-block quantisers and their byte counts.

A rank's flat fp32 shard ``x`` of a unit is cut into blocks of :data:`BLOCK` consecutive
values; int8 and int4 keep one fp32 scale per block (``s = max|x_b| / qmax``), bf16 needs
none. :func:`encode` packs everything into one ``uint8`` buffer, so one all-gather carries a
replica's whole message on gloo and NCCL alike; :func:`decode` turns it back into fp32.
No arithmetic is done in low precision: the sync sums decoded values in fp32 (see
``docs/streaming.md`` section 4). The sparse codecs ``topk2`` and ``topk1`` live in
:mod:`editrain.sync.sparse`; the functions here dispatch to them (``chunk`` and ``k`` are
theirs).
"""

from __future__ import annotations

import torch

from editrain.sync import sparse

BLOCK = 128
"""Values per scale."""

_QMAX = {"int8": 127, "int4": 7}
_SCALE_BYTES = 4


def payload_bytes(n: int, dtype: str, chunk: int = sparse.CHUNK, k: int = sparse.K) -> int:
    """Bytes of the encoded message of ``n`` values (values plus scales)."""
    if dtype in sparse.BITS:
        return sparse.payload_bytes(n, dtype, chunk, k)
    if dtype == "fp32":
        return 4 * n
    if dtype == "bf16":
        return 2 * n
    blocks = -(-n // BLOCK)
    values = n if dtype == "int8" else -(-n // 2)
    return values + _SCALE_BYTES * blocks


def _scales(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """One fp32 scale per block (padded with zeros to whole blocks); 0 becomes 1."""
    n = x.numel()
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x
    s = padded.view(blocks, BLOCK).abs().amax(dim=1) / float(qmax)
    return torch.where(s == 0, torch.ones_like(s), s)


def quantize(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Integer codes (as float, in [-qmax, qmax]) or bf16 values, and the per-block scales.

    Args:
        x: flat fp32 values.
        dtype: "bf16", "int8" or "int4".
    """
    if dtype == "bf16":
        return x.to(torch.bfloat16), None
    qmax = _QMAX[dtype]
    s = _scales(x, qmax)
    per_value = s.repeat_interleave(BLOCK)[: x.numel()]
    return torch.round(x / per_value).clamp_(-qmax, qmax), s


def dequantize(codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of :func:`quantize`'s output."""
    if scales is None:
        return codes.float()
    return codes * scales.repeat_interleave(BLOCK)[: codes.numel()]


def encode(x: torch.Tensor, dtype: str, chunk: int = sparse.CHUNK, k: int = sparse.K
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The wire message of ``x`` (``uint8``, :func:`payload_bytes` long) and ``D(Q(x))``.

    Args:
        x: flat fp32 values.
        dtype: "bf16", "int8", "int4", "topk2" or "topk1".
        chunk / k: the sparse codecs' values per chunk and values kept per chunk.
    """
    if dtype in sparse.BITS:
        return sparse.encode(x, dtype, chunk, k)
    codes, scales = quantize(x, dtype)
    decoded = dequantize(codes, scales)
    if scales is None:
        return codes.view(torch.uint8).reshape(-1), decoded
    q = codes.to(torch.int8)
    if dtype == "int4":
        if q.numel() % 2:
            q = torch.cat([q, q.new_zeros(1)])
        low, high = (q[0::2] & 0x0F).to(torch.uint8), (q[1::2] & 0x0F).to(torch.uint8)
        values = low | (high << 4)
    else:
        values = q.view(torch.uint8)
    return torch.cat([values, scales.view(torch.uint8)]), decoded


def decode(message: torch.Tensor, n: int, dtype: str, chunk: int = sparse.CHUNK,
           k: int = sparse.K) -> torch.Tensor:
    """fp32 values of a message from :func:`encode` (``n`` values)."""
    if dtype in sparse.BITS:
        return sparse.decode(message, n, dtype, chunk, k)
    if dtype == "bf16":
        return message.view(torch.bfloat16).float()
    blocks = -(-n // BLOCK)
    nvalues = n if dtype == "int8" else -(-n // 2)
    values = message[:nvalues]
    scales = message[nvalues:nvalues + _SCALE_BYTES * blocks].clone().view(torch.float32)
    if dtype == "int4":
        low = (values & 0x0F).to(torch.int8)
        high = (values >> 4).to(torch.int8)
        nibbles = torch.stack([low, high], dim=1).reshape(-1)[:n]
        q = torch.where(nibbles > 7, nibbles - 16, nibbles)  # two's complement of 4 bits
    else:
        q = values.view(torch.int8)
    return dequantize(q.float(), scales)
