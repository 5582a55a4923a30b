"""The compact per-sync log line, how metrics.jsonl reaches the disk, and when the loop
evaluates and checkpoints next."""

from editrain.train import next_after, sync_summary, times_said


def test_sync_summary_names_weights_outliers_and_clipping() -> None:
    entry = {"sync": 3, "step": 40, "wait_s": 0.012, "comm_time_s": 0.05,
             "bytes_sent": 2 * 2**20, "replica_steps": [3.0, 5.0],
             "weights": [[0.0, 0.5], [1.0, 0.5]], "outlier": [[True, False], [False, False]],
             "clip": [1.0, 0.25]}
    line = sync_summary(entry)
    assert line.startswith("sync 3 @step 40: waited 12 ms, comm 50 ms, 2.00 MiB sent")
    assert "steps 3/5" in line
    assert "weights 0.25 0.75" in line
    assert "outliers r0:1" in line
    assert "clipped 1 units (min x0.25)" in line


def test_sync_summary_without_penalty_fields() -> None:
    line = sync_summary({"sync": 0, "step": 10, "wait_s": 0.0, "comm_time_s": 0.001,
                         "bytes_sent": 0})
    assert line == "sync 0 @step 10: waited 0 ms, comm 1 ms, 0.00 MiB sent"


def test_sync_summary_names_a_fragment_and_a_launch_where_the_round_has_them() -> None:
    """A streaming run's end syncs a fragment at once (no launch step): its line names the
    fragment. Before, the line needed both and raised KeyError on it, once the end's
    rounds were logged."""
    base = {"step": 12, "wait_s": 0.0, "comm_time_s": 0.001, "bytes_sent": 0}
    assert sync_summary({**base, "sync": 6, "fragment": 0}).startswith(
        "sync 6 (fragment 0) @step 12: ")
    assert sync_summary({**base, "sync": 5, "fragment": 1, "launch_step": 12}).startswith(
        "sync 5 (fragment 1, launched @step 12) @step 12: ")
    assert sync_summary({**base, "sync": 4, "launch_step": 11}).startswith(
        "sync 4 (launched @step 11) @step 12: ")


def test_metrics_rows_are_flushed_at_once_and_fsynced_rarely(tmp_path, monkeypatch) -> None:
    """Every row reaches the file at once (a killed worker loses at most the row it was
    writing), but fsync runs at most every fsync_every_s and on close, not at every step."""
    import os

    from editrain.metrics import MetricsWriter, read_metrics

    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    writer = MetricsWriter(tmp_path, tensorboard=False, fsync_every_s=3600.0)
    for step in range(1, 51):
        writer.write({"step": step, "loss": 1.0 / step})
        assert [r["step"] for r in read_metrics(tmp_path)][-1] == step  # visible already
    assert calls == []
    writer.close()
    assert len(calls) == 1
    every = MetricsWriter(tmp_path, tensorboard=False, fsync_every_s=0.0)
    every.write({"step": 51})
    every.write({"step": 52})
    assert len(calls) == 3
    every.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 53))


def test_next_evaluation_or_checkpoint_is_past_the_sync_point() -> None:
    assert next_after(10, 10, 10) == 20  # taken at 10: the next is at 20
    assert next_after(10, 25.5, 10) == 30  # a sync point past several due ones (A-EDiT)
    assert next_after(30, 25.5, 10) == 30  # not due yet
    assert next_after(0, 12, 0) == 0  # never (every 0)


def test_the_done_lines_times_say_what_they_count() -> None:
    """The run's clock of its training loop is called training; the command's own time
    beside it where known (not from a library call); a resumed run's clock holds its
    earlier jobs' too, so this job's part is given."""
    assert times_said(0.24, 0.24, False, 3.41) == "0.2 s training, 3.4 s end to end"
    assert times_said(0.24, 0.24, False, None) == "0.2 s training"
    assert times_said(1.32, 0.41, True, 9.8) == \
        "1.3 s training over the run's jobs, 0.4 s in this one, 9.8 s end to end"
