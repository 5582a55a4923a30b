"""A local launch starts the workers' fork server before it imports torch itself.

The server imports torch and editrain (seconds of CPU); the launcher needs torch too (its
data stage, torch elastic). Started first, the server imports on one core while the
launcher imports on the other; started after the launcher's own imports, the two came one
after the other. These tests run the launcher in a fresh interpreter (torch not yet
imported) and record, at the moment the server would start, what it had imported; the last
one records what it had imported when torch elastic starts the workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_DRIVER = textwrap.dedent("""
    import json, sys

    import editrain.launch as launch
    from editrain.cli import config_from_args, build_parser

    seen = {}

    class Stop(Exception):
        pass

    def record_then_stop():
        seen["torch_imported"] = "torch" in sys.modules
        raise Stop

    # Only the test replaces the server's start: the launcher calls it by this name.
    launch.start_worker_server = record_then_stop
    args, extra = build_parser().parse_known_args(["train"] + sys.argv[1:])
    cfg = config_from_args(args, extra, "train")
    try:
        launch.run_local(cfg)
    except Stop:
        pass
    seen["server_stopped_after"] = True
    print(json.dumps(seen))
""")


def _launch_until_the_server_starts(*options: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _DRIVER, *options], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_fork_server_starts_before_the_launcher_imports_torch(tmp_path):
    seen = _launch_until_the_server_starts(
        "--run-dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "cache"),
        "--model.preset", "tiny", "--dist.nproc", "2", "--dist.shard_size", "1")
    assert seen == {"torch_imported": False, "server_stopped_after": True}


def test_a_refused_run_directory_starts_no_server(tmp_path):
    # A run directory that is a file is refused before any process starts.
    run = tmp_path / "run"
    run.write_text("not a directory")
    out = subprocess.run([sys.executable, "-c", _DRIVER, "--run-dir", str(run),
                          "--data.cache_dir", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "torch_imported" not in out.stdout
    assert "run_dir" in out.stderr and str(run) in out.stderr


_AT_LAUNCH = textwrap.dedent("""
    import json, sys

    import torch.distributed.launcher.api as elastic_api

    from editrain.cli import build_parser, config_from_args
    from editrain.launch import run_local

    seen = {}

    class Stop(Exception):
        pass

    def record_then_stop(config, entrypoint):
        seen["imported"] = sorted(m for m in ("editrain.train", "torch.distributed.fsdp",
                                              "torch.distributed.tensor") if m in sys.modules)
        seen["entry"] = entrypoint.__module__
        raise Stop

    # Only the test replaces torch elastic's launch: the launcher looks it up by this name.
    elastic_api.elastic_launch = record_then_stop
    args, extra = build_parser().parse_known_args(["train"] + sys.argv[1:])
    try:
        run_local(config_from_args(args, extra, "train"))
    except Stop:
        pass
    print(json.dumps(seen))
""")


def test_the_launcher_leaves_the_trainer_to_the_workers(tmp_path):
    # The workers are forked from a server that has imported the trainer (FSDP2, DTensor);
    # the launcher itself only resolves the configuration and starts them: importing the
    # trainer there cost about a second before the first worker started.
    out = subprocess.run([sys.executable, "-c", _AT_LAUNCH, "--run-dir", str(tmp_path / "run"),
                          "--data.cache_dir", str(tmp_path / "cache"), "--model.preset", "tiny",
                          "--dist.nproc", "2", "--dist.shard_size", "1",
                          "--data.max_bytes", "300000", "--data.vocab_size", "512",
                          "--data.val_tokens", "4096"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"imported": [], "entry": "editrain.launch.elastic"}
