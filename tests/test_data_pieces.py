"""Issue 49: long documents are encoded in pieces of at most ``_MAX_PIECE_CHARS`` characters
(tokenizers' memory grows with the length of one string: a build over the 40 largest Python
files of a site-packages peaked at 438 MiB with 1 MiB pieces, 170 MiB with 64 KiB), cut
where editrain's own tokenizer (byte-level BPE, GPT-2's pre-tokenizer) splits the text
anyway, so that the pieces encode into exactly the tokens of the whole document."""

from __future__ import annotations

import random

import pytest

import editrain.data.dataset as dataset
from editrain.data.dataset import _pieces
from editrain.data.tokenizer import train_bpe_tokenizer

PIECE = 2048
"""The piece size of these tests (64 KiB in the library): the same rules at a size that
makes a document of a few kilobytes long."""


def _code(rng: random.Random, n: int) -> str:
    lines = []
    for i in range(n):
        depth = rng.choice([0, 4, 8, 8, 12])
        lines.append(" " * depth + rng.choice([
            f"def f{i}(x, y={i}):", f"return x + y * {i}", f"value_{i} = {{'k{i}': [{i}, {i + 1}]}}",
            "# a comment, with words and 'quotes' it's got", "", f"if x > {i}:", "pass"]))
    return "\n".join(lines)


def _compact_json(rng: random.Random, n: int) -> str:
    """Indented lines of punctuation and names with no space between two non-space
    characters and no line at column 0 (the AWS policy file that needs the third rule)."""
    return "{\n" + ",\n".join(f'      "svc{rng.randrange(99)}:Get{rng.choice("ABC")}x{i}*"'
                              for i in range(n)) + "\n}"


def _number_table(rng: random.Random, n: int) -> str:
    return "[\n" + "".join(f"        {rng.randrange(1000)},\n" for _ in range(n)) + "]"


def _aligned_dict(rng: random.Random, n: int) -> str:
    """locale.py's alias table: keys, a colon, then spaces up to a column (the one document
    of the default corpus the first two rules could not cut)."""
    return "table = {\n" + "".join(f"    'k{i}_{rng.choice('ab')}':{' ' * 30}'v{i}.ISO-88{i}',\n"
                                   for i in range(n)) + "}\n"


def _prose(rng: random.Random, n: int) -> str:
    words = ["the", "model", "don't", "it's", "we'll", "syncs", "every", "H", "steps", "3.5x",
             "naïve", "café", "—", "(see", "below)."]
    return " ".join(rng.choice(words) for _ in range(n))


KINDS = {"code": _code, "compact_json": _compact_json, "number_table": _number_table,
         "aligned_dict": _aligned_dict, "prose": _prose}


@pytest.fixture(scope="module")
def tokenizer():
    rng = random.Random(0)
    texts = [make(rng, 300) for make in KINDS.values() for _ in range(4)]
    return train_bpe_tokenizer(iter(texts), 600)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_pieces_encode_into_the_tokens_of_the_whole_document(kind, tokenizer, monkeypatch):
    monkeypatch.setattr(dataset, "_MAX_PIECE_CHARS", PIECE)
    text = KINDS[kind](random.Random(1), 2000)
    pieces = list(_pieces(text))
    assert len(pieces) > 3, "the document is cut"
    assert "".join(pieces) == text
    assert all(len(p) <= PIECE for p in pieces)
    assert all(len(p) >= PIECE // 2 for p in pieces[:-1]), "cut in the second half"
    whole = tokenizer.encode(text).ids
    assert [i for p in pieces for i in tokenizer.encode(p).ids] == whole


def test_the_old_cut_after_any_newline_changed_tokens(tokenizer, monkeypatch):
    """What the rules are for: a cut after a newline followed by indentation (the rule
    before) splits a pre-token, and the tokens differ from the whole document's."""
    text = _code(random.Random(1), 2000)
    cut = text.index("\n    ", len(text) // 2) + 1
    whole = tokenizer.encode(text).ids
    assert tokenizer.encode(text[:cut]).ids + tokenizer.encode(text[cut:]).ids != whole


@pytest.mark.parametrize("text, ends", [
    ("x" * 5000, [2048, 4096]),  # no cut place: at the limit
    (("y" * 1500 + "\n") * 4, [1501, 3002, 4503]),  # after the newlines
    (("z" * 1500 + "\n ") * 4, [1501, 3003, 4505]),  # after the newlines, though tokens
                                                     # may differ there
])
def test_without_a_cut_place_pieces_still_cover_the_text(text, ends, monkeypatch):
    monkeypatch.setattr(dataset, "_MAX_PIECE_CHARS", PIECE)
    pieces = list(_pieces(text))
    assert "".join(pieces) == text
    assert [sum(map(len, pieces[:k + 1])) for k in range(len(pieces) - 1)] == ends


def test_a_document_within_the_limit_is_one_piece(monkeypatch):
    monkeypatch.setattr(dataset, "_MAX_PIECE_CHARS", PIECE)
    text = _code(random.Random(2), 10)[:PIECE]
    assert list(_pieces(text)) == [text]
