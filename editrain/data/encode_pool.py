"""Encoding a large corpus in worker processes, one single-threaded tokenizer each.

A token-cache build reads and describes every document in its own process (the split's
MinHash signatures, digests, names) and has it encoded meanwhile. In one process the
tokenizer's Rust thread pool, the build's Python thread and the conversion of every batch's
ids (which holds the GIL) share the cores unevenly: on 2 cores such a build used about 1.5x
the CPU time per token that two single-threaded processes of the same tokenizer need for the
same files, and took 1.6-1.7x their time. A :class:`EncoderPool` works as those processes
do: ``workers`` processes (this file run as a script, ``RAYON_NUM_THREADS=1``)
each receive whole batches in turn, encode them and send their ids back; the batches come
back in the order they were sent.

The processes speak a small binary protocol over their standard input and output (no
pickle: nothing a worker sends is ever run). Every frame begins with a little-endian
``uint64`` length:

- to a worker, first the tokenizer (its JSON) and the settings ``(eos id, policy, dtype)``
  as one ASCII line, then one frame per batch: ``uint64`` piece count, the pieces' UTF-8
  byte lengths (``uint64[n]``), a flag byte per piece (1: begins a document, 2: ends one),
  the pieces' UTF-8 bytes; a closed standard input ends the worker;
- from a worker, per batch: a status byte (0: ok), then ``uint64`` counts of pieces and of
  tokens, every piece's token count with its separators (``int64[n]``), the ids in the
  build's dtype; or status 1 and an error message.

Text is sent with ``surrogatepass``, so a worker encodes exactly the strings the build read.
"""

from __future__ import annotations

import os
import queue
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["EncoderPool", "pool_workers"]

_U64 = struct.Struct("<Q")
_BEGINS, _ENDS = 1, 2  # flag bits of a piece
_QUEUED_PER_WORKER = 2  # batches sent to a worker and not yet collected, at most
# A worker runs this file as a script: importing the package first (editrain.data and the
# build's modules) would add about 11 MiB to every worker's memory.
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def pool_workers(cpus: int | None = None) -> int:
    """How many encoder processes a build starts: one per usable CPU, fewer where the user
    bounded the tokenizer's threads (``RAYON_NUM_THREADS``, or ``TOKENIZERS_PARALLELISM``
    set to a false value: one process, still encoding beside the build's reading)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    workers = max(1, cpus)
    rayon = os.environ.get("RAYON_NUM_THREADS", "").strip()
    if rayon.isdigit() and int(rayon) > 0:
        workers = min(workers, int(rayon))
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
        eos: The separator's id.
        policy: Where separators go: ``"append"``, ``"prepend"`` or ``"none"``.
        dtype: The ids' dtype.
        workers: Number of processes (at least 1).
        sink: Called with ``(ids, piece token counts, batch)`` for every batch, in order;
            ``batch`` is what was passed to :meth:`send` as ``tag``.
    """

    def __init__(self, tokenizer_json: str, eos: int, policy: str, dtype: np.dtype,
                 workers: int, sink) -> None:
        if workers < 1:
            raise ValueError(f"an encoder pool needs a worker, got {workers}")
        self._dtype = np.dtype(dtype)
        self._sink = sink
        env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        # The worker imports editrain.malloc: from where this process found the package.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        settings = f"{int(eos)} {policy} {self._dtype.name}\n".encode("ascii")
        self._procs: list[subprocess.Popen] = []
        self._error: BaseException | None = None
        self._sent = 0
        # One slot per batch in flight: (worker, tag); bounded, so a fast reader waits.
        self._pending: queue.Queue = queue.Queue(maxsize=_QUEUED_PER_WORKER * workers)
        try:
            for _ in range(workers):
                proc = subprocess.Popen([sys.executable, "-c", _BOOT, __file__],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=env, bufsize=0)
                self._procs.append(proc)
                _write_frame(proc.stdin, tokenizer_json.encode("utf-8"))
                _write_frame(proc.stdin, settings)
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
        flags = bytes(_BEGINS * bool(b) | _ENDS * bool(e) for b, e in zip(begins, ends))
        lengths = np.fromiter(map(len, data), dtype="<u8", count=len(data))
        self._put((proc, tag))
        try:
            _write_frame(proc.stdin, b"".join([_U64.pack(len(data)), lengths.tobytes(), flags,
                                               *data]))
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
        for proc in self._procs:
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
            proc.kill()
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
                    message = (_read_frame(proc.stdout).decode("utf-8", "replace")
                               if status == b"\x01" else
                               f"it exited with code {proc.wait()}")
                    raise RuntimeError(f"data: a tokenizer process failed: {message}")
                n, total = struct.unpack("<QQ", _read_exact(proc.stdout, 16))
                sizes = np.frombuffer(_read_exact(proc.stdout, 8 * n), dtype="<i8")
                ids = np.frombuffer(_read_exact(proc.stdout, total * self._dtype.itemsize),
                                    dtype=self._dtype)
                self._sink(ids, sizes, tag)
        except BaseException as exc:  # noqa: BLE001 - raised by the next send or close
            self._error = exc


