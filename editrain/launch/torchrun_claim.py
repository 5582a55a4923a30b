"""Whether a run directory is the claim of this torchrun launch, told by torchrun's store.

torchrun restarts every worker of a launch after a failure (``--max-restarts``), the
workers of a refused first attempt too. The restarted rank 0 of a plain (not
fault-tolerant) job must tell its own launch's run, which it goes on training as it is,
from another run in the directory, which it must check as a first attempt does. It used
to take any run record there for its own: a job refused because the directory held
another run was accepted on its restart and trained into that run.

The identity of a launch lives where the launch lives: torchrun's own TCP store, hosted
by the elastic agent (``c10d`` and ``static`` rendezvous: the workers see
``TORCHELASTIC_USE_AGENT_STORE=True`` and reach the store at ``MASTER_ADDR:MASTER_PORT``).
It outlives the workers' restarts and no other launch sees it. Rendezvous ids and
process ids are not used: one id serves every launch of a script or a requeued SLURM job,
a containerised agent is often pid 1, and either would let another launch pass for this
one.

Rank 0 puts a fresh token under the run directory's key at each attempt that checks the
directory, before the checks (a refused attempt leaves a token that no record holds),
and its claim writes the same token in its history line (:data:`CLAIM_TOKEN`). A
restart then compares the two (:func:`own_claim`). A torchrun job of a fault-tolerant
run's replica group does the same for its group (:data:`GROUP_CLAIMS` of the start's
line): its restart rejoins the start unchecked only when this launch joined it.

The same store carries rank 0's decision about the run directory to the other ranks of
the launch (:meth:`LaunchStore.decide`, :meth:`LaunchStore.decision`): they wait for it
before they act, and share its refusal (:class:`editrain.agent_store.RankZeroWord`: an
attempt is told from the one before it by its processes, not by
``TORCHELASTIC_RESTART_COUNT``, which torch elastic leaves as it was when the nodes taking
part change and which differs between nodes after a failure on one of them). The decision
tells the trainer too whether this attempt goes on with its launch's run (resuming its
latest checkpoint) or made a new claim (:meth:`LaunchStore.decision`).
"""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from editrain import rundir
from editrain.agent_store import RankZeroWord, uses_agent_store
from editrain.errors import CheckpointError, ConfigError, RunDirError
from editrain.paths import shown

log = logging.getLogger("editrain")

CLAIM_TOKEN = "torchrun_claim"
"""The key of a history line holding the token of the plain torchrun launch whose rank 0
claimed the run there (absent from a line of any other job)."""
STORE_KEY = "editrain/run_dir_claim/"
"""The prefix of a run directory's key in torchrun's store (the resolved path follows)."""
GROUP_CLAIMS = "torchrun_group_claims"
"""The key of a torchrun ``--ft`` start's history line holding, by replica group, the
token of the launch whose rank 0 claimed or joined the start as that group."""
DECISION_WORD = "editrain/run_dir_decision/"
"""The prefix of the keys under which a rank other than 0 asks for rank 0's decision about
the run directory and rank 0 answers it (:class:`editrain.agent_store.RankZeroWord`:
``ask/RANK``, ``answer/ID``). No run directory in the keys: one launch is one run
directory, whose path may differ between nodes (its mount path)."""
CLAIMED, REJOINED, REFUSED = "claimed", "rejoined", "refused"
"""Rank 0's decisions: it checked and claimed (or joined) the run directory; it goes on
with its launch's own run unchecked (a restart); it was refused (``refused TYPE:
MESSAGE``), and so is every rank."""
SHARED_REFUSALS = {cls.__name__: cls for cls in (RunDirError, ConfigError, CheckpointError,
                                                 FileNotFoundError, ValueError)}
