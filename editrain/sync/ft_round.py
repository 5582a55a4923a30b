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
With streaming fragments and ``overlap_steps > 0`` the quorum is taken at the launch, the
reductions run behind the next steps, and the vote and the merge come at the merge.

This is a schedule (:class:`FaultTolerantSchedule`) over the same parts as every other: the
round (:class:`~editrain.sync.round.SyncRound`, closed by the engine's one book-keeping),
the reduction (:mod:`editrain.sync.reduction`) and the rendezvous
(:meth:`editrain.sync.clock.SyncClock.exchange`); torchft's Manager supplies the
cross-replica group (the engine's communication path sends through it), the quorum and
the vote.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from editrain.sync.ft import Quorum, QuorumError, TorchftGroup
from editrain.sync.round import SyncRound
from editrain.sync.schedules import BlockingSchedule
from editrain.sync.triggers import FragmentSchedule

if TYPE_CHECKING:
    from editrain.sync.view import EngineView


def unhealed_join_error(joining: bool, healed: bool, contributes: list[bool] | None
                        ) -> str | None:
    """Why a joining replica must not commit this round, or None.

    A replica that joins without healing holds the global model of its own count of
    commits. Every member that trained since its last sync holds that count too
    (torchft heals whoever is behind) but may hold another commit behind it: a group
    that resumed a checkpoint counts itself one commit short
    (:meth:`~editrain.sync.ft.TorchftGroup.resume_behind`), and a live group that
    missed that very commit is then level with it. Applying the others' pseudo-gradients
    to its own anchors would leave it on another model for the rest of the run. At a
    start or a resume nobody has trained yet, and a replica behind the others heals, so
    a joining replica that did not heal meets contributors only there: it votes no, is
    then a commit behind, and heals at the next round."""
    if joining and not healed and any(contributes or []):
        return ("joining: members trained from a commit this replica may not hold; "
                "it heals at the next round")
    return None


class FaultTolerantSchedule(BlockingSchedule):
    """Runs the engine's syncs as fault-tolerant rounds over a :class:`TorchftGroup`:
    blocking rounds of every unit when the trigger fires, or streaming fragments.

    Args:
        engine: the engine as schedules see it (its units, statistics and reductions).
        group: the cross-replica group (also the engine's ``comm.cross``).
    """

    def __init__(self, engine: EngineView, group: TorchftGroup) -> None:
        super().__init__(engine)
        self.group = group
        cfg = engine.config
        self.streaming: FragmentSchedule | None = None
        """Streaming fragments (``sync.fragments``, ``sync.overlap_steps``), or None."""
        if cfg.streaming and not cfg.use_async:
            assert cfg.local_sgd_sync_interval is not None
            self.streaming = FragmentSchedule(cfg.local_sgd_sync_interval, cfg.fragments)
        self.members: list[int] | None = None
        """Replica ids of the last quorum."""
        self.failed_rounds = 0
        self.heals = 0
        self.last_round_step = -1
        """Global step of the last round attempted (committed or not)."""
        self.inflight: SyncRound | None = None
        """Streaming: the delayed round launched and not yet merged (one at a time)."""
        group.register_state("engine", self.peer_state, self.adopt_peer_state)

    def step(self) -> None:
        eng = self.engine
        if self.streaming is not None:
            self.streaming_step(self.streaming.launches(
                eng.counters.global_step - eng.config.local_sgd_warmup_steps))
            return
        due, elapsed = self.due()
        if due:
            self.run(elapsed=elapsed if eng.config.use_async else None)

    def finish(self, force: bool, ran_armed: bool) -> None:
        # Every replica runs one last round (A-EDiT replicas are at different steps);
        # replicas that have not trained since their last sync contribute nothing.
        # Streaming: the round in flight is merged first, then every unit syncs.
        eng = self.engine
        c = eng.counters
        syncs = c.num_syncs
        self.merge_inflight()
        self.run(elapsed=eng.clock.elapsed() if eng.config.use_async else None,
                 allow_skip=False)
        c.num_syncs_forced += c.num_syncs - syncs

    def peer_state(self) -> dict[str, Any]:
        """What this rank sends a replica that heals: its share of the global state
        (anchors, outer optimizer state) and the counters, as CPU copies (the sender trains
        on while the receiver reads). Replica-own entries (error feedback, launch
        snapshots) stay here."""
        eng = self.engine
        c, detectors = eng.counters, eng.reduction.detectors
        return {"units": eng.anchors.peer_units(), "global_step": c.global_step,
                "num_syncs": c.num_syncs, "next_index": c.next_index,
                "seed": eng.reduction.seed, "progress": eng.progress.state_dict(),
                "detectors": detectors.state_dict() if detectors is not None else None}

    def adopt_peer_state(self, sd: dict[str, Any]) -> None:
        """Take :meth:`peer_state` of a healthy replica and restart from the global model:
        anchors into the parameters, no local progress, this replica's own error feedback
        back to zero."""
        eng = self.engine
        eng.anchors.adopt(sd["units"])
        c, detectors = eng.counters, eng.reduction.detectors
        c.global_step, c.num_syncs = int(sd["global_step"]), int(sd["num_syncs"])
        c.next_index = int(sd["next_index"])
        eng.reduction.seed = int(sd["seed"])
        eng.progress.load_state_dict(sd["progress"])
        if detectors is not None and sd["detectors"] is not None:
            detectors.load_state_dict(sd["detectors"])
        c.steps_since_sync, c.last_sync_step = 0, c.global_step
        eng.clock.restart()
        self.heals += 1

    def join(self, start_quorum: int, timeout_s: float = 600.0,
             between_attempts: Callable[[], None] | None = None) -> bool:
        """Join the job: rounds without a contribution until one commits, which needs
        ``start_quorum`` replicas in the quorum. At a start or a resume that is every
        replica, so replicas that start at different speeds begin together instead of the
        first ones training alone (a lighthouse that has seen no quorum yet forms one from
        whoever is there) and the others healing from them, or worse, two halves training
        apart. A replica that rejoins a running job needs one peer (it heals from it in
        that round).

        ``between_attempts`` runs on every rank after each attempt that did not commit
        (every rank of the replica has the same attempts: the commit vote is the group's)
        and ends the join by raising: the trainer's look for a run whose other groups all
        finished while this one waits (:class:`editrain.fault.RunEndWatch`), which no
        quorum would ever tell."""
        deadline = time.monotonic() + timeout_s
        while not self.run(contribute=False, start_quorum=start_quorum):
            if between_attempts is not None:
                between_attempts()
            if time.monotonic() > deadline:
                raise QuorumError(f"no quorum of {start_quorum} replicas within "
                                  f"{timeout_s:.0f} s (dist.ft_join_timeout_s); are all "
                                  f"replica groups running?")
            time.sleep(0.2)
        return True

    @torch.no_grad()
    def run(self, contribute: bool = True, start_quorum: int = 0,
            elapsed: float | None = None, allow_skip: bool = True,
            units: list[int] | None = None, fragment: int = 0) -> bool:
        """One round at this step boundary; returns whether it was committed.

        Args:
            contribute: this replica has trained since its last sync (False: joining).
            start_quorum: replicas this round needs to commit (see :meth:`join`).
            elapsed: A-EDiT: this replica's agreed time since its last sync; the round
                then gathers every member's steps and window (step weights, progress)
                and is skipped when they add up to fewer than
                ``sync.min_total_global_steps`` (unless not ``allow_skip``).
            units / fragment: streaming: the fragment's units (default: all).
        """
        joining = not contribute
        rnd, quorum, contribute, error = self._begin(contribute, units, fragment)
        try:
            if error is None:
                self._wait(rnd, self.engine.comm.submit(
                    self._jobs, rnd, contribute, elapsed, allow_skip, stats=rnd.comm,
                    cause="rounds"))
                error = unhealed_join_error(joining, quorum.healed, rnd.contributes)
            if start_quorum and len(rnd.members or []) < start_quorum:
                error = (f"joining: waiting for {start_quorum} replicas in the quorum, "
                         f"{len(rnd.members or [])} present")
                self.group.report_error(RuntimeError(error))  # every member votes no
        except QuorumError as exc:
            error = str(exc).splitlines()[0][:200]
        committed = self._end(rnd, quorum, error)
        if joining and not committed:
            # A join's attempts are one round, numbered by the attempt that commits: the
            # attempts before it (a quorum short of the others, tried every 0.2 s while a
            # group waits for them, dozens under torchrun) are not rounds of the run, and
            # the trainer logs none of them (its sync lines and metrics.jsonl start after
            # the join). Each used to take an index, so a run's first sync was numbered by
            # how long its groups waited for each other ("sync 74").
            self.engine.counters.next_index = rnd.index
        return committed

    def _wait(self, rnd: SyncRound, jobs: Future) -> None:
        """Wait for the round's jobs on the training thread, counted as a plain round's
        wait for its units is (the log entry's ``wait_s``, the engine's total, which the
        trainer takes out of the step's compute time); re-raises their error."""
        t0 = time.perf_counter()
        try:
            jobs.result()
        finally:
            waited = time.perf_counter() - t0
            rnd.wait_s += waited
            self.engine.counters.total_wait_s += waited

    def _begin(self, contribute: bool, units: list[int] | None, fragment: int,
               apply_at: int | None = None
               ) -> tuple[SyncRound, Quorum, bool, str | None]:
        """Quorum (and healing), then a new round of ``units``; the error if the quorum
        could not be formed (the round then only votes no)."""
        eng = self.engine
        t0 = time.perf_counter()
        self.last_round_step = eng.counters.global_step
        error = None
        try:
            quorum = self.group.begin()  # may heal this replica (adopt_peer_state)
        except QuorumError as exc:
            quorum = Quorum(size=0, rank=-1, quorum_id=-1, healed=False)
            error = str(exc).splitlines()[0][:200]
        # Something to send: local steps since the last sync, or with streaming (merges
        # keep local progress: the parameters are not the anchors) anything but a heal.
        trained = eng.counters.steps_since_sync > 0 or self.streaming is not None
        contribute = contribute and not quorum.healed and trained
        rnd = eng.open_round(None, range(len(eng.units)) if units is None else units,
                             fragment, apply_at, statistics=False, numbered=False)
        rnd.fragment = fragment if units is not None else -1  # -1: every unit
        rnd.tentative = {}
        rnd.quorum_wait_s = time.perf_counter() - t0
        return rnd, quorum, contribute, error

    def _end(self, rnd: SyncRound, quorum: Quorum, error: str | None) -> bool:
        """The commit vote, then the outer steps (and merges) or nothing; the log entry."""
        eng = self.engine
        if error is not None:
            # Into this rank's vote, which torchft ANDs over every rank of the replica group
            # (every stage, shard and tp rank): an error seen by one rank only (e.g. one
            # stage's rendezvous failed) drops the round on all of them alike.
            self.group.report_error(RuntimeError(error))
        committed = self.group.commit() and error is None
        if committed:
            self._apply(rnd)
        else:
            self.failed_rounds += 1
            # A dropped round is dropped alike on every rank of the group: one whose
            # rendezvous got through may have found the round too short (A-EDiT's skip,
            # which restarts the window), one whose rendezvous failed knows nothing.
            rnd.skipped = False
        if rnd.delayed:  # merged, or dropped (the local model stays): snapshots go
            for unit in eng.units:
                unit.launch = None
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
            "quorum_wait_s": rnd.quorum_wait_s,
            "committed_syncs": self.group.committed_syncs,
        }
        if error is not None:
            record["error"] = error
        eng.close_round(rnd, committed, record)
        return committed

    # ------------------------------------------------------------------ streaming
    def streaming_step(self, launches: list[int]) -> None:
        """Streaming at a step boundary: merge the round in flight if due, then run the
        fragments due now, delayed (``sync.overlap_steps > 0``: quorum now, reductions in
        the background, commit and merge ``overlap_steps`` later) or blocking."""
        eng = self.engine
        step = eng.counters.global_step
        if self.inflight is not None and step >= self.inflight.apply_at:
            self.merge_inflight()
        tau = eng.config.overlap_steps
        for f in launches:
            units = eng.fragments[f]
            if tau == 0:
                self.run(units=units, fragment=f)
                continue
            self.merge_inflight()  # (never in flight here: overlap_steps <= H / P)
            rnd, quorum, contribute, error = self._begin(True, units, f, step + tau)
            if error is not None:
                self._end(rnd, quorum, error)  # votes no: nothing launched
                continue
            with torch.no_grad():
                for u in units:
                    eng.units[u].launch = eng.units[u].flat_params()
            rnd.quorum = quorum
            rnd.rendezvous = eng.comm.submit(self._jobs, rnd, contribute, None, True,
                                             stats=rnd.comm, cause="rounds")
            self.inflight = rnd

    def merge_inflight(self) -> None:
        """Wait for the delayed round in flight, vote, and merge it (or drop it)."""
        rnd, self.inflight = self.inflight, None
        if rnd is None:
            return
        error = None
        try:
            self._wait(rnd, rnd.rendezvous)
        except QuorumError as exc:
            error = str(exc).splitlines()[0][:200]
        self._end(rnd, rnd.quorum, error)

    def wait_inflight(self) -> None:
        """Wait for the jobs of the round in flight (no merge: that stays on schedule)."""
        if self.inflight is not None:
            try:
                self.inflight.rendezvous.result()
            except QuorumError:
                pass  # the vote at the merge drops it

    def _jobs(self, rnd: SyncRound, contribute: bool, elapsed: float | None,
              allow_skip: bool) -> None:
        """The round's collectives, in order, on the communication thread; the first
        failure ends the round (later collectives would run on a broken group). One job,
        counted into the round's own counters (its log entry's bytes) and, part by part,
        under the cause each part has in the plain mode's jobs: the rendezvous as A-EDiT's
        (``control``), the statistics and loss gathers, the reductions (``rounds``)."""
        eng = self.engine
        with eng.comm.counted_as("control"):
            got = eng.clock.exchange([eng.replica, float(contribute),
                                      eng.counters.steps_since_sync,
                                      self.group.committed_syncs, rnd.index, elapsed or 0.0,
                                      rnd.fragment])  # [quorum, 7]
        # The round's units: a streaming fragment's, which a joining replica (whose round
        # covers every unit) learns here; -1 everywhere: every unit.
        fragment = int(got[:, 6].max())
        if fragment != rnd.fragment:
            if rnd.fragment != -1 or contribute:
                raise QuorumError(f"rounds disagree on their units (fragment {rnd.fragment} "
                                  f"here, {fragment} elsewhere)")
            rnd.fragment, rnd.units = fragment, list(eng.fragments[fragment])
        rnd.members = [int(r) for r in got[:, 0].tolist()]
        rnd.contributes = [bool(c) for c in got[:, 1].tolist()]
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
            if allow_skip and any(rnd.contributes) and eng.clock.too_few(counts):
                rnd.skipped, rnd.units = True, []
                return
        if not any(rnd.contributes):
            rnd.units = []  # nobody trained since the last sync (a start or a join)
            return
        with eng.comm.counted_as("statistics"):
            if eng.config.penalty_enabled or rnd.step_counts is not None:
                eng.reduction.statistics(rnd)
            elif rnd.loss is not None:
                eng.reduction.replica_losses(rnd)
        for i in range(len(rnd.units)):
            eng.reduction.unit_job(rnd, i)  # (timed: the round's work_s)

    def _apply(self, rnd: SyncRound) -> None:
        """Committed: the outer steps, then the new anchors into the parameters (a delayed
        round: merged with the progress made since its launch, ``sync.merge``)."""
        eng = self.engine
        assert rnd.tentative is not None
        for i, u in enumerate(rnd.units):
            unit = eng.units[u]
            reduced = rnd.tentative.get(i)
            if reduced is not None:
                unit.outer_step(reduced)
            # (no reduction: nobody was trusted, the anchor stays)
            if rnd.delayed:
                unit.merge(eng.config.merge, eng.config.merge_alpha)
            else:
                unit.write_back()
