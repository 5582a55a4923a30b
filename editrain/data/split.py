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
   validation share reaches its part of the target, so validation has the corpus's mix;
   where the groups are coarse and the draw stops short of the floor (a group may
   overshoot its target by a quarter only), the smallest group that completes the floor
   is added (none does: the tail split below).

The target is ``max(val_fraction * corpus, val_bytes_floor)`` bytes, at most
``MAX_VAL_SHARE`` of the corpus. When a corpus has too few groups to split by document (one
big file), its last bytes become validation instead, cut at a line break ("tail" split).

The signature is a one-permutation MinHash: a document's words (runs of ``\\w``
characters, hashed by the crc32 of their UTF-8 bytes) make word 5-grams, each 5-gram is
hashed once to 64 bits, the top 6 bits pick one of the signature's 64 bins and each bin
keeps the smallest hash that falls in it. A bin no 5-gram fell in (a short document) takes
the value of the first filled bin along a fixed random order of the bins of its own
("optimal densification", Shrivastava 2017), so that two documents agree in a bin with
probability equal to the Jaccard similarity of their 5-gram sets, as with 64 independent
hash functions, at the cost of one hash per 5-gram instead of 64. Each bin keeps the top
32 bits of its hash (6 bits of bin, 26 of value): two different minima agree by chance
once in 2**26 comparisons.

Candidate pairs come from 16 bands of 4 bins: two documents are compared when all 4 bins
of some band agree, which happens with probability ``1 - (1 - J**4)**16`` for Jaccard
similarity ``J`` (0.64 at ``J = 0.5``, 0.9998 at ``J = 0.8``), then merged when at least
half of the 64 bins agree. Each document is compared with the first document of its
bucket, per band.

What the split keeps of each document is one row of column arrays
(:class:`DocumentTable`): about 330 bytes per document, its name included, of which the
256 of its signature wait in a file while a build reads the corpus.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .sources import Document

__all__ = [
    "MAX_VAL_SHARE",
    "NEAR_DUP_JACCARD",
    "DocumentTable",
    "SplitPlan",
    "describe_documents",
    "plan_split",
    "plan_splits",
]

NEAR_DUP_JACCARD = 0.5
"""Estimated Jaccard similarity of word 5-gram sets from which two documents are grouped."""

MAX_VAL_SHARE = 0.3
"""Validation never takes more than this share of the corpus's bytes."""

_NUM_BINS = 64  # MinHash signature length (bins of the one permutation)
_BIN_SHIFT = np.uint64(58)  # the top log2(_NUM_BINS) bits of a 5-gram's hash are its bin
_BANDS = 16  # LSH bands of _NUM_BINS // _BANDS bins each
_SHINGLE_WORDS = 5
_NONWORD = re.compile(r"\W+")
# Bytes that are not part of a word become spaces: ASCII letters, digits and "_" are what
# ``\w`` matches among ASCII characters; bytes of non-ASCII characters are kept (text with
# any is first cleared of its non-ASCII non-word characters, so they are all letters).
_ASCII = bytes(range(0x80))
# Text with more distinct non-ASCII non-word characters than this is cleared by _NONWORD
# (one pass of the regular expression) instead of one bytes.replace per character.
_MAX_NONWORD_CHARS = 32
_WORD_BYTES = bytes(c if c >= 0x80 or c == 0x5F or chr(c).isalnum() else 0x20
                    for c in range(256))
_SHINGLE_MUL = np.uint64(0x9E3779B97F4A7C15)
# The two odd multipliers of a 64-bit finaliser (MurmurHash3's fmix64): a bijection that
# makes every bit of a 5-gram's polynomial hash reach the top bits that choose its bin.
_MIX1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX2 = np.uint64(0xC4CEB9FE1A85EC53)
_EMPTY = np.uint64(1 << 32)  # above any bin's value: the bin is still empty
# Densification: the order in which an empty bin looks for a filled one, fixed by a seed
# so that signatures are identical in every process and every run.
_PROBE = np.stack([np.random.default_rng(20261128 + b).permutation(_NUM_BINS)
                   for b in range(_NUM_BINS)])
