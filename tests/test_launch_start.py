"""A local launch starts the workers' fork server before it imports torch itself.

The server imports torch and editrain (seconds of CPU); the launcher needs torch too (its
data stage, torch elastic). Started first, the server imports on one core while the
launcher imports on the other; started after the launcher's own imports, the two came one
after the other. These tests run the launcher in a fresh interpreter (torch not yet
imported) and record, at the moment the server would start, what it had imported.
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
