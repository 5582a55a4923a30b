"""Issue 49 item 4, throughput: a build with a given tokenizer reads and encodes the corpus
once (describing each document on the way), plans the split from the documents' token
counts and copies each side out of the encoded corpus.

The tests compare the build's token files with a reference written independently (every
document, or part of a cut document, encoded on its own with the separator the policy
places), for document and tail splits, every EOS policy and a re-planned split; the
encoder thread's failures reach the caller; the faster overlap measure gives the value of its
plain definition (the MinHash signature's own: tests/test_data_split_cost.py).
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from editrain.data import dataset as dataset_mod
from editrain.data import prepare_tokens
from editrain.data.dataset import _BYTES_PER_TOKEN_GUESS
from editrain.data.overlap import window_hashes, window_overlap
from editrain.data.sources import iter_records, resolve_sources
from editrain.data.split import describe_documents, plan_split
from editrain.data.tokenizer import load_tokenizer, train_bpe_tokenizer

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega caf\u00e9 \u00fcber na\u00efve").split()


def _text(rng: random.Random, lines: int) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                     for _ in range(lines)) + "\n"


def _families(root: Path) -> Path:
    """Many families (sub-directories) and one exact duplicate: a documents split."""
    rng = random.Random(0)
    for i in range(60):
        path = root / f"fam{i % 12:02d}" / f"doc{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_text(rng, rng.randint(5, 40)))
    (root / "fam00" / "copy.txt").write_text((root / "fam03" / "doc003.txt").read_text())
    return root


def _one_family(root: Path) -> Path:
    """Every file in one directory (one family): a tail split cuts a document in two."""
    rng = random.Random(2)
    (root / "x").mkdir(parents=True)
    for i in range(30):
        (root / "x" / f"doc{i:03d}.txt").write_text(_text(rng, rng.randint(5, 120)))
    return root


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A small byte-level BPE learnt from the documents of :func:`_families`."""
    texts = [p.read_text() for p in sorted(_families(tmp_path_factory.mktemp("t")).rglob("*"))
             if p.is_file()]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(texts, 300).save(str(path))
    return path


def _reference(corpus: Path, tokenizer: Path, eos_policy: str, plan) -> dict[str, list[int]]:
    """Each side's tokens written one document (or document part) at a time."""
    tok = load_tokenizer(tokenizer)
    tok.encode_special_tokens = True
    eos = tok.token_to_id("<|endoftext|>")
    out: dict[str, list[int]] = {"train": [], "val": []}
    for i, doc in enumerate(iter_records(resolve_sources(str(corpus)))):
        for side, text in zip(("train", "val"), plan.parts(i, doc.text)):
            if text:
                ids = tok.encode(text).ids
                out[side] += ([eos] if eos_policy == "prepend" else []) + ids + (
                    [eos] if eos_policy == "append" else [])
    return out


@pytest.mark.parametrize("layout", ["families", "one_family"])
@pytest.mark.parametrize("eos_policy", ["append", "prepend", "none"])
def test_one_pass_build_equals_per_document_reference(tmp_path, tokenizer, monkeypatch,
                                                      layout, eos_policy):
    """Small encoder batches (several flushes, documents cut across batches) and both kinds
    of split: the token files equal encoding each part on its own, in corpus order."""
    corpus = (_families if layout == "families" else _one_family)(tmp_path / "corpus")
    monkeypatch.setattr(dataset_mod, "_ENCODE_BATCH_CHARS", 500)
    monkeypatch.setattr(dataset_mod, "_MAX_PIECE_CHARS", 200000)
    data = prepare_tokens(str(corpus), tmp_path / "cache", tokenizer_path=str(tokenizer),
                          val_tokens=50, val_fraction=0.1, eos=eos_policy, progress=False)
    assert data.meta["split"] == ("documents" if layout == "families" else "tail")
    infos = describe_documents(iter_records(resolve_sources(str(corpus))))
    # val_tokens is low enough that the first plan is the build's (no re-plan).
    plan = plan_split(infos, 0.1, int(50 * _BYTES_PER_TOKEN_GUESS), 0)
    want = _reference(corpus, tokenizer, eos_policy, plan)
    assert np.asarray(data.train).tolist() == want["train"]
    assert np.asarray(data.val).tolist() == want["val"]
    assert data.meta["train_tokens"] == len(want["train"])
    if layout == "families":  # the exact duplicate is in neither side
        assert plan.drop.sum() == 1
    assert not list((data.cache_dir).glob("*.tmp.*"))  # scratch files removed