_PIECE = 1 << 20  # bytes of text split into words at once (bounds memory per document)
_DIGEST = 20  # bytes of a sha1 digest
_BLOCK = 4096  # rows of the column arrays allocated at a time


def _word_pieces(text: str, data: bytes) -> Iterator[list[bytes]]:
    """The words of ``text`` (its UTF-8 bytes ``data``), as lists of their UTF-8 bytes, in
    order, in pieces of about ``_PIECE`` bytes cut between words.

    ``bytes.translate`` and ``bytes.split`` find the words in C without a regular
    expression, the same words as ``re.findall(r"\\w+", text)``: the few non-ASCII
    characters that are not word characters (dashes, quotes, no-break spaces in code and
    English) are replaced by spaces in the bytes first, each with one ``bytes.replace``
    (UTF-8 is self-synchronising: a character's bytes occur only where it does)."""
    buf = data
    if not text.isascii():
        others = set(data.translate(None, _ASCII).decode("utf-8", "surrogatepass"))
        nonword = [c for c in others if not c.isalnum()]  # "_" is ASCII
        if len(nonword) > _MAX_NONWORD_CHARS:
            buf = _NONWORD.sub(" ", text).encode("utf-8", "surrogatepass")
        else:
            for c in nonword:
                buf = buf.replace(c.encode("utf-8", "surrogatepass"), b" ")
    buf = buf.translate(_WORD_BYTES)
    start = 0
    while len(buf) - start > _PIECE:
        cut = buf.rfind(b" ", start, start + _PIECE)
        if cut <= start:  # one word longer than a piece: it ends at the next space
            cut = buf.find(b" ", start + _PIECE)
            if cut < 0:
                break
        yield buf[start:cut].split()
        start = cut
    yield buf[start:].split() if start else buf.split()


def _signature(text: str, data: bytes | None = None) -> np.ndarray:
    """The one-permutation MinHash signature of ``text`` (``uint32[_NUM_BINS]``; see the
    module's docstring), empty for a text of fewer than ``_SHINGLE_WORDS`` words.

    Args:
        text: The document.
        data: ``text`` encoded as UTF-8, when the caller has it already.
    """
    if data is None:
        data = text.encode("utf-8", "surrogatepass")
    sig = np.full(_NUM_BINS, _EMPTY, dtype=np.uint64)
    carry = np.zeros(0, dtype=np.uint64)  # the last words of the previous piece
    for words in _word_pieces(text, data):
        ids = np.fromiter(map(zlib.crc32, words), dtype=np.uint64, count=len(words))
        if len(carry):
            ids = np.concatenate([carry, ids])
        carry = ids[-(_SHINGLE_WORDS - 1):]
        n = len(ids) - _SHINGLE_WORDS + 1
        if n <= 0:
            continue
        with np.errstate(over="ignore"):
            h = ids[:n] * _SHINGLE_MUL  # polynomial hash of each run of 5 word hashes
            for j in range(1, _SHINGLE_WORDS):
                h += ids[j : j + n]
                if j < _SHINGLE_WORDS - 1:
                    h *= _SHINGLE_MUL
            h ^= h >> np.uint64(33)
            h *= _MIX1
            h ^= h >> np.uint64(33)
            h *= _MIX2
            h ^= h >> np.uint64(33)
        # Repeated 5-grams are kept: the minimum over them is the same.
        np.minimum.at(sig, (h >> _BIN_SHIFT).astype(np.intp), h >> np.uint64(32))
    filled = sig < _EMPTY
    if not filled.any():
        return np.zeros(0, dtype=np.uint32)
    empty = np.flatnonzero(~filled)
    if len(empty):
        probes = _PROBE[empty]
        first = np.argmax(filled[probes], axis=1)
        sig[empty] = sig[probes[np.arange(len(empty)), first]]
    return sig.astype(np.uint32)