def _write_frame(pipe, data: bytes) -> None:
    pipe.write(_U64.pack(len(data)))
    view = memoryview(data)
    while view:  # an unbuffered pipe may take part of it
        view = view[pipe.write(view):]


def _read_exact(pipe, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = pipe.read(left)
        if not chunk:
            raise EOFError("data: a tokenizer process ended in the middle of a batch")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_frame(pipe) -> bytes:
    return _read_exact(pipe, _U64.unpack(_read_exact(pipe, 8))[0])


def _serve(stdin, stdout) -> None:
    """A worker's loop: encode every batch frame from ``stdin`` until it closes."""
    from tokenizers import Tokenizer

    from editrain.malloc import release_freed_memory

    tok = Tokenizer.from_str(_read_frame(stdin).decode("utf-8"))
    tok.encode_special_tokens = True  # the build's separators are the only special tokens
    eos, policy, dtype_name = _read_frame(stdin).decode("ascii").split()
    dtype = np.dtype(dtype_name)
    sep = np.array([int(eos)], dtype=dtype)
    before, after = policy == "prepend", policy == "append"
    while header := stdin.read(8):  # b"" once the build closed the pipe
        frame = _read_exact(stdin, _U64.unpack(header + _read_exact(stdin, 8 - len(header)))[0])
        try:
            n = _U64.unpack_from(frame)[0]
            lengths = np.frombuffer(frame, dtype="<u8", count=n, offset=8)
            flags = frame[8 + 8 * n : 8 + 9 * n]
            ends = np.cumsum(lengths) + 8 + 9 * n
            pieces = [frame[int(e - k) : int(e)].decode("utf-8", "surrogatepass")
                      for e, k in zip(ends.tolist(), lengths.tolist())]
            parts, sizes = [], np.zeros(n, dtype="<i8")
            for i, enc in enumerate(tok.encode_batch_fast(pieces)):
                ids = np.asarray(enc.ids, dtype=dtype)
                head = before and flags[i] & _BEGINS
                tail = after and flags[i] & _ENDS
                if head:
                    parts.append(sep)
                parts.append(ids)
                if tail:
                    parts.append(sep)
                sizes[i] = len(ids) + bool(head) + bool(tail)
            out = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - told to the build, which raises it
            stdout.write(b"\x01")
            _write_frame(stdout, f"{type(exc).__name__}: {exc}".encode())
            stdout.flush()
            return
        stdout.write(b"\x00" + struct.pack("<QQ", n, len(out)))
        stdout.write(sizes.tobytes())
        stdout.write(out.tobytes())
        stdout.flush()
        del frame, pieces, parts, out
        # The batch's encodings are freed: hand the pages back (see release_freed_memory).
        release_freed_memory()


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: the build stops, closes the pipes, and the
    # worker ends at the end of its input instead of printing a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(sys.stdin.buffer, sys.stdout.buffer)
    except BrokenPipeError:  # the build stopped reading: it failed or was stopped
        pass