def test_replanned_split_counts_tokens_without_encoding_again(tmp_path, tokenizer,
                                                              monkeypatch):
    """A validation floor the byte guess misses: the split is planned again from the token
    counts of the one pass (the corpus is encoded once) and the floor is met."""
    corpus = _families(tmp_path / "corpus")
    batches: list[int] = []
    real = dataset_mod._DocumentEncoder._flush

    def counting_flush(self):
        batches.append(len(self._batch))
        real(self)

    monkeypatch.setattr(dataset_mod._DocumentEncoder, "_flush", counting_flush)
    monkeypatch.setattr(dataset_mod, "_BYTES_PER_TOKEN_GUESS", 0.5)  # far too few bytes
    data = prepare_tokens(str(corpus), tmp_path / "cache", tokenizer_path=str(tokenizer),
                          val_tokens=3000, val_fraction=0.05, progress=False)
    assert data.meta["split"] == "documents"
    # Every document once, into one encoder; the exact duplicate never (every split drops it).
    assert sum(batches) == 60
    # The first plan (0.5 bytes a token) held out fewer tokens than the build did.
    first = plan_split(describe_documents(iter_records(resolve_sources(str(corpus)))),
                       0.05, int(3000 * 0.5), 0)
    assert len(data.val) > len(_reference(corpus, tokenizer, "append", first)["val"])
    listed = {name for name, _, _ in
              json.loads((data.cache_dir / "val_documents.json").read_text())}
    tok = load_tokenizer(tokenizer)
    tok.encode_special_tokens = True
    want = {"train": [], "val": []}
    seen: set[str] = set()
    for doc in iter_records(resolve_sources(str(corpus))):
        if doc.text in seen:
            continue  # the exact duplicate
        seen.add(doc.text)
        side = "val" if doc.name in listed else "train"
        want[side] += tok.encode(doc.text).ids + [data.eos_id]
    assert np.asarray(data.train).tolist() == want["train"]
    assert np.asarray(data.val).tolist() == want["val"]


class _FailingTokenizer:
    """Encodes one batch, then raises: the error must reach the build, not hang it."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text, add_special_tokens=True):
        return type("E", (), {"ids": [1] * len(text)})()

    def encode_batch_fast(self, texts, add_special_tokens=True):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("encoder broke")
        return [type("E", (), {"ids": [1] * len(t)})() for t in texts]


def test_encoder_thread_error_reaches_the_caller(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset_mod, "_ENCODE_BATCH_CHARS", 10)
    with open(tmp_path / "out.bin", "wb") as out:
        encoder = dataset_mod._DocumentEncoder(_FailingTokenizer(), 0, "append",
                                               np.dtype(np.uint16), out)
        with pytest.raises(RuntimeError, match="encoder broke"):
            for _ in range(1000):  # more batches than the queue holds
                encoder.add("x" * 20)
            encoder.close()


def test_encoder_counts_each_document_across_batches(tmp_path, monkeypatch):
    """A document longer than a batch, and batches holding several documents: each
    document's count is its ids plus its separator, and they sum to the file's size."""
    monkeypatch.setattr(dataset_mod, "_ENCODE_BATCH_CHARS", 50)
    monkeypatch.setattr(dataset_mod, "_MAX_PIECE_CHARS", 30)
    texts = ["a" * 7, "b\n" * 40, "c" * 3, "d" * 120]

    class _PerChar:
        def encode(self, text, add_special_tokens=True):
            return type("E", (), {"ids": [5] * len(text)})()

        def encode_batch_fast(self, batch, add_special_tokens=True):
            return [type("E", (), {"ids": [5] * len(t)})() for t in batch]

    for policy, extra in (("append", 1), ("prepend", 1), ("none", 0)):
        with open(tmp_path / "out.bin", "wb") as out:
            encoder = dataset_mod._DocumentEncoder(_PerChar(), 9, policy, np.dtype(np.uint16),
                                                   out)
            for t in texts:
                encoder.add(t)
            counts = encoder.close()
        assert counts.tolist() == [len(t) + extra for t in texts]
        ids = np.fromfile(tmp_path / "out.bin", dtype=np.uint16)
        assert len(ids) == counts.sum() and (ids == 9).sum() == extra * len(texts)


def _templated(single: str):
    """A Llama 2 style tokenizer: words, and a post-processor that puts ``<s>`` (id 1) and
    maybe ``</s>`` (id 2) around every text it encodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": 3 + i for i in range(50)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok


