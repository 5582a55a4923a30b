"""The fault-tolerant sync round (``dist.fault_tolerance = "torchft"``).

A round is all-or-nothing on every replica:

1. **Quorum** (:meth:`TorchftGroup.begin`): the lighthouse forms the quorum of the replicas
   at this sync. A replica that is behind in committed syncs (it restarted, or missed a
   commit) first *heals*: it loads the global state from a healthy peer (the engine's
   anchors, outer optimizer, detectors and counters; the trainer's step, data position and
   inner optimizer) and writes the anchors into its parameters.
2. **Rendezvous**: one all-gather of ``(replica id, contributes, steps since sync)`` over
   the quorum. A healed replica contributes nothing this round (its pseudo-gradient is
   zero by construction); it still takes part in every collective, with weight 0.
3. **Statistics and reductions**, unit by unit, as in the plain engine: the penalty's
   norms are laid out over all ``dist.replicas`` replica ids (absent or non-contributing
   ones are NaN, hence excluded: the weights renormalise over the contributors), the
   pseudo-gradients summed with those weights. Nothing is applied yet.
4. **Commit** (:meth:`TorchftGroup.commit`): only if no collective failed on any rank of
   this replica and the quorum is large enough are the outer steps applied and the new
   anchors written into the parameters. Otherwise the round is dropped whole: anchors and
   outer state stay, local training goes on and the steps count towards the next sync. A
   replica that did not commit while others did is one sync behind and heals at the next
   round, so every replica holds the same global model again.

The round is blocking (its reductions are not overlapped with the next forward): an outer
update may only be applied once the whole round is known to have succeeded everywhere.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from editrain.sync.ft import QuorumError, TorchftGroup

if TYPE_CHECKING:
    from editrain.sync.edit import SyncEngine, SyncRound


class FaultTolerantSync:
    """Runs the engine's syncs as fault-tolerant rounds over a :class:`TorchftGroup`.

    Args:
        engine: the engine whose units, statistics and reductions the rounds use.
        group: the cross-replica group (also the engine's ``comm.cross``).
    """

    def __init__(self, engine: SyncEngine, group: TorchftGroup) -> None:
        self.engine = engine
        self.group = group
        self.members: list[int] | None = None
        """Replica ids of the last quorum."""
        self.failed_rounds = 0
        self.heals = 0
        self.last_round_step = -1
        """Global step of the last round attempted (committed or not)."""
        group.register_state("engine", engine.peer_state, self._adopt)

    def _adopt(self, sd: dict[str, Any]) -> None:
        self.engine.adopt_peer_state(sd)
        self.heals += 1

    def join(self, start_quorum: int, timeout_s: float = 600.0) -> bool:
        """Join the job: rounds without a contribution until one commits. At a fresh
        start (no replica of the quorum has committed a sync yet) a round commits only
        with ``start_quorum`` replicas present, so replicas that start at different speeds
        all begin together instead of the first ones training alone and the others healing
        from them. A replica that (re)joins a running job heals in its first round."""
        deadline = time.monotonic() + timeout_s
        while not self.run(contribute=False, start_quorum=start_quorum):
            if time.monotonic() > deadline:
                raise QuorumError(f"no quorum of {start_quorum} replicas within "
                                  f"{timeout_s:.0f} s (dist.ft_join_timeout_s); are all "
                                  f"replica groups running?")
            time.sleep(0.2)
        return True

    @torch.no_grad()
    def run(self, contribute: bool = True, start_quorum: int = 0,
            elapsed: float | None = None, allow_skip: bool = True) -> bool:
        """One round at this step boundary; returns whether it was committed.

        Args:
            contribute: this replica has trained since its last sync (False: joining).
            start_quorum: replicas required at a fresh start (see :meth:`join`).
            elapsed: A-EDiT: this replica's agreed time since its last sync; the round
                then gathers every member's steps and window (step weights, progress)
                and is skipped when they add up to fewer than
                ``sync.min_total_global_steps`` (unless not ``allow_skip``).
        """
        eng = self.engine
        t0 = time.perf_counter()
        self.last_round_step = eng.global_step
        quorum = self.group.begin()  # may heal this replica (engine.adopt_peer_state)
        quorum_wait = time.perf_counter() - t0
        contribute = contribute and not quorum.healed and eng.steps_since_sync > 0
        rnd = eng.new_round()
        rnd.tentative = {}
        error: str | None = None
        try:
            eng.comm.run(self._jobs, rnd, contribute, elapsed, allow_skip)
            if start_quorum and rnd.fresh and len(rnd.members or []) < start_quorum:
                error = (f"waiting for every replica at the start: {len(rnd.members or [])} "
                         f"of {start_quorum} present")
                self.group.report_error(RuntimeError(error))  # every member votes no
        except QuorumError as exc:
            error = str(exc).splitlines()[0][:200]
        committed = self.group.commit() and error is None
        if committed:
            self._apply(rnd)
        else:
            self.failed_rounds += 1
        previous, self.members = self.members, rnd.members
        members = rnd.members or []
        record: dict[str, Any] = {
            "committed": committed,
            "quorum_size": quorum.size,
            "members": rnd.members,
            "contributors": [m for m, c in zip(members, rnd.contributes or []) if c],
            "joined": sorted(set(members) - set(previous)) if previous else [],
            "left": sorted(set(previous) - set(members)) if previous else [],
            "healed": quorum.healed,
            "quorum_wait_s": quorum_wait,
            "committed_syncs": self.group.committed_syncs,
        }
        if error is not None:
            record["error"] = error
        eng.end_round(rnd, committed, record)
        return committed

    def _jobs(self, rnd: SyncRound, contribute: bool, elapsed: float | None,
              allow_skip: bool) -> None:
        """The round's collectives, in order, on the communication thread; the first
        failure ends the round (later collectives would run on a broken group)."""
        eng = self.engine
        mine = torch.tensor([eng.replica, float(contribute), eng.steps_since_sync,
                             self.group.committed_syncs, rnd.index, elapsed or 0.0],
                            dtype=torch.float64, device=eng.device)
        got = eng.comm.all_gather_sync(mine).cpu()  # [quorum, 6]
        rnd.members = [int(r) for r in got[:, 0].tolist()]
        rnd.contributes = [bool(c) for c in got[:, 1].tolist()]
        rnd.fresh = float(got[:, 3].max()) == 0  # nobody has committed a round yet
        # One index for the round on every member (a replica that missed rounds, or
        # retried its start more often, catches up): it seeds GTA's random choices.
        rnd.index = int(got[:, 4].max())
        if elapsed is not None:
            # A-EDiT: steps and windows by replica id (0 for absent or joining replicas).
            counts = torch.zeros(eng.num_replicas, dtype=torch.float64)
            windows = [0.0] * eng.num_replicas
            for row, member in enumerate(rnd.members):
                if rnd.contributes[row]:
                    counts[member] = got[row, 2]
                    windows[member] = float(got[row, 5])
            rnd.step_counts, rnd.windows = counts, windows
            if allow_skip and any(rnd.contributes) and \
                    float(counts.sum()) < eng.config.min_total_global_steps:
                rnd.skipped, rnd.units = True, []
                return
        if not any(rnd.contributes):
            rnd.units = []  # nobody trained since the last sync (a start or a join)
            return
        if eng.config.penalty_enabled or rnd.step_counts is not None:
            eng.round_statistics(rnd)
        for i in range(len(rnd.units)):
            eng.reduce_unit(rnd, i)

    def _apply(self, rnd: SyncRound) -> None:
        """Committed: the outer steps, then the new anchors into the parameters."""
        eng = self.engine
        assert rnd.tentative is not None
        for i, u in enumerate(rnd.units):
            unit = eng.units[u]
            reduced = rnd.tentative.get(i)
            if reduced is not None:
                unit.outer_step(reduced)
            unit.write_back()  # (no reduction: nobody was trusted, the anchor stays)
