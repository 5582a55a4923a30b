"""Issue 49 item 4: token-cache builds at real size and pre-tokenised corpora.

The mechanisms that keep a build's memory flat are tested, not timings: the encoder's batch,
the overlap measure's pieces and the tokenizer's sample are bounded by constants, not by
the corpus; the streamed build equals an in-memory reference; the cache entry appears in
one rename; pre-tokenised files are accepted in their three forms and refused, in one line
naming the file, when their form or ids are wrong.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from editrain.data import dataset as dataset_mod
from editrain.data import prepare_tokens
from editrain.data.overlap import iter_window_hashes, window_hashes, window_overlap
from editrain.data.progress import BuildProgress
from editrain.data.sources import Document, parse_sources
from editrain.data.split import describe_documents, plan_split
from editrain.data.tokenizer import load_tokenizer, train_bpe_tokenizer

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega").split()


def _text(rng: random.Random, lines: int) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                     for _ in range(lines)) + "\n"


def _corpus(root: Path, docs: int = 60, seed: int = 0) -> Path:
    """A directory of ``docs`` small text files in 12 sub-directories (families)."""
    rng = random.Random(seed)
    for i in range(docs):
        path = root / f"fam{i % 12:02d}" / f"doc{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_text(rng, rng.randint(5, 40)))
    return root


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer([_text(rng, 50) for _ in range(20)], 300).save(str(path))
    return path


# ------------------------------------------------------------------ streaming, bounded
def test_streamed_build_equals_in_memory_reference(tmp_path, tokenizer, monkeypatch):
    """Many tiny encoder batches (flushes mid-corpus) give exactly the tokens of encoding
    every document on its own, in order, an EOS after each, on the side meta.json says."""
    corpus = _corpus(tmp_path / "corpus")
    monkeypatch.setattr(dataset_mod, "_ENCODE_BATCH_CHARS", 300)
    data = prepare_tokens(str(corpus), tmp_path / "cache", tokenizer_path=str(tokenizer),
                          val_tokens=400, val_fraction=0.1)
    val_names = {name for name, _, _ in
                 json.loads((data.cache_dir / "val_documents.json").read_text())}
    assert 0 < len(val_names) < 60 and data.meta["split"] == "documents"
    tok = load_tokenizer(tokenizer)
    tok.encode_special_tokens = True
    want: dict[str, list[int]] = {"train": [], "val": []}
    for path in sorted(corpus.rglob("*.txt")):
        side = "val" if str(path) in val_names else "train"
        want[side] += tok.encode(path.read_text()).ids + [data.eos_id]
    assert np.array_equal(np.asarray(data.train), np.array(want["train"]))
    assert np.array_equal(np.asarray(data.val), np.array(want["val"]))


class _CountingTokenizer:
    """Stands in for a tokenizer: one id per character, records every batch's size."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def encode(self, text, add_special_tokens=True):  # the template probe: none
        return type("E", (), {"ids": [0] * len(text)})()

    def encode_batch_fast(self, texts, add_special_tokens=True):
        self.batches.append(sum(len(t) for t in texts))
        return [type("E", (), {"ids": [1] * len(t)})() for t in texts]


@pytest.mark.parametrize("docs", [50, 500])
def test_encoder_batch_does_not_grow_with_the_corpus(tmp_path, monkeypatch, docs):
    """What the encoder holds at once is bounded by _ENCODE_BATCH_CHARS plus one piece,
    at 50 documents as at 500 (and every character is written once)."""
    monkeypatch.setattr(dataset_mod, "_ENCODE_BATCH_CHARS", 1000)
    monkeypatch.setattr(dataset_mod, "_MAX_PIECE_CHARS", 400)
    rng = random.Random(docs)
    texts = ["x" * rng.randint(1, 900) for _ in range(docs)]
    tok = _CountingTokenizer()
    with open(tmp_path / "out.bin", "wb") as out:
        n = dataset_mod._encode_to_file(tok, texts, 0, "append", np.dtype(np.uint16), out)
    assert n == sum(map(len, texts)) + docs  # ids + one EOS per document
    assert max(tok.batches) < 1000 + 400
    assert len(tok.batches) >= sum(map(len, texts)) // 1400


