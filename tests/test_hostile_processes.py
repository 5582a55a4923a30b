"""Issue 48, class 10: processes. Ctrl-C while the command is still importing ends with exit
130 and one line; the fork server does not outlive a launcher that refuses its input; the
library API's engine destroys its own process groups when it closes, so that gloo's teardown
does not abort a job that finished (``terminate called without an active exception``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).with_name("editrain")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
                        "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.serial
@pytest.mark.parametrize("entry", ["script", "module"])
def test_sigint_while_importing_exits_130_in_one_line(entry, tmp_path):
    """The issue's example (SIGINT 1.5 s after start) and an earlier one: the console script
    and ``python -m editrain`` install their handler before importing torch. (Before the
    interpreter has run editrain's first line, a tenth of a second on an idle machine,
    Python's own handler is all there is.)"""
    command = [str(BIN)] if entry == "script" else [sys.executable, "-m", "editrain"]
    for delay in (1.0, 1.5):
        proc = subprocess.Popen([*command, "train", "--steps", "1", "--nproc", "1",
                                 "--shard-size", "1", "--run-dir", str(tmp_path / f"r{delay}")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env(), cwd=tmp_path, start_new_session=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        where = f"{entry} at {delay} s: exit {proc.returncode}\n{err[-2000:]}"
        assert proc.returncode == 130, where
        assert err.strip().splitlines()[-1] == "editrain: interrupted", where
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, where


def _python(code: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_stop_worker_server_ends_a_server_still_importing():
    """The launcher starts the fork server early (it imports torch while the data is
    prepared); a launcher that refuses its input stops it at once instead of leaving it to
    finish its imports (5 to 9 s) before it notices."""
    out = _python(
        "import os, time\n"
        "from multiprocessing import forkserver\n"
        "from editrain.spawn import start_worker_server, stop_worker_server\n"
        "start_worker_server()\n"
        "pid = forkserver._forkserver._forkserver_pid\n"
        "t = time.monotonic()\n"
        "stop_worker_server()\n"
        "print(pid is not None, os.path.exists(f'/proc/{pid}'), time.monotonic() - t)\n")
    started, alive, seconds = out.split()
    assert started == "True" and alive == "False", out
    assert float(seconds) < 2.0, out


def _forkservers_in_session(sid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.getsid(int(name)) != sid:
                continue
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmd:
            found.append(int(name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_launcher_that_refuses_its_input_leaves_no_fork_server(tmp_path, data_cache):
    """A corpus too small for the world size is found after the fork server started: the
    launcher exits 2, and no fork server of its session is left."""
    small = tmp_path / "small.txt"
    small.write_text("hello world. " * 40)
    proc = subprocess.Popen(
        [str(BIN), "train", "--data.path", str(small), "--data.cache_dir", str(data_cache),
         "--model.preset", "tiny", "--data.vocab_size", "300", "--run-dir",
         str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
        start_new_session=True)
    _, err = proc.communicate(timeout=280)
    assert proc.returncode == 2 and "corpus too small" in err, err[-2000:]
    left = _forkservers_in_session(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"fork server(s) {left} outlived the launcher"


def _rank_closes_engine(rank: int, world: int) -> list[bool]:
    """A rank of a 2-replica (4-rank) run: an engine's own groups are destroyed by close(),
    which may be called again."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import editrain

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    info = editrain.init_mesh(shard_size=2, device_type="cpu", keep_freed_memory=False)
    torch.manual_seed(0)
    model = Tiny()
    editrain.parallelize(model, info, blocks=model.layers)
    config = editrain.SyncConfig(method="diloco", local_sgd_sync_interval=1)
    with editrain.edit(model, info, config, blocks=model.layers) as engine:
        own = list(engine.groups.own)
        model(torch.ones(2, 4)).sum().backward()
        engine.step()
    known = [g in dist.distributed_c10d._world.pg_map for g in own]
    engine.close()  # again: nothing more
    return [bool(own), *known, engine.groups.own == []]


def test_engine_close_destroys_its_own_groups():
    from editrain.spawn import run_ranks

    for out in run_ranks(_rank_closes_engine, 4):
        assert out[0] and not any(out[1:-1]) and out[-1], out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo teardown on Linux")
def test_library_api_loop_under_torchrun_exits_0():
    """The issue's case: a 2-process diloco loop of ``editrain.edit`` under torchrun (gloo)
    that closes the engine and calls ``editrain.shutdown()``; two consecutive runs end with
    exit 0 (``scripts/api_exit_runs.sh`` runs 50: an abort came in about 1 run of 6)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    for i in range(2):
        proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                               str(ROOT / "examples" / "custom_loop.py"), "--tiny",
                               "--method", "diloco", "--shard-size", "1"],
                              capture_output=True, text=True, env=_env(), cwd=ROOT,
                              timeout=280)
        assert proc.returncode == 0, f"run {i}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        assert "terminate called" not in proc.stderr and "held-out loss" in proc.stdout
