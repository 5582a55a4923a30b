"""Sparse low-bit pseudo-gradients: top-k per chunk, quantile codes, packed indices.

The codecs ``topk2`` and ``topk1`` (``sync.comm_dtype``) send a small part of each
pseudo-gradient (``docs/streaming.md`` section 4b). A rank's flat fp32 shard ``x`` is cut
into chunks of ``chunk`` consecutive values (the last one may be shorter). In each chunk of
``L`` values the ``k_c = min(L, ceil(k * L / chunk))`` values of largest magnitude are kept
(ties: the lower index first). The kept values of a chunk, ordered by value (ties: the
lower index first), are cut into ``G = 2 ** bits`` groups of equal count (value ``j`` of
``k_c`` in group ``floor(j * G / k_c)``), and each kept value is sent as its group's code;
the chunk sends its ``G`` group means (fp32). Every other value decodes to 0.

One message is ``uint8``: the kept values' positions in their chunk (``index_bits`` each,
packed), their codes (``bits`` each, packed), then the group means; its length depends on
``len(x)``, ``chunk``, ``k`` and ``bits`` only, so every replica's has the same size and one
all-gather carries them. Nothing is computed in low precision: the decoder writes fp32
means, and the sync sums decoded values in fp32.
"""

from __future__ import annotations

import torch

# The defaults live in a module without torch (the configuration checks read them); they
# stay importable from here, where the codecs that use them are.
from editrain.sync.codecs import BITS, CHUNK, DECAY, OUTER_SGD, K  # noqa: F401


def chunk_sizes(n: int, chunk: int) -> tuple[int, int]:
    """``(full chunks, length of the short last chunk or 0)`` of ``n`` values."""
    return n // chunk, n % chunk


