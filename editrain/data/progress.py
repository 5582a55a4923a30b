"""Progress of a slow token-cache build, drawn with ``rich`` on stderr when it is a terminal.

A build reads the whole corpus several times (describing documents for the split, training
the tokenizer, tokenising each side). :class:`BuildProgress` shows one bar for the whole
build: each pass's document stream is wrapped, and every character it reads counts as much
work as the pass costs per character (:meth:`BuildProgress.track`), against the cost of all
passes (:meth:`BuildProgress.expect`) times the corpus's size, so the time left is the
whole build's. The size is first estimated from the files (``expected_chars``), then
counted by the first pass. Quick builds, tests, pipes and ``--quiet`` runs stay silent:
nothing is drawn unless it is enabled, stderr is a terminal and the build has been running
for ``PROGRESS_DELAY_S``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator

from .sources import Document

__all__ = ["PROGRESS_DELAY_S", "BuildProgress"]

PROGRESS_DELAY_S = 2.0
"""A build shows its progress only once it has been running this many seconds."""

_REFRESH_S = 0.2  # least time between two updates of the bar


class BuildProgress:
    """One progress bar for a whole build, counted in weighted characters of text.

    Use as a context manager, so the bar is removed when the build ends.

    Args:
        enabled: False draws nothing at all (``quiet``).
        delay: Seconds the build must have been running before anything is drawn.
        expected_chars: The corpus's size as far as known before reading it (file sizes),
            or None; the first pass replaces it by the characters it counted.
    """

    def __init__(self, enabled: bool = True, delay: float = PROGRESS_DELAY_S,
                 expected_chars: int | None = None) -> None:
        self._enabled = enabled and sys.stderr.isatty()
        self._show_at = time.monotonic() + delay
        self._bar = None
        self._task = None
        self.expected_chars = expected_chars
        self._counted = False  # whether expected_chars was counted by a pass
        self._passes = 1.0  # cost of the whole build, in corpus-sized passes
        self.done = 0.0
        """Work done so far, in weighted characters."""

    def __enter__(self) -> BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    @property
    def total(self) -> float | None:
        """The whole build's work in weighted characters (None while the size is unknown)."""
        if self.expected_chars is None:
            return None
        return self._passes * self.expected_chars

    def expect(self, passes: float) -> None:
        """Set the cost of the whole build, in corpus-sized passes of cost 1 per character
        (say 1 for describing every document, plus 4 for encoding it)."""
        self._passes = max(float(passes), 1e-9)

    def track(self, docs: Iterable[Document], label: str, cost: float = 1.0
              ) -> Iterator[Document]:
        """Yield ``docs`` unchanged while the bar follows the characters read.

        Args:
            docs: One whole pass over the corpus.
            label: What the pass does, shown in front of the bar.
            cost: Work per character of this pass (the unit of :meth:`expect`).
        """
        chars, next_update = 0, 0.0
        for doc in docs:
            yield doc
            chars += len(doc.text)
            self.done += cost * len(doc.text)
            if not self._enabled:
                continue
            now = time.monotonic()
            if now >= next_update and now >= self._show_at:
                self._update(label)
                next_update = now + _REFRESH_S
        if not self._counted:
            self.expected_chars, self._counted = chars, True

    def _update(self, label: str) -> None:
        total = self.total
        if total is not None:
            # An estimate from file sizes can fall short of the text (decoding); never
            # show more than all of it done.
            total = max(total, self.done)
        if self._task is not None:
            self._bar.update(self._task, completed=self.done, total=total, description=label)
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                             TextColumn("{task.percentage:>3.0f}%"), TimeRemainingColumn(),
                             console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task(label, total=total, completed=self.done)
        # Started once it has a task, so its first frame already shows the pass.
        self._bar.start()
