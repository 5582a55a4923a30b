"""The data stage of a launch: the corpus tokenised once for every worker, the resume checked.

The checkpoint to resume is checked against the tokens before anything is written.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from editrain.corpus import prepare_data
from editrain.launch.job import Job

log = logging.getLogger("editrain")


def prepare_job_data(job: Job) -> Any:
    """The job's tokens (``TokenData``: its ``cache_dir`` is handed to every worker), with
    the windows every worker will cut checked, and ``--resume``'s checkpoint(s) preflighted
    against them (:func:`editrain.checkpoint.preflight_resume`; one per replica group of a
    fault-tolerant run).

    Raises:
        ValueError: the corpus is too small for the batches (one line naming the option).
        CheckpointError: the checkpoint does not fit this run, or is incomplete.
    """
    cfg = job.cfg
    data = _pretokenise(job)
    if cfg.resume:
        from editrain.checkpoint import preflight_resume

        if job.ft:
            from editrain.fault import replica_run_dir

            for r in range(job.groups):
                preflight_resume(replica_run_dir(cfg.resume, r), cfg, data.vocab_size, data)
        else:
            preflight_resume(cfg.resume, cfg, data.vocab_size, data)
    return data


def _pretokenise(job: Job) -> Any:
    from editrain.data import SequenceStream, check_batch_size, eval_batches

    cfg = job.cfg
    t0 = time.perf_counter()
    data = prepare_data(cfg)
    # The windows every worker will cut; a too-small corpus or a batch larger than a
    # rank's share (the sampler would loop over epochs to fill it) fails here, not in the
    # workers. Data ranks: every replica's shards (tensor-parallel peers and the stages of
    # a pipeline read alike).
    t = cfg.train
    data_world = job.world // (cfg.dist.tp_size * cfg.dist.pp_size)
    SequenceStream(data.train, t.seq_len, 0, data_world, t.seed)
    check_batch_size(data.train, t.seq_len, t.batch_size, data_world)
    eval_batches(data.val[: 2 * t.seq_len + 2], t.seq_len, t.batch_size, 0, data_world)
    how = "reused cache" if data.reused else f"built in {time.perf_counter() - t0:.1f} s"
    if not cfg.quiet:
        log.info("data: %d train / %d val tokens, vocab %d (%s: %s)", len(data.train),
                 len(data.val), data.vocab_size, how, data.cache_dir)
    return data  # the resume preflight compares its token stream with the checkpoint's
