"""A run directory appended to by several jobs, read back: ``--resume RUN`` continues with the
latest job's settings, ``editrain plan --calibrate`` measures the latest job only, with the
vocabulary the tokenizer really has, and each job's last line says what its time counts.

One run (the brief's case): 2 replicas for 12 steps, then resumed elastically on 1 replica
to step 28 (``resumed``); a corpus of few distinct words, on which the trained BPE has far
fewer tokens than the 512 asked for. Real CLI (``tests.cli.run_cli``), tiny model, gloo.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from editrain import rundir
from editrain.config.toml_io import load_resumed_config
from editrain.plan.calibrate import calibrate, job_rows
from tests.cli import run_cli

pytestmark = pytest.mark.slow  # three to four short training jobs

WORDS = "the cat sat on a mat and dog ran to big red house with small blue door".split()


def write_corpus(folder: Path) -> Path:
    """Twelve documents of sentences over 17 words: a BPE of 512 tokens asked for stops
    far below (about 310: the bytes, the words and their merges are all there is)."""
    folder.mkdir()
    rng = random.Random(0)
    for d in range(12):
        lines = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(80)]
        (folder / f"doc{d}.txt").write_text("\n".join(lines) + "\n")
    return folder


def train(*args: str) -> subprocess.CompletedProcess:
    out = run_cli(["train", *args, "--quiet"], env=dict(os.environ, OMP_NUM_THREADS="1"),
                  timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, data_cache) -> tuple[Path, list[str]]:
    """``(run directory, each job's output)``: 12 steps on 2 replicas (diloco, a sync every
    4 steps, a checkpoint at each), then ``--resume RUN --nproc 1 --steps 28``."""
    root = tmp_path_factory.mktemp("resumed")
    corpus = write_corpus(root / "corpus")
    run = root / "run"
    first = train("--model.preset", "tiny", "--data.path", str(corpus), "--data.vocab_size",
                  "512", "--data.cache_dir", str(data_cache), "--train.batch_size", "4",
                  "--train.seq_len", "32", "--train.eval_tokens", "1024",
                  "--train.final_eval_tokens", "1024", "--nproc", "2", "--shard-size", "1",
                  "--steps", "12", "--method", "diloco", "--sync.local_sgd_sync_interval",
                  "4", "--checkpoint.every", "4", "--run-dir", str(run))
    second = train("--resume", str(run), "--nproc", "1", "--steps", "28")
    return run, [first.stdout + first.stderr, second.stdout + second.stderr]


def test_calibrate_reads_the_latest_jobs_settings_rows_and_vocabulary(resumed):
    """Before, calibrate read the first job's config.toml (2 replicas), every rank file
    raw (replica 1's steps of the first job beside replica 0's of both: a straggler spread
    of a replica the latest job does not have) and the configured vocabulary (512)."""
    run, _ = resumed
    start, rows, ranks = job_rows(run, 1)
    assert start == 12 and [r["step"] for r in rows if "loss" in r] == list(range(13, 29))
    assert sorted(ranks) == [0] and [r["step"] for r in ranks[0]] == list(range(13, 29))
    cal = calibrate([run])
    (sample,) = cal.samples
    assert (sample.replicas, cal.cluster().nodes) == (1, 1)
    # one replica: its busy time over its own, exactly
    assert sample.factors == [1.0] and cal.straggler_spread == 0.0
    from tokenizers import Tokenizer

    real = Tokenizer.from_file(str(run / "tokenizer" / "tokenizer.json")).get_vocab_size()
    assert real < 512
    assert json.loads((run / "summary.json").read_text())["vocab_size"] == real
    assert sample.model.vocab_size == real and f"vocab_size = {real}\n" in cal.to_toml()


def test_a_plain_resume_continues_with_the_latest_jobs_settings(resumed, tmp_path):
    """config.toml stayed the first job's: a plain --resume went back to 2 replicas (an
    elastic resume) and 12 steps. Now it is the latest job's; the record keeps what each
    job changed. (On a copy of the run: the others read it as the fixture left it.)"""
    src, _ = resumed
    run = tmp_path / "run"
    shutil.copytree(src, run)
    cfg, _ = load_resumed_config(str(run), {"resume": str(run)})
    assert (cfg.dist.nproc, cfg.train.steps) == (1, 28)
    out = train("--resume", str(run), "--steps", "32")
    said = out.stdout + out.stderr
    assert "resumed exactly" in said and "elastic resume" not in said
    history = rundir.read_record(run).history
    assert history[-2]["config_changed"] == {"dist.nproc": "2 -> 1", "train.steps": "12 -> 28"}
    assert "config_before" not in history[-2]  # the changes, not the old file's text
    assert history[-1]["config_changed"] == {"train.steps": "28 -> 32"}
    cfg, _ = load_resumed_config(str(run), {"resume": str(run)})
    assert (cfg.dist.nproc, cfg.train.steps) == (1, 32)


DONE = re.compile(r"done: (\d+) steps, .*?, ([\d.]+) s training(?: over the run's jobs, "
                  r"([\d.]+) s in this one)?, ([\d.]+) s end to end, ")


def test_the_done_line_says_what_its_times_count(resumed):
    """Before: "done: 12 steps, ..., 0.2 s, ..." for a command of about 3 s. The run's
    clock (summary.json's wall_time_s) is called training; beside it the command's own
    time, and after a resume this job's part of the clock."""
    run, outputs = resumed
    first, second = (DONE.search(o) for o in outputs)
    assert first is not None and second is not None, outputs
    assert first[1] == "12" and first[3] is None
    assert second[1] == "28" and second[3] is not None
    summary = json.loads((run / "summary.json").read_text())
    assert float(second[2]) == pytest.approx(summary["wall_time_s"], abs=0.05)  # printed .1f
    # Not a rounding: the command started before its clock (class 5: it also starts the
    # interpreter's work, reads the data and starts the workers, seconds here)
    assert float(first[4]) > float(first[2])
    assert float(second[4]) > float(second[3]) and float(second[2]) > float(second[3])
