"""Test-suite wiring: a test that needs more than the per-test timeout is marked slow."""

from __future__ import annotations

import pytest


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