"""The refusals another rank raises as rank 0 did (same type, same message: the command
line prints the same one line, exit code 2); any other failure of rank 0 is raised as a
:class:`RunDirError` naming it."""
READ_WAIT_S = 10.0
"""How long rank 0 of a refused attempt waits for the other ranks to have read its
refusal before it exits: torchrun stops every worker of an attempt as soon as one exits,
and a rank stopped before it read the refusal would end without a word."""
ANSWER_WAIT_S = 120.0
"""How long rank 0 that went on waits for the other ranks' asks to answer them (as long
as they wait for its decision: :data:`editrain.launch.run_dir.TORCHRUN_WAIT_S`)."""
STORE_TIMEOUT_S = 30
"""How long rank 0 tries to reach torchrun's store (the agent serves it before it
starts the workers: a store that does not answer is one the process group cannot use
either)."""


def own_claim(stored: str | None, recorded: str | None) -> bool | None:
    """Whether the run directory's latest claim is this launch's.

    Args:
        stored: the token this launch last put in torchrun's store for the directory;
            None: the store is not available or holds none.
        recorded: the token of the run record's latest history line; None: the line is
            not a plain torchrun launch's claim (or there is no record).

    Returns:
        True: the same token, this launch's claim. False: the line is another job's (no
        token: a local job's, a fault-tolerant start's; another token: another launch's,
        or a claim since this launch's). None: a claim of some torchrun launch, and no
        token of this launch to compare it with (no store; or a store where no earlier
        rank 0 of the launch got as far as the run directory, as when torch elastic moves
        rank 0 to another node, whose agent then serves a new store).
    """
    if recorded is None:
        return False
    if stored is None:
        return None
    return stored == recorded


def recorded_token(record: rundir.RunRecord | None) -> str | None:
    """The token of the record's latest history line (:data:`CLAIM_TOKEN`), if any."""
    if record is None or not record.history:
        return None
    token = record.history[-1].get(CLAIM_TOKEN)
    return token if isinstance(token, str) else None


