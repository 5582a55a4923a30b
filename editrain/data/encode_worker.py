"""One encoder process of a token-cache build's pool (:mod:`editrain.data.encode_pool`).

It encodes the batches of text it is sent with one single-threaded tokenizer and sends
their ids back.

It is run as a script (``runpy.run_path``), not imported through its package, and imports
no more than ``tokenizers`` and :mod:`editrain.malloc`: every worker of a build pays for
what it imports in memory (numpy and the data package would add about 24 MiB each).

The protocol, over standard input and output (no pickle: nothing a worker sends is run):

- to the worker, two frames (a little-endian ``uint64`` length, then the bytes): the
  tokenizer's JSON, and ``"EOS_ID POLICY DTYPE"`` in ASCII; then one frame per batch:
  ``uint64`` piece count ``n``, the pieces' UTF-8 byte lengths (``uint64[n]``), one flag
  byte per piece (:data:`BEGINS`: the piece begins a document, :data:`ENDS`: ends one), the
  pieces' UTF-8 bytes (``surrogatepass``). Standard input closed: the worker ends.
- from the worker, per batch: ``b"\\x00"``, ``uint64`` piece count and token count, every
  piece's tokens with its separators (``int64[n]``), the ids (``uint16`` or ``uint32`` in
  the machine's byte order); or ``b"\\x01"`` and a frame with the error, and it ends.
"""

from __future__ import annotations

import signal
import struct
import sys
from array import array

BEGINS, ENDS = 1, 2  # flag bits of a piece
_U64 = struct.Struct("<Q")
_TYPECODES = {"uint16": "H", "uint32": "I"}  # array's codes of the build's dtypes


def write_frame(pipe, data: bytes) -> None:
    """Write ``data`` to ``pipe`` as one frame."""
    pipe.write(_U64.pack(len(data)))
    view = memoryview(data)
    while view:  # an unbuffered pipe may take part of it
        view = view[pipe.write(view):]


def read_exact(pipe, n: int) -> bytes:
    """``n`` bytes from ``pipe``; EOFError if it ends before."""
    parts, left = [], n
    while left:
        chunk = pipe.read(left)
        if not chunk:
            raise EOFError("data: a tokenizer process ended in the middle of a batch")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_frame(pipe) -> bytes:
    """One frame's bytes from ``pipe``."""
    return read_exact(pipe, _U64.unpack(read_exact(pipe, 8))[0])


def template_ids(tok) -> tuple[list[int], list[int]]:
    """The ids a tokenizer's post-processor puts before and after a text it encodes (a Llama
    2 or Mistral tokenizer's ``<s>``; some also append ``</s>``), found by encoding a probe
    with and without them. A document is encoded in pieces without them
    (``add_special_tokens=False``), and they go once before its first piece and once after
    its last (:func:`edges`): every piece of a long document began with ``<s>``."""
    probe = "a"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    if not bare:  # nothing to find the template around: the tokens as encoded
        return [], []
    for k in range(len(full) - len(bare) + 1):
        if full[k:k + len(bare)] == bare:
            return list(full[:k]), list(full[k + len(bare):])
    return [], []


def edges(eos: int | None, policy: str, prefix: list[int], suffix: list[int]
          ) -> tuple[list[int], list[int]]:
    """The ids before a document's first piece and after its last: the separator where
    ``policy`` puts it and the tokenizer's own :func:`template_ids`, the end-of-text once
    (a template that already ends a text with it gets no second one)."""
    head = ([eos] if policy == "prepend" and prefix[:1] != [eos] and suffix[-1:] != [eos]
            else []) + prefix
    tail = suffix + ([eos] if policy == "append" and suffix[-1:] != [eos] else [])
    return head, tail


def encode_batch(tok, frame: bytes, eos: int | None, policy: str, typecode: str,
                 template: tuple[list[int], list[int]] = ([], [])
                 ) -> tuple[list[int], array]:
    """``(every piece's tokens with its separators, the ids)`` of one batch frame."""
    n = _U64.unpack_from(frame)[0]
    lengths = struct.unpack_from(f"<{n}Q", frame, 8)
    flags = frame[8 + 8 * n : 8 + 9 * n]
    pieces, at = [], 8 + 9 * n
    for k in lengths:
        pieces.append(frame[at : at + k].decode("utf-8", "surrogatepass"))
        at += k
    head, tail = edges(eos, policy, *template)
    out, sizes = array(typecode), []
    for i, enc in enumerate(tok.encode_batch_fast(pieces, add_special_tokens=False)):
        first, last = bool(flags[i] & BEGINS), bool(flags[i] & ENDS)
        if first:
            out.extend(head)
        ids = enc.ids
        out.extend(ids)
        if last:
            out.extend(tail)
        sizes.append(len(ids) + first * len(head) + last * len(tail))
    return sizes, out


def serve(stdin, stdout) -> None:
    """Encode every batch frame from ``stdin`` until it closes (see the module's
    docstring)."""
    from tokenizers import Tokenizer

    from editrain.malloc import keep_freed_memory

    # Freed memory is kept for the next batch instead of handed back and page-faulted in
    # again: a worker's resident set stays at what its largest batch needed, which is the
    # peak anyway (the build's peak rose by 6 MiB at 20 MB, 4 MiB at 150 MB), and it
    # encodes 10-15% faster (20 MB of Python, 2-core AMD EPYC, 3 interleaved pairs: 12.3,
    # 14.2, 16.9 CPU-s against 14.5, 15.5, 17.8 without; trimming after every batch, as
    # it did, cost more still).
    keep_freed_memory()
    tok = Tokenizer.from_str(read_frame(stdin).decode("utf-8"))
    tok.encode_special_tokens = True  # the build's separators are the only special tokens
    eos, policy, dtype_name = read_frame(stdin).decode("ascii").split()
    eos_id = None if eos == "-" else int(eos)  # "-": no separator id (data.eos none)
    typecode = _TYPECODES[dtype_name]
    template = template_ids(tok)
    while header := stdin.read(8):  # b"" once the build closed the pipe
        frame = read_exact(stdin, _U64.unpack(header + read_exact(stdin, 8 - len(header)))[0])
        try:
            sizes, out = encode_batch(tok, frame, eos_id, policy, typecode, template)
        except Exception as exc:  # noqa: BLE001 - told to the build, which raises it
            stdout.write(b"\x01")
            write_frame(stdout, f"{type(exc).__name__}: {exc}".encode())
            stdout.flush()
            return
        stdout.write(b"\x00" + struct.pack("<QQ", len(sizes), len(out)))
        stdout.write(struct.pack(f"<{len(sizes)}q", *sizes))
        stdout.write(out.tobytes())
        stdout.flush()


if __name__ == "__main__":
    # The build starts the worker in a session of its own, out of the terminal's reach; a
    # SIGINT sent to it all the same is ignored too: the build stops, closes the pipes, and
    # the worker ends at the end of its input instead of printing a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve(sys.stdin.buffer, sys.stdout.buffer)
    except (BrokenPipeError, EOFError):
        # The build stopped reading, or closed its end in the middle of a frame: it failed
        # or was stopped (a Ctrl-C can cut its start of this process short, and then the
        # tokenizer's frame), and reports that itself. Nothing is left to say here.
        pass
