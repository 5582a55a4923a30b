"""examples/slurm/train.sbatch run as sbatch would run it, on one node, with stand-ins for
``srun`` and ``scontrol`` (no SLURM here): the stand-in srun runs its command once, as the
one task of a one-node allocation, and logs how it was called."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from editrain.spawn import free_port
from tests.test_examples import write_corpus

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"

SRUN = """#!/usr/bin/env bash
# Stand-in srun: log the call, drop srun's own options, run the command as task 0 of node 0.
echo "srun $*" >> "$STANDIN_LOG"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
export SLURM_PROCID=0 SLURM_NODEID=0 SLURM_LOCALID=0
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
# Stand-in scontrol: `scontrol show hostnames LIST` prints this machine's loopback address.
echo "scontrol $*" >> "$STANDIN_LOG"
[ "$1 $2" = "show hostnames" ] && echo 127.0.0.1
"""
FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$STANDIN_LOG"
"""


def _stand_ins(bin_dir: Path, scontrol: bool = True, python: bool = False) -> None:
    bin_dir.mkdir()
    files = {"srun": SRUN}
    if scontrol:
        files["scontrol"] = SCONTROL
    if python:
        files["python"] = FAKE_PYTHON
    for name, text in files.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def _sbatch(tmp_path: Path, args: list[str], bin_dir: Path, **env: str
            ) -> subprocess.CompletedProcess:
    full = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{bin_dir}:{os.environ['PATH']}",
                STANDIN_LOG=str(tmp_path / "calls.log"), SLURM_SUBMIT_DIR=str(tmp_path),
                SLURM_JOB_NAME="editrain", **env)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=full,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(400)  # a 4-process torchrun job: about 15 s alone, minutes on a busy box
def test_sbatch_trains_on_one_node_with_a_stand_in_srun(tmp_path):
    """A tiny train, 2 replicas x 2 shards on 4 local processes, through srun -> torchrun
    (c10d rendezvous at the host scontrol named) -> editrain train; the batch step built the
    token cache once on the shared storage, which the workers then reused."""
    _stand_ins(tmp_path / "bin")
    corpus = write_corpus(tmp_path / "corpus.txt")
    port = free_port()
    proc = _sbatch(tmp_path, [
        "--steps", "12", "--quiet", "--model.preset", "tiny", "--data.path", str(corpus),
        "--data.vocab_size", "300", "--train.seq_len", "32", "--train.batch_size", "4",
        "--train.eval_tokens", "1024", "--train.warmup_steps", "2",
        "--sync.local_sgd_sync_interval", "3", "--checkpoint.final", "false"],
        tmp_path / "bin", SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_JOB_NODELIST="node[01]",
        NPROC_PER_NODE="4", SHARD_SIZE="2", MASTER_PORT=str(port), PYTHON=sys.executable)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    run = tmp_path / "runs" / "editrain-4242"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["num_syncs"] >= 3
    assert (summary["replicas"], summary["shard_size"]) == (2, 2)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0] == "scontrol show hostnames node[01]"
    srun = calls[1]
    assert srun.startswith("srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 ")
    assert f"--nnodes 1 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint " \
           f"127.0.0.1:{port} --rdzv-id editrain-4242" in srun
    # One cache entry on the shared storage, complete, built before the workers started.
    entries = [p for p in (tmp_path / "runs" / "token_cache").iterdir() if p.is_dir()]
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()


def _fallback_call(tmp_path: Path, nodelist: str) -> str:
    """The srun line of a job whose machine has no scontrol (fake python: nothing runs)."""
    tmp_path.mkdir()
    _stand_ins(tmp_path / "bin", scontrol=False, python=True)
    # bash, head, mkdir and hostname must still be found, scontrol must not.
    assert shutil.which("scontrol", path=os.environ["PATH"]) is None
    proc = _sbatch(tmp_path, ["--steps", "3"], tmp_path / "bin", SLURM_JOB_ID="7",
                   SLURM_NNODES="2", SLURM_JOB_NODELIST=nodelist, NPROC_PER_NODE="8",
                   PYTHON="python")
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    # editrain data first (tokenise once, here), then one torchrun per node through srun.
    assert calls[0] == (f"python -m editrain data --data.cache_dir {tmp_path}/runs/token_cache"
                        " --steps 3")
    assert calls[1].startswith("srun --nodes=2 --ntasks-per-node=1 ")
    assert calls[1].endswith(f"--dist.shard_size 8 --run-dir {tmp_path}/runs/editrain-7 "
                             f"--data.cache_dir {tmp_path}/runs/token_cache --steps 3")
    return calls[1]


def test_sbatch_master_address_without_scontrol(tmp_path):
    """Without scontrol a one-host node list is the rendezvous host; a compressed list
    (which only scontrol expands) falls back to the host running the batch script."""
    call = _fallback_call(tmp_path / "one", "gpu-node-7")
    assert "--rdzv-endpoint gpu-node-7:29500 " in call and "--nnodes 2 " in call
    call = _fallback_call(tmp_path / "many", "gpu-node-[1-2]")
    assert f"--rdzv-endpoint {socket.gethostname()}:29500 " in call


def test_sbatch_outside_slurm_is_refused(tmp_path):
    _stand_ins(tmp_path / "bin", python=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(env, PATH=f"{tmp_path / 'bin'}:{env['PATH']}",
                                   STANDIN_LOG=str(tmp_path / "calls.log")), timeout=60)
    assert proc.returncode != 0
    assert "run this script with sbatch" in proc.stderr
    assert not (tmp_path / "calls.log").exists()  # nothing was started
