"""The held-out validation split: which documents are validation, decided before tokenising.

A validation loss means something only if the validation text is not in the training text.
Whole documents are held out, and documents that are likely to share text are kept on one
side together:

1. exact duplicates are dropped (the first copy stays);
2. documents of one *family* (a stdlib package, a directory; see
   :class:`editrain.data.sources.Document`) form a group;
3. groups holding near-duplicates are merged: MinHash signatures over word 5-grams, banded
   locality-sensitive hashing for candidate pairs, and a pair counts when its estimated
   Jaccard similarity reaches ``NEAR_DUP_JACCARD``;
4. groups are drawn in a seeded random order, per kind (code, prose), until each kind's
   validation share reaches its part of the target, so validation has the corpus's mix.

The target is ``max(val_fraction * corpus, val_bytes_floor)`` bytes, at most
``MAX_VAL_SHARE`` of the corpus. When a corpus has too few groups to split by document (one
big file), its last bytes become validation instead, cut at a line break ("tail" split).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass, field

import numpy as np

from .sources import Document

__all__ = [
    "MAX_VAL_SHARE",
    "NEAR_DUP_JACCARD",
    "DocumentInfo",
    "SplitPlan",
    "describe_document",
    "plan_split",
]

NEAR_DUP_JACCARD = 0.5
"""Estimated Jaccard similarity of word 5-gram sets from which two documents are grouped."""

MAX_VAL_SHARE = 0.3
"""Validation never takes more than this share of the corpus's bytes."""

_NUM_HASHES = 64  # MinHash signature length
_BANDS = 16  # LSH bands of _NUM_HASHES // _BANDS rows each
_SHINGLE_WORDS = 5
_WORD = re.compile(r"\w+")
_WORD_ASCII = re.compile(rb"\w+")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
# Fixed multipliers/offsets of the hash family, from a fixed seed: signatures must be
# identical in every process and every run.
_RNG = np.random.default_rng(20241209)
_HASH_A = (_RNG.integers(1, 2**63, size=_NUM_HASHES, dtype=np.uint64) * np.uint64(2) + np.uint64(1))
_HASH_B = _RNG.integers(0, 2**63, size=_NUM_HASHES, dtype=np.uint64)
_SHINGLE_MUL = np.uint64(0x9E3779B97F4A7C15)
_CHUNK = 1 << 14  # shingles hashed at once (bounds memory to _NUM_HASHES x _CHUNK words)


@dataclass(frozen=True)
class DocumentInfo:
    """What the split needs of one document (the text itself is not kept).

    Args:
        nbytes: UTF-8 size of the document.
        family: The document's family (see :class:`~editrain.data.sources.Document`).
        kind: ``"code"`` or ``"prose"``.
        digest: sha1 of the text, for exact duplicates.
        signature: MinHash signature (``uint64[_NUM_HASHES]``), empty for documents too
            short to have a word 5-gram.
    """

    nbytes: int
    family: str
    kind: str
    digest: bytes
    signature: np.ndarray


def _word_hashes(text: str) -> np.ndarray:
    """crc32 of the UTF-8 bytes of every word of ``text``, in order.

    Each distinct word is hashed once and the words are mapped through that table by
    ``map`` (no Python frame per word); ASCII text, most of a code corpus, is matched as
    bytes, where ``\\w`` means the same as in the text and no word needs encoding."""
    if text.isascii():
        words = _WORD_ASCII.findall(text.encode("ascii"))
        table = {w: zlib.crc32(w) for w in set(words)}
    else:
        words = _WORD.findall(text)
        table = {w: zlib.crc32(w.encode("utf-8")) for w in set(words)}
    return np.fromiter(map(table.__getitem__, words), dtype=np.uint64, count=len(words))


