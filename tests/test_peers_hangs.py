"""A peers run whose torchft workers hang: their stacks are dumped before the kill, the run
is tried once more, and both attempts stay on the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from editrain.bench import peers
from editrain.bench.results import render_page
from editrain.bench.runner import Bench, child_env


def _fake_attempts(errors: list[str | None]):
    """An ``_attempt`` that ends with ``errors`` in turn; a successful one writes the
    summary that makes a run ok, a failed one a worker log."""
    calls: list[Path] = []

    def attempt(run_dir, options, replicas, threads, timeout_s, system):
        calls.append(run_dir)
        run_dir.mkdir(parents=True)
        error = errors[len(calls) - 1]
        if error is None:
            (run_dir / "summary.json").write_text(json.dumps({"final_val_loss": 1.5}))
        else:
            (run_dir / "worker0.log").write_text(f"attempt {len(calls)}: Thread 0x1 ...\n")
        return error

    return attempt, calls


def _run(tmp_path, monkeypatch, errors, system="torchft"):
    attempt, calls = _fake_attempts(errors)
    monkeypatch.setattr(peers, "_attempt", attempt)
    bench = Bench("peers", "tiny", tmp_path)
    run = peers.run_torchft(bench, "torchft-diloco-r0", {}, 2, 1, 5.0, "torchft", system)
    return bench, run, calls


def test_a_hung_torchft_run_is_run_again_and_the_hang_is_kept(tmp_path, monkeypatch):
    hang = f"{peers.TIMED_OUT} within 5 s (killed); worker 1 after step 4"
    bench, run, calls = _run(tmp_path, monkeypatch, [hang, None])
    assert len(calls) == 2 and run.ok and run.final_val_loss == 1.5
    kept = tmp_path / "runs" / "torchft-diloco-r0.attempt1"
    assert run.retried == [f"{hang} (kept in {kept})"]
    assert (kept / "worker0.log").read_text().startswith("attempt 1:")  # the hang's logs
    assert not (run.run_dir / "worker0.log").exists()  # the second attempt started clean
    record = bench.finish(settings={}, methods=["torchft-diloco"], results={}, tables=[])
    assert record["runs"]["torchft-diloco-r0"]["retried"] == run.retried
    page = render_page(record)
    assert "## Runs run again" in page and hang in page and "## Failed runs" not in page


def test_a_second_hang_fails_the_run(tmp_path, monkeypatch):
    hang = f"{peers.TIMED_OUT} within 5 s (killed); worker 0 after step 0"
    bench, run, calls = _run(tmp_path, monkeypatch, [hang, hang, None])
    assert len(calls) == 2 and not run.ok and run.error == hang and len(run.retried) == 1
    page = render_page(bench.finish(settings={}, methods=["x"], results={}, tables=[]))
    assert "## Failed runs" in page and "## Runs run again" in page


@pytest.mark.parametrize("system, error", [
    ("torchft", "torchft worker 1: exit status 1: ValueError: bad"),  # a crash: not a hang
    ("library", f"{peers.TIMED_OUT} within 5 s (killed); worker 0 after step 0"),
])
def test_only_a_hung_torchft_run_is_run_again(tmp_path, monkeypatch, system, error):
    """editrain's own runs (the library system) and crashes are never hidden by a retry."""
    _, run, calls = _run(tmp_path, monkeypatch, [error, None], system)
    assert len(calls) == 1 and not run.ok and run.error == error and run.retried == []


def test_hung_workers_write_their_stacks_before_they_are_killed(tmp_path):
    """A real torchft_peer process (the lighthouse: it only sleeps) gets SIGUSR1 from
    _timed_out and writes every thread's stack to its log; the error names it."""
    pytest.importorskip("torchft", reason="torchft not installed (pip install torchft)")
    log = tmp_path / "worker0.log"
    proc = peers._peer(["--serve-lighthouse", "[::]:0", "--replicas", "2"], log, child_env(1))
    try:
        peers._lighthouse_address(log, proc, 60.0)  # faulthandler is registered by now
        error = peers._timed_out([proc], tmp_path, 1.0)
        assert proc.poll() is None  # still running: the signal only dumped its stacks
    finally:
        proc.kill()
        proc.wait()
    assert error.startswith(f"{peers.TIMED_OUT} within 1 s (killed); worker 0 after step 0")
    assert str(log) in error
    text = log.read_text()
    assert "most recent call first" in text and "serve_lighthouse" in text, text


def test_the_last_logged_step_survives_a_line_cut_by_the_kill(tmp_path):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    (ranks / "rank1.jsonl").write_text('{"step": 3}\n{"step": 4}\n{"ste')
    assert peers._last_step(tmp_path, 1) == 4
    assert peers._last_step(tmp_path, 0) == 0  # nothing logged yet
