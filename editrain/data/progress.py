"""Progress of a slow token-cache build, drawn with ``rich`` on stderr when it is a terminal.

A build reads the whole corpus several times (describing documents for the split, training
the tokenizer, tokenising each side). :class:`BuildProgress` wraps each pass's document stream
and shows one bar for the pass under way. Quick builds, tests, pipes and ``--quiet`` runs stay
silent: nothing is drawn unless it is enabled, stderr is a terminal and the build has been
running for ``PROGRESS_DELAY_S``.
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
    """One progress bar per pass over the corpus, counted in characters of text.

    The first pass learns the corpus's size; later passes show their share of it and the
    time left. Use as a context manager, so the bar is removed when the build ends.

    Args:
        enabled: False draws nothing at all (``quiet``).
        delay: Seconds the build must have been running before anything is drawn.
    """

    def __init__(self, enabled: bool = True, delay: float = PROGRESS_DELAY_S) -> None:
        self._enabled = enabled and sys.stderr.isatty()
        self._show_at = time.monotonic() + delay
        self._bar = None
        self._corpus_chars: int | None = None

    def __enter__(self) -> BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def track(self, docs: Iterable[Document], label: str) -> Iterator[Document]:
        """Yield ``docs`` unchanged while the bar follows the characters read.

        Args:
            docs: One whole pass over the corpus.
            label: What the pass does, shown in front of the bar.
        """
        if not self._enabled:
            yield from docs
            return
        done, task, next_update = 0, None, 0.0
        for doc in docs:
            yield doc
            done += len(doc.text)
            now = time.monotonic()
            if now >= next_update and now >= self._show_at:
                task = self._update(task, label, done)
                next_update = now + _REFRESH_S
        if task is not None:
            self._bar.remove_task(task)
        self._corpus_chars = done

    def _update(self, task, label: str, done: int):
        size = f"{done / 1e6:,.1f} M characters"
        if task is not None:
            self._bar.update(task, completed=done, size=size)
            return task
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[size]}"), TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=True)
        task = self._bar.add_task(label, total=self._corpus_chars, completed=done, size=size)
        # Started once it has a task, so its first frame already shows the pass.
        self._bar.start()
        return task