class _Codes:
    """Strings as small integer codes, in order of first appearance."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._code: dict[str, int] = {}

    def code(self, name: str) -> int:
        c = self._code.get(name)
        if c is None:
            c = self._code[name] = len(self.names)
            self.names.append(name)
        return c


class DocumentTable:
    """What the split needs of every document of a corpus, as column arrays (no text kept).

    Rows are added in corpus order (:meth:`add`) and stored in blocks of ``_BLOCK`` rows,
    so that memory grows by one block at a time and nothing is copied while the corpus is
    read. Per document: its size (8 bytes), family and kind codes (4 + 1), sha1 digest
    (20), MinHash signature (``uint32[64]``, 256 bytes) and name (UTF-8 in one shared
    buffer, plus an 8-byte offset). The small columns are joined into one array each on
    first use; the signatures, most of the table, stay in their blocks and are read by
    rows (:meth:`signature_rows`), so that planning never holds two copies of them.

    Args:
        spill: A file (created, then appended to) that every full block of signatures is
            written to and dropped from memory, read back block by block when rows are
            asked for: a build's table then holds 256 bytes less per document while the
            corpus is read (19 MB for 75k documents). The caller removes it. None: all in
            memory.
    """

    _COLUMNS = {"nbytes": ((), np.int64), "family": ((), np.int32), "kind": ((), np.uint8),
                "signed": ((), np.bool_), "digest": ((_DIGEST,), np.uint8),
                "name_end": ((), np.int64)}

    def __init__(self, spill: Path | None = None) -> None:
        self._families, self._kinds = _Codes(), _Codes()
        self._names = bytearray()
        self._blocks: list[dict[str, np.ndarray]] = []
        # uint32[_BLOCK, _NUM_BINS] each; None: the block is in the spill file, at its index
        self._signatures: list[np.ndarray | None] = []
        self._spill = spill
        if spill is not None:
            spill.write_bytes(b"")
        self._joined: dict[str, np.ndarray] | None = None
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, doc: Document) -> bytes:
        """Describe ``doc`` (one pass over its text) and append its row; return its text's
        sha1 digest (equal digests: exact duplicates)."""
        data = doc.text.encode("utf-8", "surrogatepass")
        sig = _signature(doc.text, data)
        kind = self._kinds.code(doc.kind)
        if kind > 255:  # stored as uint8
            raise ValueError(f"data.path: more than 256 document kinds ({doc.kind!r})")
        r = self._n % _BLOCK
        if r == 0:
            self._blocks.append({k: np.zeros((_BLOCK, *shape), dtype=dtype)
                                 for k, (shape, dtype) in self._COLUMNS.items()})
            self._signatures.append(np.zeros((_BLOCK, _NUM_BINS), dtype=np.uint32))
        block = self._blocks[-1]
        block["nbytes"][r] = len(data)
        block["family"][r] = self._families.code(doc.family)
        block["kind"][r] = kind
        digest = hashlib.sha1(data).digest()
        block["digest"][r] = np.frombuffer(digest, dtype=np.uint8)
        if len(sig):
            block["signed"][r] = True
            self._signatures[-1][r] = sig
        self._names += doc.name.encode("utf-8", "surrogatepass")
        block["name_end"][r] = len(self._names)
        self._n += 1
        self._joined = None
        if self._spill is not None and r == _BLOCK - 1:
            with open(self._spill, "ab") as out:
                self._signatures[-1].tofile(out)
            self._signatures[-1] = None
        return digest

    def _column(self, key: str) -> np.ndarray:
        if self._joined is None:
            store = {k: np.concatenate([b[k] for b in self._blocks]) if self._blocks
                     else np.zeros((0, *shape), dtype=dtype)
                     for k, (shape, dtype) in self._COLUMNS.items()}
            # The blocks become views of the joined columns (one copy in memory), the last
            # one keeping its room for rows added later.
            self._blocks = [{k: v[s : s + _BLOCK] for k, v in store.items()}
                            for s in range(0, len(store["nbytes"]), _BLOCK)]
            self._joined = {k: v[: self._n] for k, v in store.items()}
        return self._joined[key]

    @property
    def nbytes(self) -> np.ndarray:
        """``int64[n]``: UTF-8 size of every document."""
        return self._column("nbytes")

    @property
    def family_codes(self) -> np.ndarray:
        """``int32[n]``: every document's family, an index into :attr:`families`."""
        return self._column("family")

    @property
    def families(self) -> list[str]:
        """The family names, in order of first appearance."""
        return self._families.names

    @property
    def kind_codes(self) -> np.ndarray:
        """``uint8[n]``: every document's kind, an index into :attr:`kinds`."""
        return self._column("kind")

    @property
    def kinds(self) -> list[str]:
        """The kind names (``"code"``, ``"prose"``), in order of first appearance."""
        return self._kinds.names

    @property
    def digests(self) -> np.ndarray:
        """``uint8[n, 20]``: sha1 of every document's UTF-8 text, for exact duplicates."""
        return self._column("digest")

    def signature_rows(self, rows: np.ndarray, bins: slice = slice(None)) -> np.ndarray:
        """``uint32[len(rows), k]``: bins ``bins`` of the MinHash signatures of documents
        ``rows`` (any order, repeats allowed); rows of unsigned documents are zero."""
        rows = np.asarray(rows, dtype=np.int64)
        width = len(range(_NUM_BINS)[bins])
        out = np.empty((len(rows), width), dtype=np.uint32)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        if len(rows) and (ordered[0] < 0 or ordered[-1] >= self._n):
            raise IndexError(f"document index out of range 0..{self._n - 1}")
        # The rows in each block are one run of the sorted rows.
        edges = np.searchsorted(ordered, np.arange(len(self._signatures) + 1) * _BLOCK)
        for k, block in enumerate(self._signatures):
            a, b = int(edges[k]), int(edges[k + 1])
            if a < b:
                if block is None:
                    block = np.fromfile(self._spill, dtype=np.uint32, count=_BLOCK * _NUM_BINS,
                                        offset=k * _BLOCK * _NUM_BINS * 4
                                        ).reshape(_BLOCK, _NUM_BINS)
                out[order[a:b]] = block[ordered[a:b] - k * _BLOCK, bins]
        return out

    @property
    def signed(self) -> np.ndarray:
        """``bool[n]``: the document has a signature (at least one word 5-gram)."""
        return self._column("signed")

    def name(self, i: int) -> str:
        """The name of document ``i``."""
        ends = self._column("name_end")
        start = int(ends[i - 1]) if i else 0
        return self._names[start : int(ends[i])].decode("utf-8", "surrogatepass")

    def listing(self, i: int) -> list[str]:
        """``[name, family, kind]`` of document ``i`` (a line of the validation list)."""
        i = int(i)
        return [self.name(i), self.families[int(self.family_codes[i])],
                self.kinds[int(self.kind_codes[i])]]


