"""Issue 49 item 4: a dataset with an ``input_ids`` column as a pre-tokenised corpus.

A ``.parquet`` file or a ``save_to_disk`` directory read with ``data.text_field=input_ids``:
each row's ids are a document, separated as ``data.eos`` says, streamed a batch of rows at a
time; the last tokens are held out as for a flat token file. Bad columns and ids are refused
in one line naming the option and the source.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from editrain.data import prepare_tokens
from editrain.data import sources as sources_mod
from editrain.data.dataset import MAX_VAL_SHARE
from editrain.data.pretokenized import row_ids, tail_split
from editrain.data.sources import parse_sources, token_row_batches
from editrain.data.tokenizer import train_bpe_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

VOCAB = 300


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    rng = random.Random(1)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    texts = [" ".join(rng.choice(words) for _ in range(400)) for _ in range(10)]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(texts, VOCAB).save(str(path))
    return path


def _rows(n: int = 500, seed: int = 0) -> list[list[int] | None]:
    rng = random.Random(seed)
    rows: list[list[int] | None] = [[rng.randrange(1, 250) for _ in range(rng.randint(1, 60))]
                                    for _ in range(n)]
    rows[7], rows[11] = None, []  # a null and an empty row: left out, as empty texts are
    return rows


def _expected(rows, eos: int, policy: str) -> list[int]:
    out: list[int] = []
    for r in rows:
        if r:
            out += ([eos] if policy == "prepend" else []) + r + ([eos] if policy == "append"
                                                                 else [])
    return out


def _parquet(path: Path, rows, column: str = "input_ids") -> Path:
    pq.write_table(pa.table({column: pa.array(rows, type=pa.list_(pa.int32())),
                             "other": [str(i) for i in range(len(rows))]}), path,
                   row_group_size=128)
    return path


@pytest.mark.parametrize("policy", ["append", "prepend", "none"])
def test_parquet_input_ids_is_a_pretokenised_corpus(tmp_path, tokenizer, policy):
    rows = _rows()
    path = _parquet(tmp_path / "ids.parquet", rows)
    data = prepare_tokens(str(path), tmp_path / "cache", tokenizer_path=str(tokenizer),
                          text_field="input_ids", eos=policy, val_tokens=500, progress=False)
    want = _expected(rows, data.eos_id, policy)
    n_val = tail_split(len(want), 0.01, 500, MAX_VAL_SHARE)
    assert np.asarray(data.train).tolist() == want[:len(want) - n_val]
    assert np.asarray(data.val).tolist() == want[len(want) - n_val:]
    assert data.meta["pretokenized"] and data.meta["split"] == "tail"
    assert data.meta["eos"] == policy
    assert not list(data.cache_dir.glob("*.tmp.*"))
    # The same file again: the entry is reused.
    again = prepare_tokens(str(path), tmp_path / "cache", tokenizer_path=str(tokenizer),
                           text_field="input_ids", eos=policy, val_tokens=500, progress=False)
    assert again.reused and again.cache_dir == data.cache_dir


def test_save_to_disk_input_ids_is_a_pretokenised_corpus(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = _rows(300, seed=4)
    ds = datasets.Dataset.from_dict({"input_ids": rows, "label": list(range(len(rows)))})
    ds.save_to_disk(str(tmp_path / "saved"))
    data = prepare_tokens(str(tmp_path / "saved"), tmp_path / "cache",
                          tokenizer_path=str(tokenizer), text_field="input_ids",
                          val_tokens=200, progress=False)
    want = _expected(rows, data.eos_id, "append")
    assert np.asarray(data.train).tolist() + np.asarray(data.val).tolist() == want
    assert len(data.val) == tail_split(len(want), 0.01, 200, MAX_VAL_SHARE)


def test_rows_are_read_a_batch_at_a_time(tmp_path, monkeypatch):
    """Memory holds one batch of rows: the column comes in batches of _ROW_BATCH rows."""
    monkeypatch.setattr(sources_mod, "_ROW_BATCH", 64)
    path = _parquet(tmp_path / "ids.parquet", _rows(500))
    (ref,) = parse_sources(str(path), "input_ids")
    sizes = [len(b) for b in token_row_batches(ref)]
    assert max(sizes) <= 64 and sum(sizes) == 500


def test_row_ids_places_separators_vectorised():
    rows = pa.array([[1, 2], None, [], [3], [4, 5, 6]], type=pa.list_(pa.int64()))
    assert row_ids(rows, 9, "append").tolist() == [1, 2, 9, 3, 9, 4, 5, 6, 9]
    assert row_ids(rows, 9, "prepend").tolist() == [9, 1, 2, 9, 3, 9, 4, 5, 6]
    assert row_ids(rows, 9, "none").tolist() == [1, 2, 3, 4, 5, 6]
    assert row_ids(rows.slice(2), 9, "append").tolist() == [3, 9, 4, 5, 6, 9]


def test_bad_token_columns_are_refused_in_one_line(tmp_path, tokenizer):
    def build(path, **kw):
        return prepare_tokens(str(path), tmp_path / "cache", progress=False,
                              text_field="input_ids", **kw)

    missing = _parquet(tmp_path / "other.parquet", _rows(20), column="ids")
    with pytest.raises(ValueError, match=r'^data\.text_field: .*no column "input_ids".*ids'):
        build(missing, tokenizer_path=str(tokenizer))
    text = tmp_path / "text.parquet"
    pq.write_table(pa.table({"input_ids": ["a", "b"]}), text)
    with pytest.raises(ValueError, match=r"^data\.text_field: .*not lists of integer"):
        build(text, tokenizer_path=str(tokenizer))
    big = _parquet(tmp_path / "big.parquet", [[1, 2, 10_000]] * 10)
    with pytest.raises(ValueError, match=r"^data\.path: .*token id 10000, outside"):
        build(big, tokenizer_path=str(tokenizer))
    with pytest.raises(ValueError, match=r"^data\.tokenizer: "):
        build(_parquet(tmp_path / "ok.parquet", _rows(20)))
    for err in (ValueError,):
        try:
            build(missing, tokenizer_path=str(tokenizer))
        except err as exc:
            assert "\n" not in str(exc)
