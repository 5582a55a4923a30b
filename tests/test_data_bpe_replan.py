"""Issue 49, own BPE: a re-planned split keeps a tokenizer trained on a sample.

The validation floor (``data.val_tokens``) is in tokens, the first plan in bytes guessed
before the tokenizer exists; when that plan is short the split is planned again. A
tokenizer trained on a sample of the training side is drawn from documents that stay on the
training side of a split with twice the target too, so the re-plan keeps it (trained once);
it is trained again only when the final split's validation side holds text it saw. A
tokenizer trained on the whole training side (the default corpus) is trained again, as it
always was. Every build here checks the promise itself: no text the tokenizer was trained
on is on the final validation side.

The corpora are random lines of a few made-up words, which a BPE of a few hundred ids
learns whole: about 3.4 bytes a token with 3-letter words (a first plan somewhat short),
about 10 with 10-letter words (far short: a re-plan beyond twice the first target).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from editrain.data import dataset as dataset_mod
from editrain.data import split as split_mod
from editrain.data.progress import BuildProgress
from editrain.data.sources import Document, iter_records, resolve_sources
from editrain.data.split import DocumentTable, describe_documents, plan_split
from editrain.data.tokenizer import load_tokenizer, train_bpe_tokenizer

VAL_TOKENS = 3000
VAL_FRACTION = 0.01


def _words(length: int, n: int = 40) -> list[str]:
    """``n`` distinct made-up words of ``length`` letters (consonant, vowel, ...)."""
    rng = random.Random(length)
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice("bcdfghjklmnpqrstvwz" if k % 2 == 0 else "aeiou")
                        for k in range(length)))
    return sorted(out)


def _text(rng: random.Random, words: list[str], lines: int) -> str:
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
                     for _ in range(lines)) + "\n"


def _corpus(root: Path, *, docs: int, families: int, word_length: int,
            lines: tuple[int, int] = (10, 30)) -> Path:
    """``docs`` text files spread over ``families`` directories."""
    rng = random.Random(docs * 1000 + families)
    words = _words(word_length)
    for i in range(docs):
        path = root / f"fam{i % families:03d}" / f"doc{i:04d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_text(rng, words, rng.randint(*lines)))
    return root


def _build(tmp_path: Path, corpus: Path, *, vocab_size: int, sample_bytes: int):
    """Build an entry with an own BPE; ``(entry, meta, texts of every training)``."""
    trainings: list[list[str]] = []

    def train(texts, size):
        texts = list(texts)
        trainings.append(texts)
        return train_bpe_tokenizer(texts, size)

    entry = tmp_path / "entry"
    split = {"val_fraction": VAL_FRACTION, "val_tokens": VAL_TOKENS, "seed": 0}
    with BuildProgress(False) as bar:
        dataset_mod._build_entry(entry, resolve_sources(str(corpus)), str(corpus), vocab_size,
                                 None, split, None, None, "append", "test", bar,
                                 sample_bytes=sample_bytes, train_bpe=train)
    meta = json.loads((entry / "meta.json").read_text())
    return entry, meta, trainings


def _documents(corpus: Path) -> tuple[list[Document], DocumentTable]:
    docs = list(iter_records(resolve_sources(str(corpus))))
    return docs, describe_documents(docs)


def _first_plan_tokens(entry: Path, docs, table) -> int:
    """Tokens (one EOS each) of the validation side of the first plan, the one planned with
    the byte guess, encoded with the entry's tokenizer."""
    plan = plan_split(table, VAL_FRACTION,
                      int(VAL_TOKENS * dataset_mod._BYTES_PER_TOKEN_GUESS), 0)
    tok = load_tokenizer(entry / "tokenizer.json")
    tok.encode_special_tokens = True
    texts = [plan.parts(i, d.text)[1] for i, d in enumerate(docs)]
    return sum(len(tok.encode(t).ids) + 1 for t in texts if t)


def _assert_sample_is_training_text(entry: Path, meta: dict, sample: list[str], docs,
                                    table) -> None:
    """Every text the saved tokenizer was trained on is a prefix of the training part of
    its document under the entry's split, and no listed validation document is in it."""
    # The entry's split again: its target, given as the floor, plans the same split.
    plan = plan_split(table, VAL_FRACTION, meta["kinds"]["target_bytes"], 0)
    assert plan.mode == meta["split"]
    assert plan.stats["val_bytes"] == meta["kinds"]["val_bytes"]
    by_name = {d.name: d.text for d in docs}
    listed = {name for name, _, _ in json.loads((entry / "val_documents.json").read_text())}
    assert listed
    for text in sample:
        owners = [i for i, d in enumerate(docs) if d.text.startswith(text)]
        assert len(owners) == 1
        train_part, val_part = plan.parts(owners[0], docs[owners[0]].text)
        assert train_part.startswith(text), "the tokenizer saw validation text"
        if owners[0] != plan.tail_doc:
            assert not val_part and docs[owners[0]].name not in listed
    seen = set(sample)
    assert not any(by_name[name] in seen for name in listed if name in by_name)


