"""torch elastic's agent store: rank 0's word to the other ranks of one attempt.

torch elastic restarts every worker of a job after a failure, and its agent keeps one TCP
store for the workers of all the job's attempts (``TORCHELASTIC_USE_AGENT_STORE=True``,
reached at ``MASTER_ADDR:MASTER_PORT``). What rank 0 says to the other ranks of an
attempt (editrain's decision about the run directory, the id of the attempt's process
group) must reach the ranks of that attempt, never those of the next one, and they must
never read what the attempt before said.

``TORCHELASTIC_RESTART_COUNT`` cannot tell attempts apart: torch elastic leaves it as it
was when it restarts the workers because the nodes taking part changed (a node joined;
on a job of several nodes, a node whose own workers were healthy when another node's
failed), so an attempt may have the count of the one before it, and the count differs
between nodes after one node's failure. An attempt is told by its processes instead
(:class:`RankZeroWord`): each rank other than 0 asks under its rank with a fresh id, and
rank 0 answers that id. Rank 0 first removes the asks an earlier attempt left (its ranks
are gone: torch elastic stops every worker of an attempt before it starts the next one's),
and a rank waiting for its answer puts its ask again at each poll, so an ask of this
attempt that rank 0 removed comes back.

Only the public ``Store`` API is used (``set``, ``get``, ``check``, ``delete_key``), as
any ``torch.distributed`` store serves it (``TCPStore``, ``PrefixStore``).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a store is reached
    import torch.distributed as dist

POLL_S = 0.05
"""How often rank 0 looks for the asks it answers, and how soon a waiting rank looks for
its answer first (it then looks less often: :data:`ASK_BACKOFF`)."""
ASK_BACKOFF = 1.5
"""Each look of a waiting rank for its answer comes this many times later than the one
before, up to :data:`ASK_POLL_MAX_S`: every rank of a job asks at once, and rank 0 may
take a while (it checks and claims the run directory), so a fixed 50 ms poll of a few
thousand ranks would put tens of thousands of requests a second on the agent's store."""
ASK_POLL_MAX_S = 1.0
"""The longest a waiting rank waits between two looks for its answer."""
ATTEMPT_WORD = "editrain/attempt_id/"
"""The keys under which rank 0 gives the other ranks the id of their attempt
(:func:`attempt_id`)."""


