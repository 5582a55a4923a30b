"""Spawn helper for multi-process gloo tests: run ``fn(rank, world_size, *args)`` on every
rank with an initialised default process group and collect the return values."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out_dir: str,
           args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
        torch.save(out, Path(out_dir) / f"{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn`` on ``world_size`` spawned processes; return each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(fn, world_size, free_port(), tmp, args),
                           nprocs=world_size, join=True, start_method="spawn")
        return [torch.load(Path(tmp) / f"{r}.pt", weights_only=False) for r in range(world_size)]
