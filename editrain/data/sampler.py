"""Deterministic per-rank streams of fixed-length training sequences.

The token array is cut into ``N = (len(tokens) - 1) // seq_len`` windows that
do not overlap; window ``i`` covers ``tokens[i*seq_len : (i+1)*seq_len + 1]``
(the extra token provides the last target). Every epoch ``e`` shuffles the
window ids with ``np.random.default_rng([seed, e])`` and rank ``r`` of ``W``
reads ``perm[r::W]``, so ranks are disjoint within an epoch and together cover
every window. Nothing random is kept in the state: the permutation is
recomputed from ``(seed, epoch)``, which is what makes the state tiny and the
resume exact.

Elastic resume: :meth:`SequenceStream.repartition` moves a partially consumed
epoch from ``W_old`` ranks to ``W_new`` ranks. Each repartition appends one
*layout* ``[W_old, [consumed count of old rank 0, 1, ...]]`` to the state.
Replaying the layouts in order over the permutation reconstructs which windows
are already used; the new ranks then stride over what is left. Layouts are
dropped at the next epoch boundary, where the new world size takes over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from editrain.errors import plain_count

if TYPE_CHECKING:  # imported where a batch is made: editrain.data loads without torch
    import torch

__all__ = ["EvalBatch", "SequenceStream", "check_batch_size", "eval_batches", "val_batches"]


def _num_windows(tokens: np.ndarray, seq_len: int) -> int:
    seq_len = plain_count(seq_len, "train.seq_len")  # as the config option is checked
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {np.shape(tokens)}")
    return max(0, (len(tokens) - 1) // seq_len)


def _gather(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int) -> torch.Tensor:
    """Rows ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` for each window id, as int64."""
    import torch

    idx = np.asarray(window_ids, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len + 1)
    # Fancy indexing copies out of the memmap; int64 is what embedding and
    # cross-entropy expect, and the on-disk dtype is unsigned (not torch-friendly).
    return torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64))


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not (0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def _normalise_layouts(layouts) -> list[list]:
    """Validate layouts and convert them to plain ``[int, [int, ...]]`` lists."""
    out = []
    for layout in layouts:
        world, counts = layout
        counts = [int(c) for c in counts]
        if int(world) != len(counts) or any(c < 0 for c in counts):
            raise ValueError(f"malformed consumed layout {layout!r}")
        out.append([int(world), counts])
    return out


class SequenceStream:
    """Infinite, resumable stream of training windows for one rank.

    Args:
        tokens: 1-D array of token ids (e.g. ``TokenData.train``).
        seq_len: Tokens per input sequence; each row has ``seq_len + 1`` ids.
        rank: This rank's index in ``[0, world_size)``.
        world_size: Number of ranks that share the data.
        seed: Shuffle seed; all ranks must use the same value.

    Raises:
        ValueError: Fewer windows than ranks (message names ``train.seq_len``).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, rank: int, world_size: int, seed: int):
        _check_rank(rank, world_size)
        self.tokens = tokens
        self.seq_len = plain_count(seq_len, "train.seq_len")  # int(2.5) would be 2
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.num_windows = _num_windows(tokens, seq_len)
        if self.num_windows < self.world_size:
            raise ValueError(
                f"corpus too small: {len(tokens)} tokens give {self.num_windows} windows of "
                f"train.seq_len={self.seq_len}, fewer than world size {self.world_size}; "
                "use more data or a smaller train.seq_len"
            )
        self.epoch = 0
        self.position = 0
        # Layouts of earlier world sizes that consumed part of the current epoch.
        self._layouts: list[list] = []
        self._share: np.ndarray | None = None

    # -- epoch bookkeeping -------------------------------------------------

    def _permutation(self, epoch: int) -> np.ndarray:
        # A list seed hashes both numbers, so nearby (seed, epoch) pairs still
        # give unrelated permutations.
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    @staticmethod
    def _remaining_positions(num_windows: int, layouts: list[list]) -> np.ndarray:
        """Permutation positions not consumed by ``layouts``, in order."""
        used = np.zeros(num_windows, dtype=bool)
        for world, counts in layouts:
            remaining = np.flatnonzero(~used)
            for r, count in enumerate(counts):
                used[remaining[r::world][:count]] = True
        return np.flatnonzero(~used)

    def _current_share(self) -> np.ndarray:
        if self._share is None:
            perm = self._permutation(self.epoch)
            if self._layouts:
                positions = self._remaining_positions(self.num_windows, self._layouts)
                self._share = perm[positions[self.rank :: self.world_size]]
            else:
                self._share = perm[self.rank :: self.world_size]
        return self._share

    @property
    def share_size(self) -> int:
        """Number of windows this rank reads in the current epoch."""
        return len(self._current_share())

    # -- reading -----------------------------------------------------------

    def next_window_ids(self, count: int) -> np.ndarray:
        """Advance the stream by ``count`` windows and return their ids.

        Args:
            count: Number of windows to take.

        Returns:
            int64 array of window ids, crossing epoch boundaries as needed.
        """
        taken: list[np.ndarray] = []
        need = int(count)
        while need > 0:
            share = self._current_share()
            if self.position >= len(share):
                # Rollover is lazy (on the next read), so a state saved right
                # after the last window still says "this epoch, all consumed".
                self.epoch += 1
                self.position = 0
                self._layouts = []
                self._share = None
                continue
            take = min(need, len(share) - self.position)
            taken.append(share[self.position : self.position + take])
            self.position += take
            need -= take
        if not taken:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(taken).astype(np.int64)

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """Return the next ``batch_size`` windows.

        Args:
            batch_size: Rows in the batch.

        Returns:
            ``torch.LongTensor`` of shape ``[batch_size, seq_len + 1]``; inputs
            are ``[:, :-1]`` and targets ``[:, 1:]``.
        """
        batch_size = plain_count(batch_size, "batch_size")
        return _gather(self.tokens, self.next_window_ids(batch_size), self.seq_len)

    # -- state -------------------------------------------------------------

    def state_dict(self) -> dict:
        """Small, JSON-friendly state for checkpointing.

        Returns:
            Dict with ints ``epoch``, ``position``, ``rank``, ``world_size``,
            ``seed``, ``num_windows``, ``seq_len`` and ``consumed_layouts``
            (list of ``[world_size, [count per rank]]``, empty unless this
            epoch was repartitioned).
        """
        return {
            "epoch": self.epoch,
            "position": self.position,
            "rank": self.rank,
            "world_size": self.world_size,
            "seed": self.seed,
            "num_windows": self.num_windows,
            "seq_len": self.seq_len,
            "consumed_layouts": [[w, list(c)] for w, c in self._layouts],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by :meth:`state_dict` of a compatible stream.

        Args:
            state: The saved state.

        Raises:
            ValueError: seed, num_windows, seq_len, world_size or rank differ
                (use :meth:`repartition` when the world size changed), or the
                position is out of range.
        """
        for key in ("seed", "num_windows", "world_size", "rank", "seq_len"):
            if key not in state:
                if key == "seq_len":
                    continue  # optional: num_windows already guards most mismatches
                raise ValueError(f"data stream state lacks {key!r}")
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"data stream state mismatch: saved {key}={state[key]}, current "
                    f"{key}={getattr(self, key)}"
                    + (
                        "; use SequenceStream.repartition for a new world size"
                        if key in ("world_size", "rank")
                        else ""
                    )
                )
        epoch = int(state["epoch"])
        layouts = _normalise_layouts(state.get("consumed_layouts", []))
        if epoch < 0:
            raise ValueError(f"invalid epoch {epoch} in data stream state")
        self.epoch, self._layouts, self._share = epoch, layouts, None
        position = int(state["position"])
        if not (0 <= position <= self.share_size):
            raise ValueError(
                f"invalid position {position} in data stream state (share has {self.share_size})"
            )
        self.position = position

    # -- elastic resume ----------------------------------------------------

    @classmethod
    def repartition(
        cls,
        tokens: np.ndarray,
        seq_len: int,
        seed: int,
        old_states: list[dict],
        new_rank: int,
        new_world_size: int,
    ) -> SequenceStream:
        """Build rank ``new_rank``'s stream after the world size changed.

        The current epoch is the minimum epoch ``E`` over ``old_states``. Old
        ranks still in ``E`` contributed their ``position`` consumed windows;
        old ranks already past ``E`` (their share was one window shorter, so
        they rolled over first) count as having consumed their whole ``E``
        share, and whatever they read in the next epoch is forgotten, so those
        few windows are seen again in epoch ``E + 1``. The windows of ``E`` not
        yet consumed are then dealt to the new ranks in permutation order,
        strided by ``new_world_size``; from epoch ``E + 1`` on it is a normal
        stream with the new world size.

        Args:
            tokens: The same token array the old streams used.
            seq_len: The same sequence length.
            seed: The same seed.
            old_states: ``state_dict()`` of every old rank (any order).
            new_rank: Rank of the stream to build.
            new_world_size: New number of ranks.

        Returns:
            A stream whose :meth:`state_dict` round-trips exactly.

        Raises:
            ValueError: The states are incomplete or inconsistent with the
                arguments.
        """
        stream = cls(tokens, seq_len, new_rank, new_world_size, seed)
        if not old_states:
            raise ValueError("repartition needs the state of every old rank, got none")
        old_world = int(old_states[0]["world_size"])
        ranks = sorted(int(s["rank"]) for s in old_states)
        if ranks != list(range(old_world)):
            raise ValueError(
                f"repartition needs exactly one state per old rank 0..{old_world - 1}, got ranks {ranks}"
            )
        for s in old_states:
            for key, want in (
                ("world_size", old_world),
                ("seed", stream.seed),
                ("num_windows", stream.num_windows),
            ):
                if int(s[key]) != want:
                    raise ValueError(
                        f"old data stream state of rank {s['rank']} has {key}={s[key]}, expected {want}"
                    )
        epoch = min(int(s["epoch"]) for s in old_states)
        at_epoch = [s for s in old_states if int(s["epoch"]) == epoch]
        layouts = _normalise_layouts(at_epoch[0].get("consumed_layouts", []))
        for s in at_epoch[1:]:
            if _normalise_layouts(s.get("consumed_layouts", [])) != layouts:
                raise ValueError("old ranks in the same epoch disagree on consumed_layouts")
        # Windows left for the old ranks to stride over in epoch E.
        left = stream.num_windows - sum(sum(c) for _, c in layouts)
        counts = [0] * old_world
        for s in old_states:
            r = int(s["rank"])
            share_len = len(range(r, left, old_world))
            if int(s["epoch"]) == epoch:
                pos = int(s["position"])
                if not (0 <= pos <= share_len):
                    raise ValueError(
                        f"old rank {r} has position {pos} beyond its share {share_len}"
                    )
                counts[r] = pos
            else:
                counts[r] = share_len
        if any(counts):
            # An all-zero layout removes nothing, so it is left out.
            layouts.append([old_world, counts])
        stream.epoch = epoch
        stream._layouts = layouts
        stream._share = None
        return stream


def check_batch_size(tokens: np.ndarray, seq_len: int, batch_size: int,
                     world_size: int) -> int:
    """Check that every rank can draw a batch of distinct windows from one epoch's share.

    A rank's share of an epoch is ``num_windows // world_size`` windows (or one more).
    :meth:`SequenceStream.next_batch` crosses epochs to fill a larger batch, repeating
    windows inside it, and for an absurd ``batch_size`` never returns; the launcher calls
    this first so such a value fails with one line instead.

    Args:
        tokens: the training token ids.
        seq_len: tokens per sequence (``train.seq_len``).
        batch_size: sequences per micro-batch and rank (``train.batch_size``).
        world_size: data-parallel ranks that share the corpus.

    Returns:
        The largest batch size allowed (windows of the smallest share).

    Raises:
        ValueError: naming ``train.batch_size`` and the largest value allowed.
    """
    _check_rank(0, world_size)
    windows = _num_windows(tokens, seq_len)
    most = windows // world_size
    if not 1 <= batch_size <= most:
        raise ValueError(
            f"train.batch_size: at most {most} for this corpus and {world_size} data ranks "
            f"({len(tokens)} training tokens give {windows} windows of train.seq_len="
            f"{seq_len}), got {batch_size}; lower train.batch_size or train.seq_len, or use "
            "more data")
    return most


class EvalBatch(NamedTuple):
    """One forward pass of an evaluation.

    Args:
        tokens: ``int64[rows, length + 1]`` (inputs and shifted targets).
        targets: Number of target tokens that count; 0 for the padding passes that keep
            every rank's number of forwards equal (FSDP all-gathers in each forward).
    """

    tokens: torch.Tensor
    targets: int


def eval_batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    rank: int,
    world_size: int,
    max_tokens: int = 0,
) -> list[EvalBatch]:
    """This rank's share of an evaluation over the whole validation split.

    The split is cut into windows of ``seq_len`` targets that do not overlap,
    ``tokens[i*seq_len : (i+1)*seq_len + 1]``, plus one shorter window for the
    remainder, so every token but the first is predicted exactly once:
    ``len(tokens) - 1`` targets in all. Window ``i`` goes to rank ``i % world_size``.
    Every rank gets the same number of forward passes (ranks with less work get
    padding passes with ``targets == 0``), because a sharded model's forward is a
    collective.

    Args:
        tokens: 1-D validation token ids (e.g. ``TokenData.val``).
        seq_len: Targets per window.
        batch_size: Windows per forward pass.
        rank: This rank.
        world_size: Number of ranks sharing the evaluation.
        max_tokens: If > 0, evaluate about this many targets only (``train.eval_tokens``):
            whole windows spread evenly over the split, not a prefix.

    Returns:
        The rank's :class:`EvalBatch` list; equally long on every rank.

    Raises:
        ValueError: The split has fewer than 2 tokens, or a bad size.
    """
    import torch

    _check_rank(rank, world_size)
    if batch_size < 1 or max_tokens < 0:
        raise ValueError(f"batch_size must be positive and max_tokens >= 0, got "
                         f"{batch_size}, {max_tokens}")
    full = _num_windows(tokens, seq_len)
    rest = len(tokens) - 1 - full * seq_len
    if full == 0 and rest <= 0:
        raise ValueError(f"validation split too small: {len(tokens)} tokens")
    ids = np.arange(full, dtype=np.int64)
    if 0 < max_tokens < len(tokens) - 1:
        k = max(1, min(full, -(-max_tokens // seq_len)))
        ids = ((np.arange(k) + 0.5) * full / k).astype(np.int64)
        rest = 0
    per_rank = [ids[r::world_size] for r in range(world_size)]
    tail_rank = len(ids) % world_size  # the remainder window continues the round robin
    passes = [-(-len(w) // batch_size) + int(rest > 0 and r == tail_rank)
              for r, w in enumerate(per_rank)]
    mine = per_rank[rank]
    out = [EvalBatch(_gather(tokens, mine[i : i + batch_size], seq_len),
                     len(mine[i : i + batch_size]) * seq_len)
           for i in range(0, len(mine), batch_size)]
    if rest > 0 and rank == tail_rank:
        start = full * seq_len
        tail = np.asarray(tokens[start : start + rest + 1]).astype(np.int64)
        out.append(EvalBatch(torch.from_numpy(tail)[None, :], rest))
    pad = out[0].tokens if out else _gather(tokens, ids[:1], seq_len) if len(ids) else None
    if pad is None:  # no full window at all: pad with the remainder's shape
        pad = torch.from_numpy(np.asarray(tokens[: rest + 1]).astype(np.int64))[None, :]
    out += [EvalBatch(pad, 0)] * (max(passes) - len(out))
    return out


def val_batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    max_batches: int,
    rank: int,
    world_size: int,
) -> list[torch.Tensor]:
    """Fixed windows from the start of the validation split (kept for scripts that
    want a quick, fixed sample; the trainer evaluates with :func:`eval_batches`).

    Rank ``r`` gets windows ``r, r + W, r + 2W, ...`` from the start of
    ``tokens``, the same count on every rank, at most ``max_batches * batch_size``.

    Args:
        tokens: 1-D validation token ids (e.g. ``TokenData.val``).
        seq_len: Tokens per input sequence.
        batch_size: Rows per batch.
        max_batches: Upper bound on the number of batches.
        rank: This rank.
        world_size: Number of ranks.

    Returns:
        List of ``torch.LongTensor`` of shape ``[rows, seq_len + 1]``.

    Raises:
        ValueError: The split has fewer windows than ranks.
    """
    _check_rank(rank, world_size)
    if batch_size < 1 or max_batches < 1:
        raise ValueError(
            f"batch_size and max_batches must be positive, got {batch_size}, {max_batches}"
        )
    n = _num_windows(tokens, seq_len)
    per_rank = min(n // world_size, batch_size * max_batches)
    if per_rank == 0:
        raise ValueError(
            f"validation split too small: {len(tokens)} tokens give {n} windows of "
            f"train.seq_len={seq_len} for {world_size} ranks; raise data.val_tokens"
        )
    ids = rank + world_size * np.arange(per_rank, dtype=np.int64)
    return [
        _gather(tokens, ids[i : i + batch_size], seq_len) for i in range(0, per_rank, batch_size)
    ]
