"""Issue 49 item 4, the split's cost: what ``editrain data`` computes and keeps per document
to plan the validation split.

The one-permutation MinHash equals its definition written plainly (words by the regular
expression, every 5-gram hashed in Python, bins densified along their probe orders); its
agreement tracks the exact Jaccard similarity; near-duplicates (a few lines changed) are
grouped and unrelated documents are not; the vectorised planner gives the plan of the
plain loop it replaced; the column table keeps what was added; and the metadata kept per
document stays small (tracemalloc), so that it cannot grow back unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import tracemalloc
import zlib

import numpy as np
import pytest

from editrain.data import split as split_mod
from editrain.data.sources import Document
from editrain.data.split import (
    MAX_VAL_SHARE,
    NEAR_DUP_JACCARD,
    DocumentTable,
    _signature,
    _word_pieces,
    describe_documents,
    plan_split,
)

_MASK = (1 << 64) - 1
_MUL = int(split_mod._SHINGLE_MUL)
_MIX = (int(split_mod._MIX1), int(split_mod._MIX2))

# Characters of every class the word rule has to get right: ASCII word and non-word
# characters, letters and digits of other scripts, a combining accent, non-ASCII spaces and
# punctuation, an emoji.
_CHARS = ("abcXYZ019_ \n\t.,;:()[]{}+-*/=<>'\"#@$%^&|~`!?\\"
          "\u00e9\u00df\u0394\u03b1\u4e2d\u6587\u0663\u00b2\u0301\u00a0\u2014\u201c\u3002"
          "\u2028\x85\U0001F600\u00aa\u0131")


def _words_reference(text: str) -> list[bytes]:
    return [w.encode("utf-8") for w in re.findall(r"\w+", text)]


def _fmix(h: int) -> int:
    h ^= h >> 33
    h = (h * _MIX[0]) & _MASK
    h ^= h >> 33
    h = (h * _MIX[1]) & _MASK
    return h ^ (h >> 33)


def _signature_reference(text: str) -> np.ndarray:
    """The signature by its definition, one 5-gram at a time."""
    words = [zlib.crc32(w) for w in _words_reference(text)]
    if len(words) < 5:
        return np.zeros(0, dtype=np.uint32)
    bins: list[int | None] = [None] * 64
    for i in range(len(words) - 4):
        h = 0
        for w in words[i : i + 5]:
            h = (h * _MUL + w) & _MASK
        h = _fmix(h)
        b, v = h >> 58, h >> 32
        bins[b] = v if bins[b] is None else min(bins[b], v)
    filled = list(bins)
    for b in range(64):
        if filled[b] is None:
            source = next(int(p) for p in split_mod._PROBE[b] if bins[int(p)] is not None)
            filled[b] = bins[source]
    return np.array(filled, dtype=np.uint32)


def test_words_equal_the_regular_expression(monkeypatch):
    """Words found by bytes.translate/split (whole texts and pieces cut between words, the
    non-word characters of other scripts replaced one by one or by the regular expression)
    are those of ``re.findall(r"\\w+")``, on ASCII and on mixed text."""
    rng = random.Random(0)
    texts = ["".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 300)))
             for _ in range(300)]
    texts += ["".join(rng.choice("abc _.\n") for _ in range(200)) for _ in range(50)]
    for piece, most in ((1 << 20, 32), (7, 32), (1 << 20, 2)):  # 2: the regex's path
        monkeypatch.setattr(split_mod, "_PIECE", piece)
        monkeypatch.setattr(split_mod, "_MAX_NONWORD_CHARS", most)
        for text in texts:
            got = [w for part in _word_pieces(text, text.encode("utf-8")) for w in part]
            assert got == _words_reference(text), (piece, text)


_TEXTS = [
    "def f(x):\n    return x + 1\n" * 20,  # ASCII, repeated 5-grams
    "caf\u00e9 na\u00efve \u00fcber stra\u00dfe \u0394\u03b5\u03bb\u03c4\u03b1 one two three",
    "x_1 y2 __init__ " * 3 + "\u00e9t\u00e9 " * 4,
    "one two three four five",  # a single 5-gram: every bin densified from one
    " ".join(f"w{i}" for i in range(40)),  # fewer 5-grams than bins
    " ".join(f"w{i % 977}" for i in range(20_000)),  # many 5-grams
]


@pytest.mark.parametrize("text", _TEXTS)
def test_signature_equals_its_definition(text):
    assert np.array_equal(_signature(text), _signature_reference(text))


def test_signature_of_long_text_is_cut_into_pieces_without_change(monkeypatch):
    """5-grams across the cuts between pieces count as in one piece."""
    text = " ".join(f"t{(i * 7919) % 5003}" for i in range(6000))
    whole = _signature(text)
    monkeypatch.setattr(split_mod, "_PIECE", 101)
    assert len(list(_word_pieces(text, text.encode()))) > 100
    assert np.array_equal(_signature(text), whole)
    assert np.array_equal(whole, _signature_reference(text))


def test_short_texts():
    assert len(_signature("a b c d")) == 0  # no 5-gram: no signature
    one = _signature("a b c d e")
    assert len(one) == 64 and len(set(one.tolist())) == 1  # every bin from the only one


def _unique_words(tag: str, n: int) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def _shingles(text: str) -> set[tuple[bytes, ...]]:
    w = _words_reference(text)
    return {tuple(w[i : i + 5]) for i in range(len(w) - 4)}


def test_agreement_tracks_jaccard():
    """Pairs of documents with Jaccard similarities from 0.05 to 0.95, long and short
    (densified): the share of agreeing bins estimates it with the error of 64 samples."""
    rng = random.Random(1)
    errors = []
    for k in range(80):
        n = rng.choice([30, 60, 200, 800])  # words: from half the bins filled to all
        a = _unique_words(f"a{k}x", n)
        b = list(a)
        cut = rng.randint(0, n - 1)
        b[cut:] = _unique_words(f"b{k}x", n - cut)  # a shared prefix, then other words
        ta, tb = " ".join(a), " ".join(b)
        sa, sb = _shingles(ta), _shingles(tb)
        jaccard = len(sa & sb) / len(sa | sb)
        estimate = float(np.mean(_signature(ta) == _signature(tb)))
        errors.append(estimate - jaccard)
    errors = np.array(errors)
    # Standard error of one estimate: sqrt(J (1 - J) / 64) <= 0.0625.
    assert abs(errors.mean()) < 0.03
    assert np.abs(errors).mean() < 0.05
    assert np.abs(errors).max() < 0.2


_CODE_WORDS = ("self return if else for in range def class import from None True False "
               "value result items key data name index count total args kwargs path text "
               "line lines open read write append len print raise error").split()


def _code_file(rng: random.Random, lines: int) -> list[str]:
    out = []
    for _ in range(lines):
        indent = "    " * rng.randint(0, 3)
        out.append(indent + " ".join(rng.choice(_CODE_WORDS) + rng.choice(["", "()", ".x",
                                                                            "[0]", ":"])
                                      for _ in range(rng.randint(3, 10))))
    return out


def _near_duplicate_corpus(changed_lines: int) -> tuple[list[Document], dict[int, int]]:
    """20 files of 60 to 200 lines in families of their own, each followed later by a copy
    with ``changed_lines`` lines rewritten (in another family), and 20 unrelated files;
    returns the documents and, for every copy, the index of its original."""
    rng = random.Random(changed_lines)
    docs: list[Document] = []
    originals = []
    for i in range(20):
        lines = _code_file(rng, rng.randint(60, 200))
        docs.append(Document("\n".join(lines), f"orig{i}.py", f"fam-orig{i}", "code"))
        originals.append(lines)
    for i in range(20):
        docs.append(Document("\n".join(_code_file(rng, rng.randint(60, 200))),
                             f"other{i}.py", f"fam-other{i}", "code"))
    copy_of = {}
    for i, lines in enumerate(originals):
        lines = list(lines)
        for j in rng.sample(range(len(lines)), changed_lines):
            lines[j] = _code_file(rng, 1)[0]
        copy_of[len(docs)] = i
        docs.append(Document("\n".join(lines), f"copy{i}.py", f"fam-copy{i}", "code"))
    return docs, copy_of


@pytest.mark.parametrize("changed_lines", [1, 3, 6])
def test_near_duplicates_grouped_unrelated_not(changed_lines):
    docs, copy_of = _near_duplicate_corpus(changed_lines)
    table = describe_documents(docs)
    keep = np.ones(len(docs), dtype=bool)
    group, merges = split_mod._groups(table, keep)
    for copy, orig in copy_of.items():
        assert group[copy] == group[orig] == orig, (changed_lines, copy)
    # Nothing else merged: each original with its copy, every unrelated file alone.
    assert merges == len(copy_of)
    assert len(set(group.tolist())) == len(docs) - len(copy_of)
    for seed in range(3):  # and the plan keeps each pair on one side
        plan = plan_split(table, 0.2, 0, seed)
        assert plan.mode == "documents" and plan.near_dup_merges == len(copy_of)
        assert all(plan.val[c] == plan.val[o] for c, o in copy_of.items())


def _plan_reference(table: DocumentTable, val_fraction, floor, seed) -> dict:
    """The plan by the plain loops over documents that the vectorised planner replaced."""
    n = len(table)
    sizes = table.nbytes.tolist()
    fams = [table.families[c] for c in table.family_codes.tolist()]
    kinds = [table.kinds[c] for c in table.kind_codes.tolist()]
    digests = [bytes(d) for d in table.digests]
    sigs = table.signature_rows(np.arange(n))
    signed = table.signed.tolist()
    drop, seen = [], set()
    for d in digests:
        drop.append(d in seen)
        seen.add(d)
    keep = [not d for d in drop]
    total = sum(s for s, k in zip(sizes, keep) if k)
    target = min(max(val_fraction * total, float(floor)), MAX_VAL_SHARE * total)
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra == rb:
            return False
        parent[max(ra, rb)] = min(ra, rb)
        return True

    first: dict[str, int] = {}
    for i in range(n):
        if keep[i]:
            union(i, first.setdefault(fams[i], i))
    merges = 0
    for band in range(16):
        buckets: dict[bytes, int] = {}
        for i in range(n):
            if keep[i] and signed[i]:
                j = buckets.setdefault(sigs[i, band * 4 : band * 4 + 4].tobytes(), i)
                if j != i and find(i) != find(j) and (
                        np.mean(sigs[i] == sigs[j]) >= NEAR_DUP_JACCARD):
                    merges += union(i, j)
    group = [find(i) for i in range(n)]
    gids = sorted({group[i] for i in range(n) if keep[i]})
    gbytes = dict.fromkeys(gids, 0)
    gkb: dict[int, dict[str, int]] = {g: {} for g in gids}
    for i in range(n):
        if keep[i]:
            gbytes[group[i]] += sizes[i]
            gkb[group[i]][kinds[i]] = gkb[group[i]].get(kinds[i], 0) + sizes[i]
    gkind = {g: max(sorted(kb), key=kb.get) for g, kb in gkb.items()}
    ktotal: dict[str, int] = {}
    for g in gids:
        ktotal[gkind[g]] = ktotal.get(gkind[g], 0) + gbytes[g]
    order = list(gids)
    np.random.default_rng(seed).shuffle(order)
    chosen, taken = set(), 0.0
    for kind in sorted(ktotal):
        goal, got = target * ktotal[kind] / total, 0
        for g in order:
            if got >= goal:
                break
            if gkind[g] == kind and got + gbytes[g] <= 1.25 * goal:
                chosen.add(g)
                got += gbytes[g]
        taken += got
    for g in order:
        if taken >= target:
            break
        if g not in chosen and taken + gbytes[g] <= 1.25 * target:
            chosen.add(g)
            taken += gbytes[g]
    val = [keep[i] and group[i] in chosen for i in range(n)]
    out = {"groups": len(gids), "merges": merges, "drop": drop}
    if len(gids) < 2 or not any(val) or taken >= total:
        remaining, tail, share = max(1.0, target), n - 1, 1.0
        kept = [i for i in range(n) if keep[i]]
        tail = kept[-1]
        for i in reversed(kept):
            if sizes[i] >= remaining:
                tail, share = i, remaining / max(1, sizes[i])
                break
            remaining -= sizes[i]
        return dict(out, mode="tail", tail=tail, share=1.0 - share,
                    val=[keep[i] and i > tail for i in range(n)])
    stats = {}
    for side, mask in (("train", [keep[i] and not val[i] for i in range(n)]), ("val", val)):
        by: dict[str, dict[str, int]] = {}
        for i in range(n):
            if mask[i]:
                k = by.setdefault(kinds[i], {"documents": 0, "bytes": 0})
                k["documents"] += 1
                k["bytes"] += sizes[i]
        stats[side] = dict(sorted(by.items()))
    return dict(out, mode="documents", val=val, stats=stats)


def _mixed_corpus(seed: int, docs: int) -> list[Document]:
    """Families of varied sizes, two kinds, exact duplicates and near-duplicates across
    families, documents too short for a signature: 75 to 95 groups of 150 documents,
    6 to 18 merges by near-duplicates."""
    rng = random.Random(seed)
    out: list[Document] = []
    for i in range(docs):
        roll = rng.random()
        if out and roll < 0.08:
            text = rng.choice(out).text  # an exact duplicate
        elif out and roll < 0.2:
            lines = rng.choice(out).text.split("\n")
            lines[rng.randrange(len(lines))] = "changed line here now"
            text = "\n".join(lines)  # a near-duplicate
        elif roll < 0.25:
            text = "tiny doc"
        else:
            text = "\n".join(_code_file(rng, rng.randint(2, 60)))
        # Most documents alone, the others in families of very different sizes.
        fam = f"f{min(int(rng.paretovariate(1.0)), 30)}" if rng.random() < 0.3 else f"g{i}"
        out.append(Document(text, f"d{i}", fam, rng.choice(["code", "prose", "prose"])))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_plan_equals_the_plain_loops(seed):
    table = describe_documents(_mixed_corpus(seed, 150))
    for fraction, floor, plan_seed in ((0.1, 0, seed), (0.2, 5000, seed + 1),
                                       (0.01, 10**9, seed)):  # the last one capped
        want = _plan_reference(table, fraction, floor, plan_seed)
        plan = plan_split(table, fraction, floor, plan_seed)
        assert plan.mode == want["mode"]
        assert plan.val.tolist() == want["val"] and plan.drop.tolist() == want["drop"]
        assert (plan.groups, plan.near_dup_merges) == (want["groups"], want["merges"])
        if plan.mode == "tail":
            assert (plan.tail_doc, plan.tail_keep_share) == (want["tail"], want["share"])
        else:
            assert {k: plan.stats[k] for k in ("train", "val")} == want["stats"]
    # One family: a tail split, cut where the reference cuts.
    one = [Document(d.text, d.name, "all", d.kind) for d in _mixed_corpus(seed, 40)]
    table = describe_documents(one)
    plan, want = plan_split(table, 0.1, 0, 0), _plan_reference(table, 0.1, 0, 0)
    assert plan.mode == want["mode"] == "tail"
    assert (plan.tail_doc, plan.tail_keep_share) == (want["tail"], want["share"])
    assert plan.val.tolist() == want["val"]


def test_table_keeps_every_column_across_blocks(monkeypatch):
    monkeypatch.setattr(split_mod, "_BLOCK", 3)
    docs = [Document(f"text {i} " + "w " * (i % 7) + "\u00e9" * (i % 2), f"n\u00e9{i}/\udcff",
                     f"fam{i % 4}", ("code", "prose")[i % 2]) for i in range(10)]
    table = DocumentTable()
    for k, doc in enumerate(docs):
        table.add(doc)
        if k == 4:  # columns read mid-way, then more rows added
            assert table.nbytes.tolist() == [len(d.text.encode()) for d in docs[:5]]
    assert len(table) == 10
    assert table.nbytes.tolist() == [len(d.text.encode()) for d in docs]
    assert [table.listing(i) for i in range(10)] == [[d.name, d.family, d.kind] for d in docs]
    assert [bytes(r) for r in table.digests] == [hashlib.sha1(d.text.encode()).digest()
                                                 for d in docs]
    sigs = [_signature(d.text) for d in docs]
    assert table.signed.tolist() == [len(s) > 0 for s in sigs]
    rows = np.array([9, 0, 4, 4, 7])
    got = table.signature_rows(rows)
    for r, g in zip(rows, got):
        assert np.array_equal(g, sigs[r] if len(sigs[r]) else np.zeros(64, np.uint32))
    assert np.array_equal(table.signature_rows(rows, slice(8, 12)), got[:, 8:12])
    with pytest.raises(IndexError):
        table.signature_rows(np.array([10]))


def _small_documents(n: int):
    rng = random.Random(0)
    words = [f"w{i}" for i in range(500)]
    for i in range(n):
        yield Document(" ".join(rng.choices(words, k=20)),
                       f"dir{i // 50:04d}/file_{i:06d}.py", f"dir{i // 50:04d}",
                       ("code", "prose")[i % 2])


def test_metadata_per_document_stays_small(monkeypatch):
    """The split's metadata of 2,048 small documents (names of 24 characters): what stays
    allocated per document after describing them, and the peak while planning. Measured
    330 and 450 bytes; a list of dataclasses with a signature array each and a list of
    names (before the column table) took 934 and 1,161."""
    monkeypatch.setattr(split_mod, "_BLOCK", 256)  # whole blocks: no unused rows counted
    n = 2048
    # Once untraced: the first plan imports what numpy loads lazily (about 1 MB).
    plan_split(describe_documents(_small_documents(300)), 0.1, 0, 0)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        table = describe_documents(_small_documents(n))
        kept = (tracemalloc.get_traced_memory()[0] - base) / n
        plan = plan_split(table, 0.1, 0, 0)
        peak = (tracemalloc.get_traced_memory()[1] - base) / n
    finally:
        tracemalloc.stop()
    assert plan.mode == "documents" and len(table) == n
    assert kept < 360, f"{kept:.0f} bytes per document kept"
    assert peak < 560, f"{peak:.0f} bytes per document at the peak"


def _one_family_corpus(root):
    """30 files in one directory (one family: a tail split), one an exact duplicate."""
    rng = random.Random(5)
    (root / "x").mkdir(parents=True)
    for i in range(30):
        lines = _code_file(rng, rng.randint(5, 80))
        (root / "x" / f"doc{i:03d}.py").write_text("\n".join(lines) + "\n")
    (root / "x" / "doc999.py").write_text((root / "x" / "doc010.py").read_text())
    return root


def _listing_reference(corpus, plan) -> list[list[str]]:
    """The validation documents by reading every text: those with a validation part."""
    from editrain.data.sources import iter_records, resolve_sources

    return [[d.name, d.family, d.kind]
            for i, d in enumerate(iter_records(resolve_sources(str(corpus))))
            if plan.parts(i, d.text)[1]]


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    from editrain.data.tokenizer import train_bpe_tokenizer

    root = _one_family_corpus(tmp_path_factory.mktemp("tokcorpus"))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    texts = [p.read_text() for p in sorted(root.rglob("*.py"))]
    train_bpe_tokenizer(texts, 300).save(str(path))
    return path


def test_tail_split_reads_the_corpus_once(tmp_path, small_tokenizer, monkeypatch):
    """A tail split with a given tokenizer: the document it cuts is taken from the texts
    kept at the end of the one pass (when the window is too small, read again), and the
    validation list comes from the table: the same token files and list either way, the
    list equal to reading every text."""
    from editrain.data import dataset as dataset_mod
    from editrain.data import prepare_tokens
    from editrain.data.sources import iter_records, resolve_sources

    corpus = _one_family_corpus(tmp_path / "corpus")
    passes = []
    real = dataset_mod.iter_records

    def counting(*args, **kwargs):
        passes.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dataset_mod, "iter_records", counting)
    builds = {}
    for window in ("kept", "too_small"):
        if window == "too_small":
            monkeypatch.setattr(dataset_mod, "_RECENT_MAX_CHARS", 0)
        passes.clear()
        # No token floor: the first plan is the build's.
        data = prepare_tokens(str(corpus), tmp_path / window, tokenizer_path=str(small_tokenizer),
                              val_tokens=0, val_fraction=0.1, progress=False)
        assert data.meta["split"] == "tail"
        assert len(passes) == (1 if window == "kept" else 2)  # the cut document read again
        builds[window] = (np.asarray(data.train).tolist(), np.asarray(data.val).tolist(),
                          (data.cache_dir / "val_documents.json").read_text())
    assert builds["kept"] == builds["too_small"]
    plan = plan_split(describe_documents(iter_records(resolve_sources(str(corpus)))), 0.1, 0, 0)
    assert plan.mode == "tail" and plan.drop.sum() == 1
    listed = json.loads(builds["kept"][2])
    assert listed == _listing_reference(corpus, plan) and len(listed) >= 2
    assert listed[0][0].endswith(f"doc{plan.tail_doc:03d}.py")  # the cut one first


def test_tail_split_with_own_tokenizer_lists_the_cut_document(tmp_path):
    """The same list when the build trains its BPE (the cut document's validation part is
    seen while the validation side is encoded)."""
    from editrain.data import prepare_tokens
    from editrain.data.sources import iter_records, resolve_sources

    corpus = _one_family_corpus(tmp_path / "corpus")
    data = prepare_tokens(str(corpus), tmp_path / "cache", vocab_size=300, val_tokens=0,
                          val_fraction=0.1, progress=False)
    assert data.meta["split"] == "tail"
    plan = plan_split(describe_documents(iter_records(resolve_sources(str(corpus)))), 0.1, 0, 0)
    listed = json.loads((data.cache_dir / "val_documents.json").read_text())
    assert listed == _listing_reference(corpus, plan) and len(listed) >= 2


@pytest.mark.parametrize("n", [1, 2, 8, 32])
def test_window_hashes_equal_their_definition(n):
    """The prefix-sum window hashes equal the polynomial of each window's ids, written
    plainly, for every piece size (pieces shorter and longer than the window)."""
    from editrain.data.overlap import _MUL as mul
    from editrain.data.overlap import iter_window_hashes

    ids = np.random.default_rng(n).integers(0, 65535, 300).astype(np.uint16)
    want = []
    for k in range(len(ids) - n + 1):
        h = 0
        for t in ids[k : k + n].tolist():
            h = (h * int(mul) + t + 1) & _MASK
        want.append(h)
    for chunk in (1, 7, 1000):
        got = np.concatenate(list(iter_window_hashes(ids, n, chunk=chunk))).tolist()
        assert got == want, chunk
    assert list(iter_window_hashes(ids[: n - 1], n)) == []  # shorter than a window
