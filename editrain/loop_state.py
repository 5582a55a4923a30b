"""The trainer's loop state as one object: where the loop is, what is due next, its clocks.

:class:`LoopState` holds what :class:`editrain.train.Trainer` used to keep as loose
attributes. Part of it is saved in every rank's JSON of a checkpoint
(:meth:`LoopState.to_dict`, the keys and values exactly as before this class existed) and
restored as one (:meth:`LoopState.from_dict`, checked against :data:`LOOP_STATE_SCHEMA`,
the loop's fields of :data:`editrain.checkpoint.RANK_STATE_SCHEMA`); the rest belongs to
this process only (steps it ran, the healing step, the replayed metrics rows).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from editrain.checkpoint import RANK_STATE_SCHEMA
from editrain.errors import CheckpointError
from editrain.safe_io import Obj

if TYPE_CHECKING:
    from editrain.metrics import ReplayMarks

SAVED = ("step", "next_eval", "next_ckpt", "last_eval", "finished", "wall_time_s",
         "off_train_s")
"""The keys of a rank's JSON that :meth:`LoopState.to_dict` writes, in the order written."""

LOOP_STATE_SCHEMA = Obj({k: RANK_STATE_SCHEMA.fields[k] for k in SAVED},
                        required=tuple(k for k in RANK_STATE_SCHEMA.required if k in SAVED))
"""The loop's part of :data:`editrain.checkpoint.RANK_STATE_SCHEMA` (the checkpoint's
layout is defined there; ``off_train_s`` is optional: checkpoints written before it
existed lack it and resume with 0)."""