# ------------------------------------------------------------------ whole builds
def test_sampled_bpe_is_trained_once_when_the_split_is_replanned(tmp_path):
    """A training side above the sample bound, a first plan short of data.val_tokens: the
    split is planned again, the tokenizer is trained once, the floor is met and the
    tokenizer saw no validation text."""
    corpus = _corpus(tmp_path / "corpus", docs=120, families=60, word_length=3)
    entry, meta, trainings = _build(tmp_path, corpus, vocab_size=400, sample_bytes=40_000)
    docs, table = _documents(corpus)
    assert meta["split"] == "documents" and not meta["kinds"]["capped"]
    assert _first_plan_tokens(entry, docs, table) < VAL_TOKENS  # the first plan was short
    assert len(trainings) == 1
    assert meta["val_tokens"] >= VAL_TOKENS
    assert meta["tokenizer_trained_on"] == "train"
    sample = trainings[-1]
    assert 30_000 < sum(map(len, sample)) <= 40_000  # a sample, not the training side
    assert sum(map(len, sample)) < 0.6 * sum(len(d.text) for d in docs)
    _assert_sample_is_training_text(entry, meta, sample, docs, table)


def test_whole_training_side_bpe_is_trained_again_on_a_replan(tmp_path):
    """At or below the bound (the default corpus's case) the tokenizer sees the whole
    training side, which the re-plan changes: trained again, on exactly the final split's
    training texts, as before this rule."""
    corpus = _corpus(tmp_path / "corpus", docs=120, families=60, word_length=3)
    entry, meta, trainings = _build(tmp_path, corpus, vocab_size=400, sample_bytes=10**9)
    docs, table = _documents(corpus)
    assert _first_plan_tokens(entry, docs, table) < VAL_TOKENS
    assert len(trainings) == 2
    assert meta["val_tokens"] >= VAL_TOKENS
    plan = plan_split(table, VAL_FRACTION, meta["kinds"]["target_bytes"], 0)
    want = [t for t in (plan.parts(i, d.text)[0] for i, d in enumerate(docs)) if t]
    assert trainings[-1] == want
    _assert_sample_is_training_text(entry, meta, trainings[-1], docs, table)


def test_sampled_bpe_is_trained_again_when_the_replan_takes_sampled_documents(tmp_path):
    """Words of 10 letters, about 10 bytes a token: the re-plan's target is beyond twice
    the first one, its validation side takes documents the sample took, so the check finds
    them and the tokenizer is trained again, on the final training side only."""
    corpus = _corpus(tmp_path / "corpus", docs=120, families=60, word_length=10)
    entry, meta, trainings = _build(tmp_path, corpus, vocab_size=800, sample_bytes=200_000)
    docs, table = _documents(corpus)
    first_target = int(VAL_TOKENS * dataset_mod._BYTES_PER_TOKEN_GUESS)
    assert meta["kinds"]["target_bytes"] > 2 * first_target
    assert len(trainings) == 2
    assert meta["val_tokens"] >= VAL_TOKENS
    _assert_sample_is_training_text(entry, meta, trainings[-1], docs, table)


@pytest.mark.parametrize(("sample_bytes", "trained"), [(150_000, 1), (250_000, 2)])
def test_tail_split_checks_the_cut_document(tmp_path, sample_bytes, trained):
    """One long document (a tail split cuts it): the sample is its first characters, kept
    when the final cut leaves them on the training side (150 kB), trained again when the
    final cut, beyond twice the first target, falls inside them (250 kB)."""
    corpus = _corpus(tmp_path / "corpus", docs=1, families=1, word_length=10,
                     lines=(3000, 3000))
    entry, meta, trainings = _build(tmp_path, corpus, vocab_size=800,
                                    sample_bytes=sample_bytes)
    docs, table = _documents(corpus)
    text = docs[0].text
    assert meta["split"] == "tail" and sample_bytes < len(text)
    assert _first_plan_tokens(entry, docs, table) < VAL_TOKENS
    assert len(trainings) == trained
    assert meta["val_tokens"] >= VAL_TOKENS
    _assert_sample_is_training_text(entry, meta, trainings[-1], docs, table)
    if trained == 2:  # the first sample did reach beyond the final cut
        plan = plan_split(table, VAL_FRACTION, meta["kinds"]["target_bytes"], 0)
        assert sum(map(len, trainings[0])) > len(plan.parts(0, text)[0])


