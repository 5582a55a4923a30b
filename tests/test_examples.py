"""The examples run as a user would run them: under torchrun, 4 local processes, tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from editrain.spawn import free_port

# Each example is a 4-process torchrun job (about 10 s each): slow.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
            "--standalone"]
HELD_OUT = re.compile(r"held-out loss ([\d.]+) -> ([\d.]+) after (\d+) syncs")


def write_corpus(path: Path, lines: int = 3000) -> Path:
    """Pseudo-English text: enough structure for the loss to drop within a few dozen steps."""
    rng = random.Random(0)
    words = ("the of and to in is that for it as was with be by on not he this are or his "
             "from at which but have an they you were her she there one all we their been "
             "has when who will more no if out so said what up its about into than them can "
             "only other new some could time these two may then do first any my now").split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))).capitalize()
                     + "." for _ in range(lines))
    path.write_text(text)
    return path


def _run(cmd: list[str], **env: str) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", **env),
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc.stdout


def _check_learned(stdout: str) -> None:
    match = HELD_OUT.search(stdout)
    assert match, stdout
    first, last, syncs = float(match[1]), float(match[2]), int(match[3])
    assert last < first - 1.0, stdout  # the global model learned the Markov chain
    assert syncs >= 4


def test_custom_loop():
    _check_learned(_run(TORCHRUN + [str(EXAMPLES / "custom_loop.py"), "--tiny"]))


def test_ddp(tmp_path):
    """2 replicas x 2 DDP ranks with the optimizer wrapper; each rank saves its state."""
    _check_learned(_run(TORCHRUN + [str(EXAMPLES / "ddp.py"), "--tiny",
                                    "--save", str(tmp_path)]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.pt" for r in range(4)]


def test_tensor_parallel():
    """2 replicas x 1 shard x 2 tp ranks."""
    _check_learned(_run(TORCHRUN + [str(EXAMPLES / "tensor_parallel.py"), "--tiny"]))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install -e '.[hf]')")
def test_pipeline_parallel():
    """2 replicas x 2 pipeline stages (1F1B, 4 microbatches)."""
    _check_learned(_run(TORCHRUN + [str(EXAMPLES / "pipeline_parallel.py"), "--tiny"]))


def test_hf_llama():
    _check_learned(_run(TORCHRUN + [str(EXAMPLES / "hf_llama.py"), "--tiny"]))


def test_multi_node_script_single_node(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    run = tmp_path / "run"
    _run(["bash", str(EXAMPLES / "multi_node.sh"), "--steps", "12", "--quiet",
          "--model.preset", "tiny", "--data.path", str(corpus), "--data.vocab_size", "300",
          "--data.cache_dir", str(tmp_path / "cache"), "--train.seq_len", "32",
          "--train.batch_size", "4", "--train.eval_tokens", "1024", "--train.warmup_steps", "2",
          "--sync.local_sgd_sync_interval", "3", "--checkpoint.final", "false",
          "--run-dir", str(run)],
         NNODES="1", NPROC_PER_NODE="4", SHARD_SIZE="2", MASTER_PORT=str(free_port()),
         RUN_ID=f"test-{os.getpid()}", PYTHON=sys.executable)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["num_syncs"] >= 3
    assert (summary["replicas"], summary["shard_size"]) == (2, 2)
