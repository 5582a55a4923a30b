"""The compact per-sync log line, how metrics.jsonl reaches the disk, and when the loop
evaluates and checkpoints next."""

import pytest

from editrain.train import next_after, one_replica_note, sync_summary, times_said


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


def test_sync_summary_says_a_fault_tolerant_round_that_synced_nothing_is_no_sync() -> None:
    """With --ft the log has a line for every round, the ones that did not commit and the
    closing one where nobody trained included: only the rounds that synced say "sync", so
    the lines that do count the syncs that happened; the others name their round index
    (metrics.jsonl's) and a failure its error."""
    base = {"step": 8, "wait_s": 0.0, "comm_time_s": 0.001, "bytes_sent": 0}
    assert sync_summary({**base, "sync": 3, "committed": True, "units": 3}).startswith(
        "sync 3 @step 8: ")
    failed = sync_summary({**base, "sync": 4, "committed": False, "units": 3,
                           "error": "cross-replica all-reduce failed"})
    assert failed.startswith("round 4 not committed @step 8: ")
    assert failed.endswith("; error: cross-replica all-reduce failed")
    assert sync_summary({**base, "sync": 5, "committed": True, "units": 0}).startswith(
        "round 5 (nothing to sync) @step 8: ")


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


def test_a_healed_replica_writes_its_job_start_before_its_ft_join_row() -> None:
    """A replica group that heals in its first quorum (it restarted while the others
    trained on) starts its rows in metrics.jsonl with the job's start event, then the
    ``ft_join`` event, both at the step it healed to. Readers take the job's start as the
    boundary of its rows (editrain.metrics.latest_job); before, the join's row was written
    first and counted among the earlier job's rows."""
    from types import SimpleNamespace

    from editrain.metrics import JOB_START, latest_job
    from editrain.train import Trainer

    written: list[dict] = []
    trainer = Trainer.__new__(Trainer)  # (its parts faked: no model, no process group)

    class Loop(SimpleNamespace):
        def skip_due(self, *args) -> None:
            pass

        def wall(self) -> float:
            return 1.5

    class Engine:
        def join(self, start_quorum, timeout_s, between_attempts=None) -> bool:
            loop.step, loop.healed_at = 12, 12  # healed: the peers' step
            return True

        def pop_sync_log(self) -> list[dict]:
            return [{"sync": 4, "committed": True, "healed": True}]

    loop = Loop(step=0, healed_at=None, replays=None)
    trainer.__dict__.update(
        loop=loop, engine=Engine(), ft=True, is_logger=True, replica=2, replicas=3,
        run_end_watch=None,
        cfg=SimpleNamespace(dist=SimpleNamespace(ft_join_timeout_s=60.0),
                            train=SimpleNamespace(eval_every=0),
                            checkpoint=SimpleNamespace(every=0)),
        rank_log=SimpleNamespace(write=lambda row: None),
        metrics=SimpleNamespace(write=written.append))
    trainer._log_start = lambda: None
    trainer._tokens = lambda: 3072
    val = trainer._begin()
    assert val != val  # NaN: a healed replica's curve goes on from the peers'
    assert [(r.get("event"), r["step"]) for r in written] == [(JOB_START, 12), ("ft_join", 12)]
    assert written[1]["sync"]["sync"] == 4 and written[1]["replica"] == 2
    assert latest_job(written) == (12, [written[1]])


@pytest.mark.parametrize("method", ["post_local_sgd", "diloco", "edit", "aedit"])
def test_a_local_sgd_method_on_one_replica_is_said(method) -> None:
    """``--method edit --nproc 2`` at the default shard size is one replica of two shards:
    its syncs average nothing, which nothing in the output said before."""
    note = one_replica_note(method, 1, ft=False)
    assert note is not None and f'sync.method = "{method}" on one replica' in note
    assert "a smaller --shard-size or a larger --nproc makes more" in note
    assert "dist.ft_replicas" in one_replica_note(method, 1, ft=True)
    assert one_replica_note(method, 2, ft=False) is None
    assert one_replica_note("sync", 1, ft=False) is None  # synchronous: nothing is expected
