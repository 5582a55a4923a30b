"""Local multi-process helpers: a free loopback port, and a function run on N spawned ranks.

``free_port`` is what the launcher's rendezvous, the tests and the benchmarks bind to;
``run_ranks`` runs ``fn(rank, world_size, *args)`` in ``world_size`` freshly spawned processes
that share a default process group, and returns what each rank's call returned::

    results = run_ranks(measure, 4, "tiny")   # [measure(0, 4, "tiny"), ..., measure(3, ...)]
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now.

    Another process may take it before it is bound again, which is rare enough for local
    jobs; a rendezvous that fails on it reports the port.
    """
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str,
                out_dir: str, args: tuple) -> None:
    """One spawned rank: join the process group, run ``fn``, save its result."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        torch.save(out, Path(out_dir) / f"{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned local processes.

    Each process has the default process group initialised (``backend``, over a free
    loopback port) and one CPU thread; an exception in any rank is raised here.

    Args:
        fn: a module-level function (it is pickled into the spawned processes).
        world_size: number of processes.
        *args: further arguments of ``fn`` (picklable).
        backend: the process group backend ("gloo" on CPU, "nccl" on CUDA).

    Returns:
        Each rank's return value, in rank order (passed back through ``torch.save``).
    """
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_entry, args=(fn, world_size, free_port(), backend, tmp, args),
                           nprocs=world_size, join=True, start_method="spawn")
        # Written by our own child processes just now: full unpickling is safe here.
        return [torch.load(Path(tmp) / f"{r}.pt", weights_only=False)
                for r in range(world_size)]
