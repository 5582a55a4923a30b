"""Process setup of one worker: signals, threads, glibc malloc, logging, device and mesh.

A worker calls :func:`setup_process` first thing (its process dies with its parent, Ctrl-C
ends it quietly, intra-op threads and malloc are set), then :func:`init_distributed` for
its device and process groups. Seeding is not global: the model is built from
``train.seed`` and the data order, the engine and the simulated stalls each draw from
their own seeded generators.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

import torch

from editrain.malloc import keep_freed_memory
from editrain.spawn import worker_threads
from editrain.topology import MeshInfo, init_mesh


def setup_process(cfg: Any) -> None:
    """Set up a worker process: it dies with the process that started it (also one killed
    with SIGKILL), ends quietly on SIGINT, runs :func:`~editrain.spawn.worker_threads` intra-op threads,
    keeps freed memory (:func:`keep_freed_memory`) and logs warnings as bare lines.

    Args:
        cfg: the run's configuration (``dist.threads_per_proc``).
    """
    from editrain.spawn import die_with_parent, sigint_ends_quietly

    die_with_parent()
    sigint_ends_quietly()
    torch.set_num_threads(worker_threads(cfg))
    keep_freed_memory()
    # A worker of editrain's launcher starts with its own logging (a process forked from
    # one with handlers would keep them); under torchrun the worker is the command itself
    # and keeps what it set up.
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        force=multiprocessing.parent_process() is not None)


def init_distributed(cfg: Any) -> MeshInfo:
    """The default process group and the mesh of ``cfg.dist`` (``device`` and ``backend``
    ``"auto"``: chosen from the hardware; see :func:`editrain.topology.init_mesh`)."""
    d = cfg.dist
    return init_mesh(d.shard_size, backend=None if d.backend == "auto" else d.backend,
                     device_type=None if d.device == "auto" else d.device,
                     tp_size=d.tp_size, pp_size=d.pp_size)