# ------------------------------------------------------------------ the pieces
def _plans(table):
    return (plan_split(table, 0.05, 2000, 0), plan_split(table, 0.05, 8000, 0))


def test_bpe_sample_takes_the_training_text_of_every_plan():
    """With ``also``, a document's text handed out is its training text under every plan;
    ``taken`` records each one's length; without them the sample is as before."""
    rng = random.Random(0)
    words = _words(5)
    docs = [Document(_text(rng, words, 20), f"d{i}", f"f{i}", "prose") for i in range(80)]
    table = describe_documents(docs)
    small, large = _plans(table)
    assert small.mode == large.mode == "documents"
    total = sum(len(d.text) for d in docs)
    taken: dict[int, int] = {}
    sample = list(dataset_mod.bpe_sample(docs, small, table, total, also=(large,),
                                         taken=taken))
    both = [i for i in range(len(docs)) if not (small.val[i] or large.val[i])]
    assert sample == [docs[i].text for i in both]
    assert taken == {i: len(docs[i].text) for i in both}
    assert 0 < small.val.sum() and len(both) < len(docs) - small.val.sum()  # also matters
    assert list(dataset_mod.bpe_sample(docs, small, table, total)) == [
        d.text for i, d in enumerate(docs) if not small.val[i]]


def test_sample_kept_checks_documents_and_the_cut():
    rng = random.Random(1)
    words = _words(5)
    docs = [Document(_text(rng, words, 20), f"d{i}", f"f{i}", "prose") for i in range(40)]
    table = describe_documents(docs)
    plan = plan_split(table, 0.05, 2000, 0)
    val = [int(i) for i in plan.val.nonzero()[0]]
    train = [i for i in range(len(docs)) if not plan.val[i]]
    assert dataset_mod._sample_kept({}, plan)
    assert dataset_mod._sample_kept({i: 5 for i in train}, plan)
    assert not dataset_mod._sample_kept({train[0]: 5, val[0]: 5}, plan)
    # A tail split: the cut document is checked once its training part's length is known.
    one = describe_documents([Document(docs[0].text * 20, "one", "one", "prose")])
    tail = plan_split(one, 0.05, 2000, 0)
    assert tail.mode == "tail" and tail.tail_doc == 0
    assert dataset_mod._sample_kept({0: 10_000}, tail)  # not known yet
    assert dataset_mod._sample_kept({0: 10_000}, tail, cut_train=10_000)
    assert not dataset_mod._sample_kept({0: 10_001}, tail, cut_train=10_000)


def test_plans_for_several_floors_are_each_floors_own_plan(monkeypatch):
    """``plan_splits`` finds the groups once and gives, for every floor, exactly the plan
    ``plan_split`` gives for it alone (documents and tail splits, with near-duplicates)."""
    rng = random.Random(2)
    words = _words(5)
    docs = [Document(_text(rng, words, 20), f"d{i}", f"f{i % 30}", ("prose", "code")[i % 2])
            for i in range(90)]
    docs += [Document(docs[3].text + " extra words here", "dup", "fdup", "prose")]
    table = describe_documents(docs)
    floors = [0, 1500, 2000, 4000, 8000, 10**9]
    grouped = []
    real_groups = split_mod._groups
    monkeypatch.setattr(split_mod, "_groups",
                        lambda *a: grouped.append(1) or real_groups(*a))
    several = split_mod.plan_splits(table, 0.05, floors, 7)
    assert len(grouped) == 1
    one = describe_documents([Document(docs[0].text * 20, "one", "one", "prose")])
    for plans, tab in ((several, table), (split_mod.plan_splits(one, 0.05, floors, 7), one)):
        for plan, floor in zip(plans, floors):
            alone = split_mod.plan_split(tab, 0.05, floor, 7)
            assert (plan.mode, plan.tail_doc, plan.tail_keep_share, plan.groups,
                    plan.near_dup_merges, plan.stats) == (
                alone.mode, alone.tail_doc, alone.tail_keep_share, alone.groups,
                alone.near_dup_merges, alone.stats)
            assert (plan.val == alone.val).all() and (plan.drop == alone.drop).all()
    assert len({int(p.val.sum()) for p in several}) >= 3  # the floors do differ