def _signature(text: str) -> np.ndarray:
    ids = _word_hashes(text)
    if len(ids) < _SHINGLE_WORDS:
        return np.zeros(0, dtype=np.uint64)
    n = len(ids) - _SHINGLE_WORDS + 1
    with np.errstate(over="ignore"):
        shingles = np.zeros(n, dtype=np.uint64)
        for j in range(_SHINGLE_WORDS):  # polynomial hash of each run of 5 word hashes
            shingles = shingles * _SHINGLE_MUL + ids[j : j + n]
        # Repeated shingles are kept: the minimum over them is the same, and numpy's unique
        # (hash-based for integers) cost more than hashing the repeats.
        sig = np.full(_NUM_HASHES, _MASK64, dtype=np.uint64)
        for s in range(0, len(shingles), _CHUNK):
            part = shingles[s : s + _CHUNK]
            # Multiply-add modulo 2**64, one row per hash function of the family.
            hashed = part[None, :] * _HASH_A[:, None] + _HASH_B[:, None]
            np.minimum(sig, hashed.min(axis=1), out=sig)
    return sig


def describe_document(doc: Document) -> DocumentInfo:
    """The :class:`DocumentInfo` of ``doc`` (one pass over its text)."""
    data = doc.text.encode("utf-8")
    return DocumentInfo(len(data), doc.family, doc.kind, hashlib.sha1(data).digest(),
                        _signature(doc.text))


@dataclass
class SplitPlan:
    """Where each document goes.

    Args:
        mode: ``"documents"`` (whole documents held out) or ``"tail"`` (the corpus's last
            bytes, for corpora with too few groups).
        val: ``bool[n]``, documents held out (documents mode).
        drop: ``bool[n]``, exact duplicates left out of both splits.
        tail_doc: tail mode: index of the document where validation begins; the part
            of it before the cut (see :meth:`cut`) stays in training.
        tail_keep_share: tail mode: share of ``tail_doc``'s bytes kept in training.
        groups: number of groups after merging families and near-duplicates.
        near_dup_merges: groups merged because of near-duplicate pairs.
        stats: bytes and documents per split and kind, for ``meta.json``.
    """

    mode: str
    val: np.ndarray
    drop: np.ndarray
    tail_doc: int = -1
    tail_keep_share: float = 0.0
    groups: int = 0
    near_dup_merges: int = 0
    stats: dict = field(default_factory=dict)

    def parts(self, index: int, text: str) -> tuple[str, str]:
        """``(training part, validation part)`` of document ``index``: one of them is empty
        except for the document where a tail split cuts (at a line break when it can)."""
        if self.drop[index]:
            return "", ""
        if self.mode != "tail" or index != self.tail_doc:
            return ("", text) if self.val[index] else (text, "")
        cut = int(len(text) * self.tail_keep_share)
        newline = text.rfind("\n", 0, cut)
        cut = newline + 1 if newline > 0 else cut
        return text[:cut], text[cut:]


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        self.parent[max(ra, rb)] = min(ra, rb)
        return True


def _groups(infos: list[DocumentInfo], keep: np.ndarray) -> tuple[np.ndarray, int]:
    """Group id of every kept document (families, then near-duplicates merged)."""
    n = len(infos)
    uf = _UnionFind(n)
    first_of_family: dict[str, int] = {}
    for i, info in enumerate(infos):
        if keep[i]:
            uf.union(i, first_of_family.setdefault(info.family, i))
    merges = 0
    rows = _NUM_HASHES // _BANDS
    for band in range(_BANDS):
        buckets: dict[bytes, int] = {}
        for i, info in enumerate(infos):
            if not keep[i] or len(info.signature) == 0:
                continue
            key = info.signature[band * rows : (band + 1) * rows].tobytes()
            j = buckets.setdefault(key, i)
            if j != i and uf.find(i) != uf.find(j):
                similarity = float(np.mean(info.signature == infos[j].signature))
                if similarity >= NEAR_DUP_JACCARD:
                    merges += uf.union(i, j)
    return np.array([uf.find(i) for i in range(n)], dtype=np.int64), merges