def uses_agent_store() -> bool:
    """Whether torch elastic keeps a store for the workers of every attempt of the job
    (the ``c10d`` and ``static`` rendezvous; not the ``etcd`` one, nor with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, where each attempt's store is rank 0's own)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


class RankZeroWord:
    """Rank 0's word to the other ranks of one attempt, under ``prefix`` in ``store``.

    Keys: ``PREFIX ask/RANK`` holds the fresh id of rank ``RANK``'s ask; ``PREFIX
    answer/ID`` rank 0's answer to it; ``PREFIX answer/ID/read`` that the rank read it.

    Args:
        store: a client of torch elastic's agent store.
        prefix: the keys' prefix, one per kind of word (each is asked and answered once
            per attempt, or once per call that every rank makes the same number of times).
    """

    def __init__(self, store: dist.Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def open(self, readers: int) -> None:
        """Rank 0, first thing: remove the asks of ranks ``1..readers`` an earlier attempt
        left, so that every ask it answers is of this attempt (a rank of this attempt that
        asked already asks again)."""
        for rank in range(1, readers + 1):
            self.store.delete_key(self.ask_key(rank))

    def answer(self, said: str, readers: int, wait_s: float, until_read: bool = False
               ) -> list[int]:
        """Rank 0: answer each ask of ranks ``1..readers`` with ``said`` as it comes, until
        every rank has been answered (and, ``until_read``, has read it) or ``wait_s`` is
        over: a rank that never asks holds the others' answers up by nothing.

        Returns:
            The ranks that did not ask within ``wait_s`` (empty: every rank was answered).
        """
        asked: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        while True:
            for rank in range(1, readers + 1):
                if rank not in asked and self.store.check([self.ask_key(rank)]):
                    asked[rank] = self.store.get(self.ask_key(rank)).decode("utf-8",
                                                                            "replace")
                    self.store.set(self.answer_key(asked[rank]), said)
            if len(asked) == readers and (not until_read or self.store.check(
                    [f"{self.answer_key(i)}/read" for i in asked.values()])):
                return []
            if time.monotonic() > deadline:
                return [rank for rank in range(1, readers + 1) if rank not in asked]
            time.sleep(POLL_S)

    def asks(self, readers: int, wait_s: float) -> dict[int, str]:
        """Rank 0, before it answers: what each of ranks ``1..readers`` sent with its ask
        (:meth:`ask`'s ``sending``; "" where it sent nothing), waiting up to ``wait_s``
        for their asks; a rank that did not ask in time is left out."""
        sent: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        while len(sent) < readers and time.monotonic() <= deadline:
            for rank in range(1, readers + 1):
                if rank not in sent and self.store.check([self.ask_key(rank)]):
                    ask = self.store.get(self.ask_key(rank)).decode("utf-8", "replace")
                    key = self.sent_key(ask)
                    sent[rank] = (self.store.get(key).decode("utf-8", "replace")
                                  if self.store.check([key]) else "")
            if len(sent) < readers:
                time.sleep(POLL_S)
        return sent

    def ask(self, rank: int, wait_s: float, sending: str | None = None) -> str | None:
        """A rank other than 0: ask for rank 0's word of this attempt and wait up to
        ``wait_s`` for it; it is marked read once read. None: no answer in time.
        ``sending``: what rank 0 may read with the ask (:meth:`asks`), put before it."""
        ask = uuid.uuid4().hex
        if sending is not None:
            self.store.set(self.sent_key(ask), sending)
        deadline = time.monotonic() + wait_s
        poll_s = POLL_S
        while not self.store.check([self.answer_key(ask)]):
            if time.monotonic() > deadline:
                return None
            self.store.set(self.ask_key(rank), ask)  # again: rank 0 removes earlier asks
            time.sleep(poll_s)
            poll_s = min(ASK_POLL_MAX_S, poll_s * ASK_BACKOFF)
        said = self.store.get(self.answer_key(ask)).decode("utf-8", "replace")
        self.store.set(f"{self.answer_key(ask)}/read", "1")
        return said

    def ask_key(self, rank: int) -> str:
        """The key of rank ``rank``'s ask."""
        return f"{self.prefix}ask/{rank}"

    def sent_key(self, ask: str) -> str:
        """The key of what the ask ``ask`` sent to rank 0."""
        return f"{self.prefix}sent/{ask}"

    def answer_key(self, ask: str) -> str:
        """The key of rank 0's answer to the ask ``ask``."""
        return f"{self.prefix}answer/{ask}"


def attempt_id(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """The id of this attempt of a torch elastic job, the same on every rank of it and new
    at each attempt: rank 0 makes it and gives it to the others (:class:`RankZeroWord`).
    Every rank waits up to ``timeout`` (the process group's) for the others, as the
    process group's own start would.

    Args:
        store: a client of torch elastic's agent store.
        rank: this process's global rank.
        world_size: the ranks of the attempt.
        timeout: how long a rank waits for rank 0's answer, and rank 0 for the others' asks.

    Raises:
        TimeoutError: no answer from rank 0 within ``timeout``; at rank 0, ranks that did
            not ask (named).
    """
    word = RankZeroWord(store, ATTEMPT_WORD)
    wait_s = timeout.total_seconds()
    if rank != 0:
        said = word.ask(rank, wait_s)
        if said is None:
            raise TimeoutError(
                f"rank {rank} had no id of this attempt from rank 0 in torch elastic's "
                f"store within {wait_s:.0f} s (the process group's timeout); see rank 0's "
                "output")
        return said
    made = uuid.uuid4().hex
    word.open(readers=world_size - 1)
    missing = word.answer(made, readers=world_size - 1, wait_s=wait_s)
    if missing:
        raise TimeoutError(
            f"rank 0: rank(s) {', '.join(map(str, missing[:8]))}"
            f"{' and more' if len(missing) > 8 else ''} did not ask for this attempt's id "
            f"in torch elastic's store within {wait_s:.0f} s (the process group's "
            "timeout); see their output")
    return made