def test_overlap_streams_train_in_pieces(monkeypatch):
    """The training split is hashed in pieces of at most ``chunk`` windows; the overlap
    equals a set-based reference at any piece size."""
    rng = np.random.default_rng(0)
    train = rng.integers(0, 5, 5000).astype(np.uint16)
    val = np.concatenate([train[100:180], rng.integers(0, 5, 300).astype(np.uint16)])
    pieces = list(iter_window_hashes(train, 8, chunk=333))
    assert max(len(p) for p in pieces) == 333
    assert np.array_equal(np.concatenate(pieces), window_hashes(train, 8))
    seen = set(window_hashes(train, 8).tolist())
    want = float(np.mean([h in seen for h in window_hashes(val, 8).tolist()]))
    for chunk in (7, 1000, 1 << 20):
        monkeypatch.setattr("editrain.data.overlap._CHUNK", chunk)
        assert window_overlap(val, train, 8) == want
    assert 0 < want < 1


def test_bpe_sample_is_bounded_spread_and_whole_below_the_bound():
    rng = random.Random(0)
    docs = [Document(_text(rng, 20), f"d{i}", f"f{i % 25}", "prose") for i in range(200)]
    infos = describe_documents(docs)
    plan = plan_split(infos, 0.05, 100, 0)
    train_texts = [plan.parts(i, d.text)[0] for i, d in enumerate(docs)]
    train_texts = [t for t in train_texts if t]
    total = sum(len(t) for t in train_texts)
    # At or above the training side's size: every training text, in order (as before).
    assert list(dataset_mod.bpe_sample(docs, plan, infos, total)) == train_texts
    limit = total // 5
    sample = list(dataset_mod.bpe_sample(docs, plan, infos, limit))
    assert sum(map(len, sample)) <= limit
    assert len(sample) >= 10 and set(sample) <= set(train_texts)
    picked = [train_texts.index(t) for t in sample]
    assert picked[-1] > len(train_texts) // 2  # from all over the corpus, not a prefix
    assert sample == list(dataset_mod.bpe_sample(docs, plan, infos, limit))  # deterministic


def test_bpe_trained_on_the_bounded_sample(tmp_path, monkeypatch):
    """A corpus above the bound trains its tokenizer on a sample: another tokenizer than
    from the whole corpus, the same in every build."""
    corpus = _corpus(tmp_path / "corpus", docs=80)
    whole = prepare_tokens(str(corpus), tmp_path / "a", vocab_size=400, val_tokens=300)
    monkeypatch.setattr(dataset_mod, "BPE_SAMPLE_BYTES", 3000)
    small = prepare_tokens(str(corpus), tmp_path / "b", vocab_size=400, val_tokens=300)
    again = prepare_tokens(str(corpus), tmp_path / "c", vocab_size=400, val_tokens=300)
    assert small.tokenizer_path.read_bytes() == again.tokenizer_path.read_bytes()
    assert small.tokenizer_path.read_bytes() != whole.tokenizer_path.read_bytes()
    assert np.array_equal(small.train, again.train)


def test_progress_bar_counts_the_whole_build():
    """One bar: passes add their weighted characters to a total of all passes; the first
    pass's count replaces the estimate from the files."""
    docs = [Document("x" * 10, str(i), str(i), "prose") for i in range(10)]
    with BuildProgress(False, expected_chars=80) as bar:
        bar.expect(5.0)
        assert bar.total == 400
        list(bar.track(iter(docs), "describe", 1.0))
        assert bar.total == 500 and bar.done == 100
        list(bar.track(iter(docs), "encode", 4.0))
        assert bar.done == bar.total == 500


# ------------------------------------------------------------------ one entry, one rename
def test_entry_appears_in_one_rename_and_dead_builds_are_cleared(tmp_path, tokenizer):
    corpus = _corpus(tmp_path / "corpus", docs=30)
    root = tmp_path / "cache"
    root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    first = prepare_tokens(str(corpus), root, tokenizer_path=str(tokenizer), val_tokens=200)
    key = first.cache_dir.name
    # What a build of this host that died leaves behind is removed by the next build.
    leftover = root / f".{key}.{socket.gethostname()}.{dead.pid}"
    leftover.mkdir()
    assert dataset_mod._staging_dir(root, key) == root / f".{key}.{socket.gethostname()}." \
                                                         f"{os.getpid()}"
    assert not leftover.exists()
    # Another node's build arriving second: its rename fails, the first entry stays.
    other = root / f".{key}.othernode.1"
    other.mkdir()
    (other / "meta.json").write_text("{}")
    dataset_mod._publish(other, first.cache_dir)
    assert (first.cache_dir / "meta.json").read_text() != "{}"
    assert dataset_mod._open_entry(first.cache_dir, reused=True) is not None
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [f".{key}.othernode.1", key]