def kept_per_chunk(length: int, chunk: int, k: int) -> int:
    """Values kept in a chunk of ``length`` values (``length == chunk``: ``min(k, chunk)``)."""
    return min(length, -(-k * length // chunk))


def index_bits(n: int, chunk: int) -> int:
    """Bits of a position inside a chunk (a chunk never holds more than ``min(n, chunk)``)."""
    return max(1, (min(n, chunk) - 1).bit_length())


def _rows(n: int, chunk: int, k: int) -> list[tuple[int, int, int]]:
    """``(rows, row length, kept per row)`` for the full chunks and the short one."""
    full, tail = chunk_sizes(n, chunk)
    out = []
    if full:
        out.append((full, chunk, kept_per_chunk(chunk, chunk, k)))
    if tail:
        out.append((1, tail, kept_per_chunk(tail, chunk, k)))
    return out


def kept_values(n: int, chunk: int, k: int) -> int:
    """Values of ``n`` that a message carries."""
    return sum(rows * kept for rows, _, kept in _rows(n, chunk, k))


def payload_bytes(n: int, codec: str, chunk: int = CHUNK, k: int = K) -> int:
    """Bytes of the message of ``n`` values."""
    bits = BITS[codec]
    kept = kept_values(n, chunk, k)
    chunks = -(-n // chunk)
    return (-(-kept * index_bits(n, chunk) // 8) + -(-kept * bits // 8)
            + 4 * chunks * 2 ** bits)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2 ** bits`` packed LSB first into ``uint8``."""
    shifts = torch.arange(bits, device=values.device)
    flat = ((values.long().reshape(-1, 1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % 8)])
    weights = (2 ** torch.arange(8, device=values.device)).to(torch.uint8)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` integers (int64)."""
    shifts = torch.arange(8, device=packed.device)
    flat = ((packed.long().reshape(-1, 1) >> shifts) & 1).reshape(-1)[:count * bits]
    weights = 2 ** torch.arange(bits, device=packed.device)
    return (flat.view(count, bits) * weights).sum(dim=1)


def largest_positions(mag: torch.Tensor, kept: int) -> torch.Tensor:
    """Per row, the positions (ascending) of the ``kept`` largest values; among values
    equal to the smallest one kept, the lowest positions. A threshold from ``topk`` and a
    mask: linear in the row length, unlike a full sort."""
    if kept == mag.shape[1]:
        return torch.arange(kept, device=mag.device).expand(mag.shape[0], kept).contiguous()
    threshold = torch.topk(mag, kept, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    above = mag > threshold
    at = mag == threshold
    room = kept - above.sum(dim=1, keepdim=True)  # ties at the threshold still to keep
    keep = above | (at & (torch.cumsum(at, dim=1) <= room))
    return keep.nonzero()[:, 1].view(mag.shape[0], kept)


def _select(rows: torch.Tensor, kept: int, groups: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the kept positions (ascending), their group codes and the group means."""
    # NaN counts as the largest magnitude (as a descending sort puts it first): a corrupt
    # pseudo-gradient stays visible downstream instead of breaking the selection.
    pos = largest_positions(torch.nan_to_num(rows.abs(), nan=float("inf")), kept)
    vals = torch.gather(rows, 1, pos)
    by_value = torch.sort(vals, dim=1, stable=True).indices
    rank = torch.empty_like(by_value)
    rank.scatter_(1, by_value, torch.arange(kept, device=rows.device).expand_as(by_value))
    codes = rank * groups // kept
    sums = torch.zeros(rows.shape[0], groups, dtype=torch.float32, device=rows.device)
    sums.scatter_add_(1, codes, vals)
    counts = torch.zeros_like(sums).scatter_add_(1, codes, torch.ones_like(vals))
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return pos, codes, means


def encode(x: torch.Tensor, codec: str, chunk: int = CHUNK, k: int = K
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The message of ``x`` (``uint8``, :func:`payload_bytes` long) and its decoded fp32 values.

    Args:
        x: flat fp32 values.
        codec: "topk2" or "topk1".
        chunk / k: values per chunk, values kept per full chunk.
    """
    bits = BITS[codec]
    groups = 2 ** bits
    n = x.numel()
    positions, codes, means = [], [], []
    decoded = torch.zeros_like(x)
    start = 0
    for rows, length, kept in _rows(n, chunk, k):
        block = x[start:start + rows * length].view(rows, length)
        pos, code, mean = _select(block, kept, groups)
        out = decoded[start:start + rows * length].view(rows, length)
        out.scatter_(1, pos, torch.gather(mean, 1, code))
        positions.append(pos.reshape(-1))
        codes.append(code.reshape(-1))
        means.append(mean.reshape(-1))
        start += rows * length
    if not positions:  # an empty shard
        return torch.zeros(0, dtype=torch.uint8, device=x.device), decoded
    message = torch.cat([
        pack_bits(torch.cat(positions), index_bits(n, chunk)),
        pack_bits(torch.cat(codes), bits),
        torch.cat(means).view(torch.uint8),
    ])
    return message, decoded


def decode(message: torch.Tensor, n: int, codec: str, chunk: int = CHUNK, k: int = K
           ) -> torch.Tensor:
    """fp32 values (``n``) of a message from :func:`encode`."""
    bits = BITS[codec]
    groups = 2 ** bits
    out = torch.zeros(n, dtype=torch.float32, device=message.device)
    kept = kept_values(n, chunk, k)
    if not kept:
        return out
    ibits = index_bits(n, chunk)
    index_bytes, code_bytes = -(-kept * ibits // 8), -(-kept * bits // 8)
    pos = unpack_bits(message[:index_bytes], kept, ibits)
    code = unpack_bits(message[index_bytes:index_bytes + code_bytes], kept, bits)
    means = message[index_bytes + code_bytes:].clone().view(torch.float32)
    start = value = row = 0
    for rows, length, kept_row in _rows(n, chunk, k):
        count = rows * kept_row
        p = pos[value:value + count].view(rows, kept_row)
        c = code[value:value + count].view(rows, kept_row)
        m = means[row * groups:(row + rows) * groups].view(rows, groups)
        out[start:start + rows * length].view(rows, length).scatter_(
            1, p, torch.gather(m, 1, c))
        start += rows * length
        value += count
        row += rows
    return out