class LaunchStore:
    """This launch's tokens in torchrun's store, or none where the store is not available
    (:meth:`connect`).

    Args:
        store: a client of the agent's store; None: not available.
        why_not: why not (for the warning of a restart that cannot tell its claim).
    """

    def __init__(self, store: Any | None, why_not: str = "") -> None:
        self.store = store
        self.why_not = why_not

    @classmethod
    def connect(cls) -> LaunchStore:
        """The agent's store as the workers' environment names it; without one (etcd
        rendezvous, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the workers' store is then
        rank 0's own, gone with each attempt), or where it does not answer, none."""
        if not uses_agent_store():
            return cls(None, "torchrun keeps no store for the workers "
                             "(TORCHELASTIC_USE_AGENT_STORE is not True)")
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if not host or not port.isdigit():
            return cls(None, "MASTER_ADDR and MASTER_PORT do not name torchrun's store")
        import torch.distributed as dist

        try:
            store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=STORE_TIMEOUT_S))
        except dist.DistError as e:
            log.warning("cannot reach torchrun's store at %s:%s (%s)", host, port,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return cls(None, f"torchrun's store at {host}:{port} did not answer")
        return cls(store)

    def latest(self, run_dir: Path) -> str | None:
        """The token this launch last put for ``run_dir``; None: none, or no store."""
        if self.store is None or not self.store.check([_key(run_dir)]):
            return None
        return self.store.get(_key(run_dir)).decode("utf-8", "replace")

    def mark(self, run_dir: Path) -> str:
        """A new token for an attempt that checks ``run_dir``, put in the store (if
        any) before the checks; its claim records it."""
        token = uuid.uuid4().hex
        if self.store is not None:
            self.store.set(_key(run_dir), token)
        return token

    def open_attempt(self, readers: int) -> None:
        """Rank 0, first thing: remove the asks of ranks ``1..readers`` that an earlier
        attempt left (:meth:`editrain.agent_store.RankZeroWord.open`), so that every ask
        it answers is of this attempt. Nothing without a store."""
        if self.store is not None:
            self._word().open(readers)

    def decide(self, decision: str, readers: int) -> None:
        """Rank 0: answer the ``readers`` other ranks of the attempt with its decision
        (:data:`CLAIMED`, :data:`REJOINED`), waiting up to :data:`ANSWER_WAIT_S` for their
        asks (a rank that never asks is not waited for longer: it has failed, or it
        reached no store and waits for ``config.toml``); nothing without a store."""
        if self.store is not None:
            self._word().answer(decision, readers, ANSWER_WAIT_S)

    def refuse(self, error: BaseException, readers: int) -> None:
        """Rank 0: answer the ``readers`` other ranks of the attempt that it was refused
        (``error``), and wait, up to :data:`READ_WAIT_S` in all, for them to have read it;
        nothing without a store."""
        if self.store is not None:
            said = f"{REFUSED} {type(error).__name__}: {error}"
            self._word().answer(said, readers, READ_WAIT_S, until_read=True)

    def options_sent(self, readers: int) -> dict[int, str]:
        """Rank 0, before it checks the directory: the options each of the ``readers``
        other ranks sent with its ask (:meth:`decision`), waiting for them as long as it
        waits to answer them (:data:`ANSWER_WAIT_S`); empty without a store."""
        if self.store is None:
            return {}
        return self._word().asks(readers, ANSWER_WAIT_S)

    def decision(self, rank: int, wait_s: float, run_dir: Path,
                 options: str | None = None) -> str:
        """Another rank: ask for rank 0's decision about ``run_dir`` in this attempt
        (:data:`CLAIMED` or :data:`REJOINED`, returned), and wait up to ``wait_s``;
        ``options`` (this rank's, :func:`editrain.runtime.comparable_options`) go with the
        ask for rank 0 to compare with its own before it claims anything.

        Raises:
            RunDirError: no decision within ``wait_s``; or rank 0 was refused, raised as
                rank 0's own error where it is one of :data:`SHARED_REFUSALS`.
        """
        said = self._word().ask(rank, wait_s, sending=options)
        if said is None:
            raise RunDirError(
                f"--run-dir: rank {rank} had no decision from rank 0 about {shown(run_dir)} "
                f"within {wait_s:.0f} s (rank 0 checks and claims the run directory "
                "before any rank trains); see rank 0's output")
        if not said.startswith(REFUSED + " "):
            return said
        kind, _, message = said[len(REFUSED) + 1:].partition(": ")
        if kind in SHARED_REFUSALS:
            raise SHARED_REFUSALS[kind](message)
        raise RunDirError(f"--run-dir: rank 0 failed while it checked {shown(run_dir)} "
                          f"({kind}: {message}); see its output")

    def _word(self) -> RankZeroWord:
        return RankZeroWord(self.store, DECISION_WORD)


def group_token(record: rundir.RunRecord | None, replica: int) -> str | None:
    """The token of the launch whose rank 0 claimed or joined the run's current start
    (:func:`editrain.rundir.current_start`) as group ``replica`` (:data:`GROUP_CLAIMS`),
    if any."""
    start = rundir.current_start(record) or {}
    claims = start.get(GROUP_CLAIMS)
    token = claims.get(str(replica)) if isinstance(claims, dict) else None
    return token if isinstance(token, str) else None


def note_group_claim(run_dir: Path, replica: int, token: str) -> None:
    """Keep in the run's current start's line that the launch of ``token`` claimed or
    joined it as group ``replica`` (:func:`group_token`). Call holding the run's lock."""
    record = rundir.read_record(run_dir)
    start = rundir.current_start(record)
    if record is None or start is None:
        return
    claims = start.get(GROUP_CLAIMS)
    start[GROUP_CLAIMS] = {**(claims if isinstance(claims, dict) else {}), str(replica): token}
    rundir.write_record(run_dir, record)


def _key(run_dir: Path) -> str:
    return STORE_KEY + str(Path(run_dir).resolve())