def next_after(due: int, point: float, every: int) -> int:
    """``due`` advanced by ``every`` until it is past ``point`` (unchanged when ``every``
    is 0): the next evaluation or checkpoint after the one taken at ``point``. Computed,
    not looped, so a far ``point`` costs nothing."""
    if not every or due > point:
        return due
    return due + (int((point - due) // every) + 1) * every


def first_due_after(point: float, every: int) -> int:
    """The first multiple of ``every`` past ``point`` (0 when ``every`` is 0: never due):
    where a run that always had this interval has its next evaluation or checkpoint after
    ``point``. A new run's are due at ``every``, then each one ``every`` after the last
    (:func:`next_after`), so whole multiples of the interval."""
    if not every:
        return 0
    return (int(point // every) + 1) * every


@dataclasses.dataclass
class LoopState:
    """Where one rank's training loop is.

    Saved in checkpoints (:meth:`to_dict`): ``step``, ``next_eval``, ``next_ckpt``,
    ``last_eval``, ``finished``, the wall clock (``wall_time_s``) and ``off_train_s``.
    This process's own: ``steps_run``, ``val_tokens``, ``healed_at``, ``replays``,
    ``resumed_from``, ``elastic`` and the clock's start.
    """

    next_eval: int
    """The progress at which the next evaluation is due."""
    next_ckpt: int
    """The progress at which the next periodic checkpoint is due."""
    step: int = 0
    """Inner steps of this replica (a resume continues the count)."""
    last_eval: int = 0
    """The step of the latest evaluation."""
    finished: bool = False
    """A-EDiT: the last sync of the run has run (its budget is spent)."""
    wall_offset: float = 0.0
    """Wall time of the run before this process's clock started (a resume's)."""
    off_train_s: float = 0.0
    """Evaluation and checkpoint time, kept out of ``train_time_s``."""
    steps_run: int = 0
    """Inner steps this process ran (a healed replica adopts its peers' step count)."""
    val_tokens: int = 0
    """Tokens of the latest evaluation."""
    healed_at: int | None = None
    """The step at which this replica joined a running job from a peer (``--ft``)."""
    replays: ReplayMarks | None = None
    """How this job marks its rows up to the highest step already in ``metrics.jsonl``
    when it resumed (a replay, or a row the earlier job died before writing); None: its
    rows are new (no resume, or one that computes other rows)."""
    resumed_from: Path | None = None
    """The checkpoint this process resumed from (a path), or None."""
    elastic: bool = False
    """The resume changed the topology."""
    tokens_base: int | None = None
    """The run's tokens when this process resumed it (the checkpoint's ``tokens``); None:
    a new run, or a checkpoint written before it was saved."""
    progress_base: float = 0.0
    """The engine's progress in steps when this process resumed the run: the tokens since
    count at this process's global batch, whatever the run's was before."""
    wall_start: float = dataclasses.field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when this process's clock started."""

    def wall(self) -> float:
        """The run's wall time: the resumed offset plus this process's clock."""
        return self.wall_offset + time.perf_counter() - self.wall_start

    def start_clock(self) -> None:
        """This process's wall clock starts now (after building, before the loop)."""
        self.wall_start = time.perf_counter()

    def to_dict(self) -> dict[str, Any]:
        """The saved part, as a rank's JSON holds it (the wall clock read now)."""
        return {"step": self.step, "next_eval": self.next_eval, "next_ckpt": self.next_ckpt,
                "last_eval": self.last_eval, "finished": self.finished,
                "wall_time_s": self.wall(), "off_train_s": self.off_train_s}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], where: str = "rank state") -> LoopState:
        """The saved part back (its clock starting now), checked first.

        Args:
            state: a rank's JSON (other keys are ignored).
            where: the file, named in an error.

        Raises:
            CheckpointError: a field is missing or out of range (one line naming ``where``
                and the field).
        """
        LOOP_STATE_SCHEMA.check(dict(state), where, "", CheckpointError)
        return cls(step=state["step"], next_eval=state["next_eval"],
                   next_ckpt=state["next_ckpt"], last_eval=state["last_eval"],
                   finished=state["finished"], wall_offset=state["wall_time_s"],
                   off_train_s=state.get("off_train_s", 0.0))

    def skip_due(self, point: float, eval_every: int, ckpt_every: int) -> None:
        """Move the next evaluation and checkpoint past ``point``: those due at or before
        it were taken (by the peers of a healed replica, whose schedule it adopted; a
        resume takes its own job's intervals instead, :meth:`reschedule`)."""
        self.next_eval = next_after(self.next_eval, point, eval_every)
        self.next_ckpt = next_after(self.next_ckpt, point, ckpt_every)

    def reschedule(self, point: float, eval_every: int, ckpt_every: int) -> None:
        """Due next: the first evaluation and checkpoint past ``point`` of a run with these
        intervals (a resume's, at the checkpoint's progress). Not the saved ones advanced:
        those follow the intervals the checkpoint was written with, so a job resumed with
        another ``train.eval_every`` or ``checkpoint.every`` kept the old schedule's next
        one (eval_every 3 -> 2 at step 8: evaluations at 9, 11, ... instead of 10, 12).
        With the same intervals the two agree (the saved ones are multiples of them too),
        so an exact resume goes on as the run without the stop."""
        self.next_eval = first_due_after(point, eval_every)
        self.next_ckpt = first_due_after(point, ckpt_every)

    def heal_state(self, step: int) -> dict[str, Any]:
        """What a healthy replica sends one that (re)joins, of the loop: ``step`` (the
        engine's global step) and the schedule."""
        return {"step": step, "next_eval": self.next_eval, "next_ckpt": self.next_ckpt,
                "last_eval": self.last_eval, "tokens_base": self.tokens_base,
                "progress_base": self.progress_base}

    def adopt(self, sd: Mapping[str, Any]) -> None:
        """Take a peer's :meth:`heal_state`: this replica has healed at its step."""
        self.step = int(sd["step"])
        self.next_eval, self.next_ckpt = sd["next_eval"], sd["next_ckpt"]
        self.last_eval = sd["last_eval"]
        # the peers' token count (a run resumed at another global batch counts from there)
        self.tokens_base, self.progress_base = sd.get("tokens_base"), sd.get("progress_base",
                                                                             0.0)
        self.healed_at = self.step