def describe_documents(docs: Iterable[Document]) -> DocumentTable:
    """The :class:`DocumentTable` of ``docs`` (one pass over each text)."""
    table = DocumentTable()
    for doc in docs:
        table.add(doc)
    return table


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


# Candidate pairs compared at once: two uint32[_PAIR_CHUNK, _NUM_BINS] of signatures (2 MB
# each); at 2**16 these were 16 MB each, the largest part of planning a 1 GB corpus.
_PAIR_CHUNK = 1 << 13


def _near_duplicate_pairs(table: DocumentTable, rows: np.ndarray, root: np.ndarray
                          ) -> np.ndarray:
    """``int64[m, 2]``: the distinct pairs ``(i, j)`` of documents ``rows`` (in corpus order)
    where ``j`` is the first document of ``i``'s bucket in some band, ``i`` is not in ``j``'s
    family group (``root``) and their signatures agree in at least ``NEAR_DUP_JACCARD`` of
    the bins, sorted by ``i``, then ``j``."""
    width = _NUM_BINS // _BANDS
    # A pair (i, j) is kept as the one integer i * n + j (n documents): in that order the
    # pairs sort by i, then j, and each band's pairs join the distinct ones so far as they
    # come, so that what is held is the distinct pairs, not every band's (a 1 GB corpus
    # of three near-copies of its files: about 900k pairs before their union).
    n = np.int64(max(1, len(table)))
    cand = np.zeros(0, dtype=np.int64)
    for band in range(_BANDS):
        key = table.signature_rows(rows, slice(band * width, (band + 1) * width))
        key = key.view(np.uint64)  # 4 bins of 32 bits: 2 sort keys
        order = np.lexsort(key.T[::-1])  # stable: equal keys stay in corpus order
        ks = key[order]
        new = np.ones(len(order), dtype=bool)
        new[1:] = (ks[1:] != ks[:-1]).any(axis=1)
        first = order[np.flatnonzero(new)[np.cumsum(new) - 1]]  # first row of each bucket
        i, j = rows[order[~new]], rows[first[~new]]
        other = root[i] != root[j]
        cand = np.union1d(cand, i[other] * n + j[other])
    keep = np.zeros(len(cand), dtype=bool)
    need = int(np.ceil(NEAR_DUP_JACCARD * _NUM_BINS - 1e-9))
    for s in range(0, len(cand), _PAIR_CHUNK):
        part = cand[s : s + _PAIR_CHUNK]
        agree = table.signature_rows(part // n) == table.signature_rows(part % n)
        keep[s : s + _PAIR_CHUNK] = agree.sum(axis=1) >= need
    pairs = cand[keep]
    return np.stack([pairs // n, pairs % n], axis=1)


def _groups(table: DocumentTable, keep: np.ndarray) -> tuple[np.ndarray, int]:
    """Group id of every document (the smallest index of its group; families, then
    near-duplicates merged; a dropped document is a group of its own) and the number of
    merges the near-duplicates made."""
    n = len(table)
    root = np.arange(n, dtype=np.int64)
    kept = np.flatnonzero(keep)
    fam = table.family_codes[kept]
    codes, first = np.unique(fam, return_index=True)
    first_of = np.zeros(len(table.families), dtype=np.int64)
    first_of[codes] = kept[first]
    root[kept] = first_of[fam]  # the first kept document of the family
    rows = kept[table.signed[kept]]
    edges = root[_near_duplicate_pairs(table, rows, root)]
    # Union-find over the family groups that near-duplicates join (few), each merged into
    # the smallest, so that a group's id stays the smallest index of its documents.
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent.get(i, i) != i:
            parent[i] = parent.get(parent[i], parent[i])
            i = parent[i]
        return i

    merges = 0
    for a, b in edges.tolist():
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
            merges += 1
    if parent:
        joined = np.array(sorted(parent), dtype=np.int64)
        top = np.array([find(int(g)) for g in joined], dtype=np.int64)
        moved = np.isin(root, joined)
        root[moved] = top[np.searchsorted(joined, root[moved])]
    return root, merges


def _first_copies(digests: np.ndarray) -> np.ndarray:
    """``bool[n]``: the document is the first with its digest."""
    first = np.zeros(len(digests), dtype=bool)
    if len(digests):
        keys = np.ascontiguousarray(digests).view(np.dtype((np.void, _DIGEST))).ravel()
        first[np.unique(keys, return_index=True)[1]] = True
    return first


def plan_split(
    table: DocumentTable, val_fraction: float, val_bytes_floor: int, seed: int
) -> SplitPlan:
    """Decide the validation split of a corpus.

    Args:
        table: The corpus's documents, in order (:func:`describe_documents`).
        val_fraction: Share of the corpus (by bytes) to hold out.
        val_bytes_floor: Hold out at least this many bytes (capped at ``MAX_VAL_SHARE``).
        seed: Seed of the group order; the same inputs always give the same plan.

    Returns:
        The :class:`SplitPlan`.
    """
    return plan_splits(table, val_fraction, [val_bytes_floor], seed)[0]


def plan_splits(table: DocumentTable, val_fraction: float, val_bytes_floors: Iterable[int],
                seed: int) -> list[SplitPlan]:
    """:func:`plan_split` for each of ``val_bytes_floors``, the corpus's groups (exact
    duplicates, families, near-duplicate merges: the costly part, the same for every floor)
    found once."""
    grouping = _Grouping(table, seed)
    return [grouping.plan(val_fraction, floor) for floor in val_bytes_floors]


class _Grouping:
    """The groups of a corpus's documents, their kinds and sizes, and their seeded order:
    what :func:`plan_split` draws from, whatever the target."""

    def __init__(self, table: DocumentTable, seed: int) -> None:
        self.table = table
        sizes = table.nbytes
        self.keep = _first_copies(table.digests)
        self.total = int(sizes[self.keep].sum())
        group_of, self.merges = _groups(table, self.keep)
        self.kept = np.flatnonzero(self.keep)
        group_ids, self.dense = np.unique(group_of[self.kept], return_inverse=True)
        self.num_groups = len(group_ids)
        # Kinds ranked by name: a group's kind is the kind of most of its bytes, the first
        # by name among equals.
        kind_names = sorted(table.kinds)
        rank = np.array([kind_names.index(k) for k in table.kinds], dtype=np.int64)
        by_kind = np.zeros((len(group_ids), max(1, len(kind_names))), dtype=np.int64)
        seen = np.zeros_like(by_kind, dtype=bool)
        kind_rank = (rank[table.kind_codes[self.kept]] if len(self.kept)
                     else np.zeros(0, np.int64))
        np.add.at(by_kind, (self.dense, kind_rank), sizes[self.kept])
        seen[self.dense, kind_rank] = True
        self.group_bytes = by_kind.sum(axis=1).tolist()
        self.group_kind = np.argmax(np.where(seen, by_kind, -1), axis=1).tolist()
        self.kind_total: dict[int, int] = {}
        for g, k in enumerate(self.group_kind):
            self.kind_total[k] = self.kind_total.get(k, 0) + self.group_bytes[g]
        self.order = list(range(len(group_ids)))  # dense ids follow the group ids' order
        np.random.default_rng(seed).shuffle(self.order)

    def plan(self, val_fraction: float, val_bytes_floor: int) -> SplitPlan:
        """The split for one target (see :func:`plan_split`)."""
        table, sizes, total = self.table, self.table.nbytes, self.total
        group_bytes, group_kind, order = self.group_bytes, self.group_kind, self.order
        drop = ~self.keep
        target = min(max(val_fraction * total, float(val_bytes_floor)), MAX_VAL_SHARE * total)
        chosen = np.zeros(self.num_groups, dtype=bool)
        taken = 0.0
        slack = 1.25  # a group may overshoot its kind's target by this factor
        for kind in sorted(self.kind_total):
            goal = target * self.kind_total[kind] / total
            got = 0
            for g in order:
                if got >= goal:
                    break
                if group_kind[g] == kind and got + group_bytes[g] <= slack * goal:
                    chosen[g] = True
                    got += group_bytes[g]
            taken += got
        for g in order:  # top up from any kind when big families left a kind short
            if taken >= target:
                break
            if not chosen[g] and taken + group_bytes[g] <= slack * target:
                chosen[g] = True
                taken += group_bytes[g]
        capped = target >= MAX_VAL_SHARE * total
        # The floor (``data.val_tokens``) is a floor, the share a share: a draw below a
        # floor under the cap is completed by one more group, or it is the corpus's last
        # bytes.
        short = taken < val_bytes_floor < MAX_VAL_SHARE * total
        if short and chosen.any():
            taken += self._complete(chosen, taken, val_bytes_floor)
            short = taken < val_bytes_floor

        val = np.zeros(len(table), dtype=bool)
        val[self.kept] = chosen[self.dense]
        if self.num_groups < 2 or not val.any() or short or taken >= total:
            return _tail_plan(table, sizes, drop, target, self.num_groups, self.merges)
        plan = SplitPlan("documents", val, drop, groups=self.num_groups,
                         near_dup_merges=self.merges)
        plan.stats = _stats(table, val, drop)
        plan.stats.update(target_bytes=int(target), val_bytes=int(sizes[val].sum()),
                          capped=bool(capped))
        return plan

    def _complete(self, chosen: np.ndarray, taken: float, floor: float) -> int:
        """Add to ``chosen`` the group that brings ``taken`` bytes up to ``floor``: the
        smallest that does (the first in the seeded order among equals) and keeps validation
        within ``MAX_VAL_SHARE``; return its bytes (0, ``chosen`` unchanged: none does).

        The draw lets a group overshoot its target by a quarter at most, so that validation
        stays near the target; where the groups are coarse (a directory, a package,
        ``HF_FAMILY_ROWS`` rows of a dataset) every group left may overshoot by more, and
        the split stayed below its floor (``data.val_tokens``) however often it was planned
        again."""
        cap = MAX_VAL_SHARE * self.total
        order = np.asarray(self.order, dtype=np.int64)
        sizes = np.asarray(self.group_bytes, dtype=np.int64)[order]  # in the seeded order
        fits = ~chosen[order] & (taken + sizes >= floor) & (taken + sizes <= cap)
        if not fits.any():
            return 0
        at = np.flatnonzero(fits)
        best = int(order[at[np.argmin(sizes[at])]])  # argmin: the first of equal sizes
        chosen[best] = True
        return self.group_bytes[best]


def _tail_plan(table, sizes, drop, target, groups, merges) -> SplitPlan:
    # The last ``target`` bytes of the kept text; the document where that begins is cut
    # (at a line break, by the caller, see tail_offset) unless the cut falls between docs.
    kept = np.flatnonzero(~drop)
    remaining = max(1.0, target)
    tail_doc, share = int(kept[-1]), 1.0
    # From the last document back: the first one whose bytes, with all after it, reach
    # the target is where validation begins.
    after = np.concatenate([np.cumsum(sizes[kept][::-1])[::-1][1:], [0]])
    reach = np.flatnonzero(sizes[kept] >= remaining - after)
    if len(reach):
        tail_doc = int(kept[reach[-1]])
        share = (remaining - int(after[reach[-1]])) / max(1, int(sizes[tail_doc]))
    val = np.zeros(len(table), dtype=bool)
    val[kept[kept > tail_doc]] = True
    plan = SplitPlan("tail", val, drop, tail_doc=tail_doc, tail_keep_share=1.0 - share,
                     groups=groups, near_dup_merges=merges)
    val_bytes = int(sizes[val].sum() + share * sizes[tail_doc])
    plan.stats = {"duplicates_dropped": int(drop.sum()), "target_bytes": int(target),
                  "val_bytes": val_bytes,
                  "capped": bool(target >= MAX_VAL_SHARE * sizes[~drop].sum())}
    return plan


def _stats(table: DocumentTable, val: np.ndarray, drop: np.ndarray) -> dict:
    out: dict = {"duplicates_dropped": int(drop.sum())}
    kinds = len(table.kinds)
    for side, mask in (("train", ~val & ~drop), ("val", val)):
        codes = table.kind_codes[mask]
        docs = np.bincount(codes, minlength=kinds)
        nbytes = np.zeros(kinds, dtype=np.int64)
        np.add.at(nbytes, codes, table.nbytes[mask])
        out[side] = {table.kinds[k]: {"documents": int(docs[k]), "bytes": int(nbytes[k])}
                     for k in sorted(np.flatnonzero(docs).tolist(),
                                     key=table.kinds.__getitem__)}
    return out
