"""Test-suite wiring: a test that needs more than the per-test timeout is marked slow; the
ranks that tests start with :func:`editrain.spawn.run_ranks` are forked from a server that
has imported torch and editrain once."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from editrain.spawn import START_METHOD_ENV

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "editrain.api",
           "editrain.train", "tests.reference"]
"""Modules the fork server imports before it forks any rank (a module that does not exist
is skipped). A spawned rank imports torch and editrain again, several CPU seconds each;
a forked one starts in a fraction of a second."""


def pytest_configure(config: pytest.Config) -> None:
    """Start ranks with the fork server (unless :data:`START_METHOD_ENV` says otherwise).

    The server is started once, from this process, at the first ``run_ranks``; a rank forks
    from it, a process that never ran a torch operation or started a thread, so that the
    fork is as clean as a spawn. Ranks get their environment from the server (this
    process's at that moment); ``run_ranks`` sets what they need (rank, world, port)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    if os.environ.setdefault(START_METHOD_ENV, "forkserver") == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test whose own ``@pytest.mark.timeout(N)`` exceeds the suite's
    ``timeout`` (120 s): it says itself that it is slow (the benchmark smoke tests)."""
    try:
        default = float(config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout not loaded
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        if default and marker is not None and marker.args and float(marker.args[0]) > default:
            item.add_marker(pytest.mark.slow)