# ------------------------------------------------------------------ pre-tokenised corpora
def test_pretokenized_bin_npy_and_nanogpt_dir(tmp_path, tokenizer):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, 20_000).astype(np.uint16)
    ids.tofile(tmp_path / "corpus.bin")
    data = prepare_tokens(str(tmp_path / "corpus.bin"), tmp_path / "cache",
                          tokenizer_path=str(tokenizer), val_tokens=1000, val_fraction=0.01)
    assert len(data.val) == 1000 and data.meta["split"] == "tail"
    assert np.array_equal(np.concatenate([data.train, data.val]), ids)
    assert data.vocab_size == 300 and data.meta["pretokenized"] is True
    assert data.tokenizer_path.read_bytes() == tokenizer.read_bytes()
    again = prepare_tokens(str(tmp_path / "corpus.bin"), tmp_path / "cache",
                           tokenizer_path=str(tokenizer), val_tokens=1000, val_fraction=0.01)
    assert again.reused and again.cache_dir == data.cache_dir
    # A .npy of another integer dtype: stored as the tokenizer's dtype, same ids.
    np.save(tmp_path / "corpus.npy", ids.astype(np.int64))
    npy = prepare_tokens(str(tmp_path / "corpus.npy"), tmp_path / "cache",
                         tokenizer_path=str(tokenizer), val_tokens=1000, val_fraction=0.01)
    assert npy.train.dtype == np.uint16 and np.array_equal(npy.train, data.train)
    # nanoGPT's directory: the splits as given.
    nano = tmp_path / "shakespeare"
    nano.mkdir()
    ids[:15_000].tofile(nano / "train.bin")
    ids[15_000:].tofile(nano / "val.bin")
    given = prepare_tokens(str(nano), tmp_path / "cache", tokenizer_path=str(tokenizer))
    assert given.meta["split"] == "given"
    assert np.array_equal(given.train, ids[:15_000]) and np.array_equal(given.val, ids[15_000:])


@pytest.mark.parametrize("case, words", [
    ("odd.bin", ["odd.bin", "3 bytes", "not a whole number of uint16"]),
    ("empty.bin", ["empty.bin", "holds no token ids"]),
    ("float.npy", ["float.npy", "1-D float64", "integer token ids"]),
    ("matrix.npy", ["matrix.npy", "2-D", "1-D array of integer"]),
    ("big.bin", ["big.bin", "token id 300", "[0, 300)", "data.tokenizer"]),
    ("negative.npy", ["negative.npy", "token id -1", "[0, 300)"]),
    ("one.bin", ["1 token id(s)", "too small to split"]),
    ("no_tokenizer", ["data.tokenizer", "needs the tokenizer.json"]),
    ("mixed", ["must be the only entry", "got 2 entries"]),
])
def test_pretokenized_refusals(tmp_path, tokenizer, case, words):
    """Every refusal is one line naming the option, the file and what is allowed, and
    leaves no cache entry behind."""
    p = tmp_path / case
    spec: object = str(p)
    tok: str | None = str(tokenizer)
    if case == "odd.bin":
        p.write_bytes(b"abc")
    elif case == "empty.bin":
        p.write_bytes(b"")
    elif case == "float.npy":
        np.save(p, np.zeros(10))
    elif case == "matrix.npy":
        np.save(p, np.zeros((2, 5), dtype=np.int32))
    elif case == "big.bin":
        np.array([1, 2, 300, 4], dtype=np.uint16).tofile(p)
    elif case == "negative.npy":
        np.save(p, np.array([5, -1, 3], dtype=np.int32))
    elif case == "one.bin":
        np.array([7], dtype=np.uint16).tofile(p)
    elif case == "no_tokenizer":
        spec, tok = str(tmp_path / "ok.bin"), None
        np.arange(100, dtype=np.uint16).tofile(tmp_path / "ok.bin")
    elif case == "mixed":
        np.arange(100, dtype=np.uint16).tofile(tmp_path / "ok.bin")
        (tmp_path / "t.txt").write_text("some text")
        spec = [str(tmp_path / "ok.bin"), str(tmp_path / "t.txt")]
    with pytest.raises(ValueError) as info:
        prepare_tokens(spec, tmp_path / "cache", tokenizer_path=tok, val_tokens=1)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(("data.path:", "data.tokenizer:"))
    for w in words:
        assert w in msg, (w, msg)
    cache = tmp_path / "cache"
    assert not cache.exists() or not [d for d in cache.iterdir() if d.is_dir()]
    if case in ("odd.bin", "empty.bin", "float.npy", "matrix.npy", "mixed"):
        with pytest.raises(ValueError):  # the form is checked with the options, no reading
            parse_sources(spec)


