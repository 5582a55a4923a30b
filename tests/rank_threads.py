"""Each rank of a test's simulated job in a thread of its own: what it returned or raised."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def each_rank_in_a_thread(work: Callable[[int, Any], Any], ranks: dict[int, Any],
                          stagger_s: float, timeout_s: float) -> tuple[dict[int, Any], bool]:
    """Run ``work(rank, value)`` for each item of ``ranks`` in a thread of its own, started
    in the order given, ``stagger_s`` apart (so the first is the first to ask).

    Returns:
        What each rank's ``work`` returned, or the exception it raised (the test reads it);
        and whether every thread finished within ``timeout_s`` of the joins.
    """
    out: dict[int, Any] = {}

    def run(rank: int, value: Any) -> None:
        try:
            out[rank] = work(rank, value)
        except Exception as e:  # the test's thread: reported by the test
            out[rank] = e

    threads = [threading.Thread(target=run, args=item) for item in ranks.items()]
    for thread in threads:
        thread.start()
        time.sleep(stagger_s)
    for thread in threads:
        thread.join(timeout=timeout_s)
    return out, not any(thread.is_alive() for thread in threads)
