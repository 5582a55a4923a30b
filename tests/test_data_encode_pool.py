"""Issue 49, build time: a large corpus is encoded in worker processes, exact duplicates are
not encoded at all.

A build that encodes in an :class:`~editrain.data.encode_pool.EncoderPool` (one
single-threaded tokenizer process per CPU, as the benchmark's limit encodes) must write the
same bytes as one that encodes in its own process: every entry here is built both ways and
compared file by file. Later copies of a document are skipped before encoding (every split
drops them): the entry's token count is checked against the first copies encoded one by one.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

from editrain.data import dataset as dataset_mod
from editrain.data.encode_pool import EncoderPool, pool_workers
from editrain.data.progress import BuildProgress
from editrain.data.sources import iter_records, resolve_sources
from editrain.data.tokenizer import train_bpe_tokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "ηta", "theta", "x1", "y_2"]


def _text(rng: random.Random, lines: int) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
                     + rng.choice(["", ";", " # note", "()"]) for _ in range(lines)) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Files in twenty families: short ones, one long enough to be cut into pieces (over 64K
    characters), special-token text, and exact duplicates of earlier files."""
    root = tmp_path_factory.mktemp("pool") / "corpus"
    rng = random.Random(7)
    texts = [_text(rng, rng.randint(5, 60)) for _ in range(160)]
    texts[3] = _text(rng, 12_000)  # about 400K characters: several pieces
    texts[10] = "before <|endoftext|> after\n" + texts[10]
    for i in range(160):
        path = root / f"fam{i % 20:02d}" / f"doc{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(texts[i], encoding="utf-8")
    for k, i in enumerate((5, 40, 41, 99)):  # copies, under names read after the original
        (root / "fam19" / f"zz_copy{k}.txt").write_text(texts[i], encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tokenizer_file(corpus, tmp_path_factory) -> Path:
    texts = [d.text for d in iter_records(resolve_sources(str(corpus)))]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(texts[:40], 600).save(str(path))
    return path


def _build(root: Path, corpus: Path, tokenizer: Path | None, *, pool: bool,
           policy: str = "append") -> tuple[Path, dict]:
    entry = root / f"entry-{'pool' if pool else 'inproc'}-{policy}-{tokenizer is not None}"
    split = {"val_fraction": 0.05, "val_tokens": 2000, "seed": 0}
    with BuildProgress(False) as bar:
        dataset_mod._build_entry(entry, resolve_sources(str(corpus)), str(corpus), 600,
                                 None if tokenizer is None else str(tokenizer), split, None,
                                 None, policy, "test", bar, sample_bytes=60_000,
                                 pool_chars=0 if pool else 1 << 62)
    return entry, json.loads((entry / "meta.json").read_text())


def _same_entries(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name == "meta.json":
            ma, mb = (json.loads((d / name).read_text()) for d in (a, b))
            ma.pop("build_seconds"), mb.pop("build_seconds")
            assert ma == mb
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("policy", ["append", "prepend"])
def test_a_given_tokenizers_build_in_processes_writes_the_same_bytes(tmp_path, corpus,
                                                                     tokenizer_file, policy,
                                                                     monkeypatch):
    encoded: list[str] = []  # every document handed to the encoder
    add = dataset_mod._DocumentEncoder.add
    monkeypatch.setattr(dataset_mod._DocumentEncoder, "add",
                        lambda self, text: (encoded.append(text), add(self, text))[1])
    pooled, meta = _build(tmp_path, corpus, tokenizer_file, pool=True, policy=policy)
    assert len(encoded) == len(set(encoded)) == 160  # the 4 copies were never encoded
    inproc, _ = _build(tmp_path, corpus, tokenizer_file, pool=False, policy=policy)
    _same_entries(pooled, inproc)
    # Exact duplicates are not encoded, yet the sides hold every first copy, once: the
    # tokens equal the first copies encoded one by one (one separator each).
    tok = dataset_mod.load_tokenizer(str(tokenizer_file))
    tok.encode_special_tokens = True
    seen, expected = set(), 0
    for doc in iter_records(resolve_sources(str(corpus))):
        if doc.text not in seen:
            seen.add(doc.text)
            expected += len(tok.encode(doc.text).ids) + 1
    assert meta["kinds"]["duplicates_dropped"] == 4
    assert meta["split"] == "documents"  # no document cut in two: the count is exact
    assert meta["train_tokens"] + meta["val_tokens"] == expected


def test_a_tokenizer_without_eos_builds_in_processes_with_eos_none(tmp_path, corpus):
    """``data.eos = none`` with a tokenizer that has no end-of-text token: the workers are
    told there is no separator id, and write what the build's own process writes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [d.text for d in iter_records(resolve_sources(str(corpus)))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts[:40], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "no-eos.json"
    tok.save(str(path))
    pooled, meta = _build(tmp_path, corpus, path, pool=True, policy="none")
    inproc, _ = _build(tmp_path, corpus, path, pool=False, policy="none")
    _same_entries(pooled, inproc)
    assert meta["eos_id"] is None and meta["train_tokens"] > 0 and meta["val_tokens"] > 0


def test_an_own_bpe_build_in_processes_writes_the_same_bytes(tmp_path, corpus):
    pooled, meta = _build(tmp_path, corpus, None, pool=True)
    inproc, _ = _build(tmp_path, corpus, None, pool=False)
    _same_entries(pooled, inproc)
    assert meta["tokenizer"] == "bpe" and meta["train_tokens"] > 0 and meta["val_tokens"] > 0


def test_the_pool_returns_batches_in_order_with_separators(tokenizer_file):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.encode_special_tokens = True
    got: list[tuple[np.ndarray, np.ndarray, int]] = []
    pool = EncoderPool(tok.to_str(), 0, "prepend", np.dtype(np.uint16), 2,
                       lambda ids, sizes, tag: got.append((ids.copy(), sizes.copy(), tag)))
    batches = [[f"{WORDS[i % 10]} {i} <|endoftext|>", "", "second piece\n"] for i in range(9)]
    for i, batch in enumerate(batches):
        pool.send(batch, [True, False, True], [False, True, True], tag=i)
    pool.close()
    assert [tag for _, _, tag in got] == list(range(9))
    for (ids, sizes, _), batch in zip(got, batches):
        enc = [tok.encode(t).ids for t in batch]
        want = [0, *enc[0], *enc[1], 0, *enc[2]]  # a separator before each document's start
        assert ids.tolist() == want
        assert sizes.tolist() == [len(enc[0]) + 1, len(enc[1]), len(enc[2]) + 1]


def test_a_failed_worker_stops_the_build_with_an_error(tokenizer_file):
    """A worker that dies (killed, out of memory) fails the build at its next batch: no
    hang, no silent loss."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    pool = EncoderPool(tok.to_str(), 0, "append", np.dtype(np.uint16), 2,
                       lambda *args: None)
    pool.send(["alpha beta"], [True], [True])
    pool._procs[1].kill()
    pool._procs[1].wait()
    t0 = time.monotonic()
    with pytest.raises((RuntimeError, EOFError), match="tokenizer process"):
        for _ in range(8):
            pool.send(["gamma delta"], [True], [True])
        pool.close()
    assert time.monotonic() - t0 < 30
    pool.abort()


def test_workers_are_out_of_the_terminals_reach(tokenizer_file):
    """A terminal's Ctrl-C goes to its foreground process group: the workers are in a
    session of their own, so that one cannot land in a worker's start-up (a traceback, or
    'Fatal Python error: init_import_site', 2 builds in 6 interrupted as the workers
    appeared); the build stops them itself."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    pool = EncoderPool(tok.to_str(), 0, "append", np.dtype(np.uint16), 2, lambda *a: None)
    try:
        groups = {os.getpgid(proc.pid) for proc in pool._procs}
        assert os.getpgrp() not in groups
        assert groups == {proc.pid for proc in pool._procs}  # each leads its own
        pool.send(["alpha beta"], [True], [True])
        pool.close()
    finally:
        pool.abort()


def test_a_worker_whose_build_is_gone_ends_quietly():
    """A build stopped while it started a worker (a Ctrl-C inside ``Popen``, or in the
    middle of the tokenizer's frame) closes the worker's input early: the worker ends
    without a traceback on the terminal (it printed an EOFError, 3 builds in 8 interrupted
    as their workers appeared)."""
    import struct
    import subprocess
    import sys

    from editrain.data import encode_pool, encode_worker

    for sent in (b"", b"\x10\x00", struct.pack("<Q", 1000) + b"{" * 10):
        proc = subprocess.run([sys.executable, "-c", encode_pool._BOOT, encode_worker.__file__],
                              input=sent, capture_output=True, timeout=60)
        assert proc.returncode == 0 and proc.stderr == b"", (sent, proc.stderr[-2000:])


def test_text_the_tokenizer_rejects_is_reported(tokenizer_file):
    """A worker's own error (here: a lone surrogate, which the tokenizer's Rust side cannot
    take) comes back as the build's error, with its message."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    pool = EncoderPool(tok.to_str(), 0, "append", np.dtype(np.uint16), 1, lambda *a: None)
    pool.send(["fine", "bad \ud800 text"], [True, True], [True, True])
    with pytest.raises(RuntimeError, match="a tokenizer process failed: .*"):
        pool.close()
    pool.abort()


def test_pool_workers_follows_the_cpus_and_the_users_bounds(monkeypatch):
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    assert pool_workers(4) == 4
    assert pool_workers(1) == 1
    monkeypatch.setenv("RAYON_NUM_THREADS", "2")
    assert pool_workers(4) == 2
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert pool_workers(4) == 1
    monkeypatch.delenv("RAYON_NUM_THREADS")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert pool_workers(4) == 4
    assert pool_workers() == len(os.sched_getaffinity(0))


def test_a_failed_write_does_not_leave_the_build_waiting_on_a_worker(tokenizer_file):
    """The build fails to write a batch (a full disk) while it keeps sending large ones:
    nobody reads the workers' results any more, so a send to a worker blocked writing one
    would wait for ever; the build must get the write's error instead."""
    import threading

    from tokenizers import Tokenizer

    def full_disk(*args):
        time.sleep(1.0)  # a slow disk: meanwhile the build sends on, to a busy worker
        raise OSError(28, "No space left on device")

    tok = Tokenizer.from_file(str(tokenizer_file))
    pool = EncoderPool(tok.to_str(), 0, "append", np.dtype(np.uint16), 2, full_disk)
    big = "alpha beta gamma " * 20_000  # 340K characters: results beyond a pipe's buffer
    outcome: list[BaseException] = []

    def build() -> None:
        try:
            for _ in range(20):
                pool.send([big], [True], [True])
            pool.close()
        except BaseException as exc:  # noqa: BLE001 - what the build would raise
            outcome.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the build is stuck sending to a worker nobody reads"
    assert len(outcome) == 1 and "No space left" in str(outcome[0])
    pool.abort()