# ------------------------------------------------------------------ the benchmark's pieces
def test_bench_corpus_and_tree_memory(tmp_path, monkeypatch):
    import editrain.bench.data as bench_data
    from editrain.bench.data import make_corpus, run_measured

    # A few sources instead of every installed package (seconds of directory walking):
    # 200 KB then needs several copies of them.
    sources = sorted(Path(bench_data.__file__).parent.glob("*.py"))[:6]
    monkeypatch.setattr(bench_data, "_source_files", lambda: sources)
    size = make_corpus(tmp_path / "c", 200_000)
    assert (tmp_path / "c" / "copy1").is_dir()
    files = list((tmp_path / "c").rglob("*.py"))
    assert size >= 200_000 and sum(f.stat().st_size for f in files) == size
    assert len({f.read_bytes() for f in files}) == len(files)  # no two files identical
    # A child holding 60 MB: the sampled tree peak sees it.
    r = run_measured([sys.executable, "-c", "import time; b = bytearray(60 << 20); "
                      "b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0); print(len(b))"])
    assert r["returncode"] == 0 and r["stdout"].strip() == str(60 << 20)
    assert r["peak_rss"] >= 60 << 20


def test_bench_data_judges_every_measure_by_its_fastest_round():
    """The limit and both builds get the same rule: the fastest round per token, every
    round's time on record, the worst peak; a failed round is passed over."""
    from editrain.bench.data import fastest

    def run(seconds, peak, tokens=1000):
        return {"ok": True, "seconds": seconds, "tokens": tokens, "peak_rss": peak,
                "cpu_seconds": seconds * 2}

    best = fastest([run(9.0, 100), run(8.0, 90), {"ok": False, "error": "killed"}])
    assert best["seconds"] == 8.0 and best["cpu_seconds"] == 16.0  # that round's numbers
    assert best["runs_seconds"] == [9.0, 8.0, None]
    assert best["peak_rss"] == 100  # memory: the worst round
    # per token: a round that encoded more tokens in more time can be the faster
    assert fastest([run(9.0, 1, tokens=1000), run(10.0, 1, tokens=1200)])["seconds"] == 10.0
    failed = [{"ok": False, "error": "a"}, {"ok": False, "error": "b"}]
    assert fastest(failed) == failed[0]


def test_bench_data_page_survives_a_measure_that_failed_every_round(tmp_path, monkeypatch):
    """The findings list every round's time, "failed" for each failed one, instead of the
    whole record being lost at the end of a long run; the scratch directory is removed
    when a measure raises, too."""
    from editrain.bench import data as bench_data
    from editrain.bench.runner import Bench
    from editrain.bench.scenario import execute

    def ok(seconds, tokens=1000):
        return {"ok": True, "seconds": seconds, "tokens": tokens, "peak_rss": 1 << 20,
                "cpu_seconds": seconds, "tokens_per_s": tokens / seconds,
                "build_seconds": seconds}

    failed = {"ok": False, "error": "exit status 1: boom"}
    limits, given = iter([ok(2.0), ok(1.0)]), iter([failed, ok(3.0)])
    monkeypatch.setenv(bench_data.SIZES_ENV, "300000")
    monkeypatch.setenv("EDITRAIN_BENCH_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(bench_data, "make_corpus", lambda root, size: size)
    monkeypatch.setattr(bench_data, "_seed_tokenizer", lambda corpus, out: out)
    monkeypatch.setattr(bench_data, "measure_limit", lambda *a: next(limits))
    monkeypatch.setattr(bench_data, "measure_build",
                        lambda corpus, cache, tok: failed if tok is None else next(given))
    record = execute(bench_data.SCENARIO, Bench("data", "tiny", tmp_path / "out"))
    assert record["findings"][0].endswith(
        "(every round, in s: limit 2.0 / 1.0, given tokenizer failed / 3.0, own BPE failed "
        "/ failed; the fastest of each is the one above)")
    assert (tmp_path / "out" / "table.md").is_file()
    assert not list(tmp_path.glob("editrain-bench-data-*"))  # the scratch directory

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(bench_data, "measure_limit", broken)
    with pytest.raises(OSError, match="disk full") as caught:
        execute(bench_data.SCENARIO, Bench("data", "tiny", tmp_path / "again"))
    # removed by the runner, not by the garbage collector: the error's traceback (held
    # here, as by any caller that reports it) still holds the runs' generator
    assert caught.tb is not None and not list(tmp_path.glob("editrain-bench-data-*"))