@pytest.mark.parametrize("single", ["<s> $A", "<s> $A </s>"])
def test_a_tokenizer_template_goes_once_around_each_document(tmp_path, monkeypatch, single):
    """A document longer than a piece is encoded in pieces: its tokenizer's template (BOS,
    maybe EOS) goes before its first piece and after its last only, and the end-of-text
    separator is not doubled where the template ends with it; in the encoder thread and in
    the encoder processes alike. Each piece began with <s> (9 in 3 documents of about 173
    KB), and a template ending with </s> gave </s></s>."""
    from editrain.data.encode_worker import BEGINS, ENDS, edges, encode_batch, template_ids

    monkeypatch.setattr(dataset_mod, "_ENCODE_BATCH_CHARS", 40)
    monkeypatch.setattr(dataset_mod, "_MAX_PIECE_CHARS", 30)
    tok = _templated(single)
    assert template_ids(tok) == ([1], [2] if "</s>" in single else [])
    texts = [" ".join(f"w{i % 50}" for i in range(n)) for n in (3, 40, 7)]
    words = [[3 + i % 50 for i in range(n)] for n in (3, 40, 7)]
    want = [1, *words[0], 2, 1, *words[1], 2, 1, *words[2], 2]
    with open(tmp_path / "out.bin", "wb") as out:
        encoder = dataset_mod._DocumentEncoder(tok, 2, "append", np.dtype(np.uint16), out)
        for t in texts:
            encoder.add(t)
        counts = encoder.close()
    assert np.fromfile(tmp_path / "out.bin", dtype=np.uint16).tolist() == want
    assert counts.tolist() == [len(w) + 2 for w in words]
    # the encoder processes' path: the long document in two pieces of one frame
    cut = texts[1].index(" ", 60)  # the pieces split between words, as the build's do
    pieces = [texts[1][:cut], texts[1][cut:]]
    frame = (struct.pack("<Q", 2) + struct.pack("<2Q", *(len(p) for p in pieces))
             + bytes([BEGINS, ENDS]) + "".join(pieces).encode())
    sizes, ids = encode_batch(tok, frame, 2, "append", "H", template_ids(tok))
    assert list(ids) == [1, *words[1], 2] and sum(sizes) == len(ids)
    # the separator before a document, after a template that ends one with it: once
    assert edges(2, "prepend", [1], [2]) == ([1], [2])
    assert edges(2, "prepend", [1], []) == ([2, 1], [])


def test_a_probe_the_tokenizer_cannot_encode_finds_no_template():
    """A vocabulary without the probe's text (and no unknown token) encodes it to nothing:
    no template is found in that case rather than all of it taken for a suffix."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from editrain.data.encode_worker import template_ids

    tok = Tokenizer(models.BPE({"<s>": 0, "</s>": 1, "b": 2}, []))  # no unknown token
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    assert tok.encode("a", add_special_tokens=False).ids == []
    assert template_ids(tok) == ([], [])


def test_overlap_table_keeps_every_match():
    """A validation split big enough for a wide table: the share equals the set-based one."""
    rng = np.random.default_rng(3)
    train = rng.integers(0, 50, 60_000).astype(np.uint16)
    val = np.concatenate([train[5000:25000], rng.integers(0, 50, 20_000).astype(np.uint16)])
    seen = set(window_hashes(train, 8).tolist())
    want = float(np.mean([h in seen for h in window_hashes(val, 8).tolist()]))
    assert window_overlap(val, train, 8) == want
    assert 0.4 < want < 0.6
