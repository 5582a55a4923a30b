"""Encoding a large corpus in worker processes, one single-threaded tokenizer each.

A token-cache build reads and describes every document in its own process (the split's
MinHash signatures, digests, names) and has it encoded meanwhile. In one process the
tokenizer's Rust thread pool, the build's Python thread and the conversion of every batch's
ids (which holds the GIL) share the cores unevenly: on 2 cores such a build used about 1.5x
the CPU time per token that two single-threaded processes of the same tokenizer need for the
same files, and took 1.6-1.7x their time. A :class:`EncoderPool` works as those processes
do: ``workers`` processes (:mod:`editrain.data.encode_worker`, ``RAYON_NUM_THREADS=1``)
each receive whole batches in turn, encode them and send their ids back; the batches come
back in the order they were sent.

The processes speak a small binary protocol over their standard input and output, no
pickle (:mod:`editrain.data.encode_worker` says it); text is sent with ``surrogatepass``, so a
worker encodes exactly the strings the build read.
"""

from __future__ import annotations

import os
import queue
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from editrain.argv import rayon_threads

from . import encode_worker
from .encode_worker import BEGINS, ENDS, read_exact, read_frame, write_frame

__all__ = ["EncoderPool", "pool_workers"]

_QUEUED_PER_WORKER = 2  # batches sent to a worker and not yet collected, at most
# A worker runs encode_worker.py as a script: importing the package first (editrain.data
# and the build's modules, numpy) would add about 24 MiB to every worker's memory.
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def pool_workers(cpus: int | None = None) -> int:
    """How many encoder processes a build starts: one per usable CPU, fewer where the user
    bounded the tokenizer's threads (``RAYON_NUM_THREADS``, or ``TOKENIZERS_PARALLELISM``
    set to a false value: one process, still encoding beside the build's reading)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    workers = max(1, cpus)
    rayon = rayon_threads()  # (0 bounds nothing; junk is refused, not passed over)
    if rayon is not None:
        workers = min(workers, rayon)
    if os.environ.get("TOKENIZERS_PARALLELISM", "").strip().lower() in ("0", "false", "no",
                                                                         "off"):
        workers = 1
    return workers


class EncoderPool:
    """``workers`` encoder processes for one tokenizer; batches are encoded in the order
    they are sent and their results handed to ``sink`` in that order, on a thread of the
    pool (see the module's docstring).

    Args:
        tokenizer_json: The tokenizer (``Tokenizer.to_str()``); special tokens in the text
            are encoded as text, as a build does.
        eos: The separator's id (None: the tokenizer has none, and ``policy`` is
            ``"none"``).
        policy: Where separators go: ``"append"``, ``"prepend"`` or ``"none"``.
        dtype: The ids' dtype.
        workers: Number of processes (at least 1).
        sink: Called with ``(ids, piece token counts, batch)`` for every batch, in order;
            ``batch`` is what was passed to :meth:`send` as ``tag``.
    """

    def __init__(self, tokenizer_json: str, eos: int | None, policy: str, dtype: np.dtype,
                 workers: int, sink) -> None:
        if workers < 1:
            raise ValueError(f"an encoder pool needs a worker, got {workers}")
        self._dtype = np.dtype(dtype)
        self._sink = sink
        env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        # The worker imports editrain.malloc: from where this process found the package.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # "-": no separator id (data.eos none with a tokenizer that has none)
        settings = (f"{'-' if eos is None else int(eos)} {policy} {self._dtype.name}\n"
                    ).encode("ascii")
        self._procs: list[subprocess.Popen] = []
        self._error: BaseException | None = None
        self._sent = 0
        # One slot per batch in flight: (worker, tag); bounded, so a fast reader waits.
        self._pending: queue.Queue = queue.Queue(maxsize=_QUEUED_PER_WORKER * workers)
        try:
            for _ in range(workers):
                # In a session of its own: a terminal's Ctrl-C (SIGINT to the foreground
                # process group) reaches the build, which stops and closes the pipes, and
                # never a worker still starting, whose interpreter would print a
                # KeyboardInterrupt traceback or 'Fatal Python error: init_import_site'
                # before it could ignore the signal. A build that dies closes the pipes too.
                proc = subprocess.Popen([sys.executable, "-c", _BOOT, encode_worker.__file__],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=env, bufsize=0, start_new_session=True)
                self._procs.append(proc)
                write_frame(proc.stdin, tokenizer_json.encode("utf-8"))
                write_frame(proc.stdin, settings)
        except BaseException:
            self.abort()
            raise
        self._thread = threading.Thread(target=self._collect, name="editrain-encode-pool",
                                        daemon=True)
        self._thread.start()

    def send(self, pieces: Sequence[str], begins: Sequence[bool], ends: Sequence[bool],
             tag=None) -> None:
        """Queue one batch of text pieces (``begins``/``ends``: whether each begins or ends
        its document, which says where the separators go); blocks while the pool has
        ``2 x workers`` batches in flight."""
        proc = self._procs[self._sent % len(self._procs)]
        data = [p.encode("utf-8", "surrogatepass") for p in pieces]
        flags = bytes(BEGINS * bool(b) | ENDS * bool(e) for b, e in zip(begins, ends))
        lengths = np.fromiter(map(len, data), dtype="<u8", count=len(data))
        self._put((proc, tag))
        frame = b"".join([struct.pack("<Q", len(data)), lengths.tobytes(), flags, *data])
        try:
            write_frame(proc.stdin, frame)
        except OSError as exc:  # the worker is gone: the collector says why
            self._raise_error()
            raise RuntimeError(f"data: a tokenizer process stopped ({exc})") from exc
        self._sent += 1

    def close(self) -> None:
        """Wait until every batch sent was handed to the sink; end the processes."""
        self._put(None)
        self._thread.join()
        self._raise_error()
        for proc in self._procs:
            proc.stdin.close()
        for proc in self._procs:
            proc.wait()
            proc.stdout.close()

    def abort(self) -> None:
        """End the processes now (after a failure: what is in flight is dropped)."""
        self._kill()
        for proc in self._procs:
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass

    def _kill(self) -> None:
        # Killed before their pipes are closed: a thread reading one then sees its end.
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.wait()

    def _put(self, item) -> None:
        while True:
            self._raise_error()
            try:
                self._pending.put(item, timeout=0.1)  # wakes up to see a failed collector
                return
            except queue.Full:
                continue

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _collect(self) -> None:
        try:
            while (item := self._pending.get()) is not None:
                proc, tag = item
                status = proc.stdout.read(1)
                if status != b"\x00":
                    message = (read_frame(proc.stdout).decode("utf-8", "replace")
                               if status == b"\x01" else
                               f"it exited with code {proc.wait()}")
                    raise RuntimeError(f"data: a tokenizer process failed: {message}")
                n, total = struct.unpack("<QQ", read_exact(proc.stdout, 16))
                sizes = np.frombuffer(read_exact(proc.stdout, 8 * n), dtype="<i8")
                ids = np.frombuffer(read_exact(proc.stdout, total * self._dtype.itemsize),
                                    dtype=self._dtype)
                self._sink(ids, sizes, tag)
        except BaseException as exc:  # noqa: BLE001 - raised by the next send or close
            self._error = exc
            # Nobody reads the others' results any more: a worker blocked writing one would
            # never read the batch the build may be blocked sending it. Killed, it breaks
            # that pipe, and the build's send raises this error.
            self._kill()