def plan_split(
    infos: list[DocumentInfo], val_fraction: float, val_bytes_floor: int, seed: int
) -> SplitPlan:
    """Decide the validation split of a corpus.

    Args:
        infos: One :class:`DocumentInfo` per document, in corpus order.
        val_fraction: Share of the corpus (by bytes) to hold out.
        val_bytes_floor: Hold out at least this many bytes (capped at ``MAX_VAL_SHARE``).
        seed: Seed of the group order; the same inputs always give the same plan.

    Returns:
        The :class:`SplitPlan`.
    """
    n = len(infos)
    sizes = np.array([i.nbytes for i in infos], dtype=np.int64)
    drop = np.zeros(n, dtype=bool)
    seen: set[bytes] = set()
    for i, info in enumerate(infos):
        drop[i] = info.digest in seen
        seen.add(info.digest)
    keep = ~drop
    total = int(sizes[keep].sum())
    target = min(max(val_fraction * total, float(val_bytes_floor)), MAX_VAL_SHARE * total)

    group_of, merges = _groups(infos, keep)
    group_ids = sorted({int(g) for g in group_of[keep]})
    group_bytes = {g: 0 for g in group_ids}
    group_kind_bytes: dict[int, dict[str, int]] = {g: {} for g in group_ids}
    for i in np.flatnonzero(keep):
        g, info = int(group_of[i]), infos[i]
        group_bytes[g] += info.nbytes
        group_kind_bytes[g][info.kind] = group_kind_bytes[g].get(info.kind, 0) + info.nbytes
    # A group's kind is the kind of most of its bytes.
    group_kind = {g: max(sorted(kb), key=kb.get) for g, kb in group_kind_bytes.items()}
    kind_total: dict[str, int] = {}
    for g in group_ids:
        kind_total[group_kind[g]] = kind_total.get(group_kind[g], 0) + group_bytes[g]

    order = list(group_ids)
    np.random.default_rng(seed).shuffle(order)
    chosen: set[int] = set()
    taken = 0.0
    slack = 1.25  # a group may overshoot its kind's target by this factor
    for kind in sorted(kind_total):
        goal = target * kind_total[kind] / total
        got = 0
        for g in order:
            if got >= goal:
                break
            if group_kind[g] == kind and got + group_bytes[g] <= slack * goal:
                chosen.add(g)
                got += group_bytes[g]
        taken += got
    for g in order:  # top up from any kind when big families left a kind short
        if taken >= target:
            break
        if g not in chosen and taken + group_bytes[g] <= slack * target:
            chosen.add(g)
            taken += group_bytes[g]

    val = np.array([keep[i] and int(group_of[i]) in chosen for i in range(n)], dtype=bool)
    if len(group_ids) < 2 or not val.any() or taken >= total:
        return _tail_plan(infos, sizes, drop, target, len(group_ids), merges)
    plan = SplitPlan("documents", val, drop, groups=len(group_ids), near_dup_merges=merges)
    plan.stats = _stats(infos, val, drop)
    plan.stats.update(target_bytes=int(target), val_bytes=int(sizes[val].sum()),
                      capped=bool(target >= MAX_VAL_SHARE * total))
    return plan


def _tail_plan(infos, sizes, drop, target, groups, merges) -> SplitPlan:
    # The last ``target`` bytes of the kept text; the document where that begins is cut
    # (at a line break, by the caller, see tail_offset) unless the cut falls between docs.
    kept = np.flatnonzero(~drop)
    remaining = max(1.0, target)
    tail_doc, share = int(kept[-1]), 1.0
    for i in reversed(kept):
        if sizes[i] >= remaining:
            tail_doc, share = int(i), remaining / max(1, sizes[i])
            break
        remaining -= sizes[i]
    val = np.zeros(len(infos), dtype=bool)
    val[kept[kept > tail_doc]] = True
    plan = SplitPlan("tail", val, drop, tail_doc=tail_doc, tail_keep_share=1.0 - share,
                     groups=groups, near_dup_merges=merges)
    val_bytes = int(sizes[val].sum() + share * sizes[tail_doc])
    plan.stats = {"duplicates_dropped": int(drop.sum()), "target_bytes": int(target),
                  "val_bytes": val_bytes,
                  "capped": bool(target >= MAX_VAL_SHARE * sizes[~drop].sum())}
    return plan


def _stats(infos: list[DocumentInfo], val: np.ndarray, drop: np.ndarray) -> dict:
    out: dict = {"duplicates_dropped": int(drop.sum())}
    for side, mask in (("train", ~val & ~drop), ("val", val)):
        by_kind: dict[str, dict[str, int]] = {}
        for i in np.flatnonzero(mask):
            k = by_kind.setdefault(infos[i].kind, {"documents": 0, "bytes": 0})
            k["documents"] += 1
            k["bytes"] += infos[i].nbytes
        out[side] = dict(sorted(by_kind.items()))
    return out
