"""tests/conftest.py's bytecode for the processes the suite starts: compiled once when the
environment says not to write it, and removed again at the end."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import editrain
from tests import conftest


def test_every_editrain_module_has_its_bytecode_for_the_processes_the_suite_starts():
    """With PYTHONDONTWRITEBYTECODE (CI's machines) the session compiled it; without, the
    imports wrote it. Either way a process the suite starts reads it instead of compiling
    the source again."""
    root = Path(editrain.__file__).resolve().parent
    if not os.access(root, os.W_OK):
        pytest.skip(f"{root} is read-only: nothing can be compiled into it")
    if sys.dont_write_bytecode:
        assert os.environ.get(conftest.COMPILED_ENV) == "1"
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 100
    missing = [str(p.relative_to(root)) for p in sources
               if not Path(importlib.util.cache_from_source(str(p))).is_file()]
    if not sys.dont_write_bytecode:  # only what this process imported was written
        imported = {Path(m.__file__).resolve() for m in list(sys.modules.values())
                    if getattr(m, "__file__", None)}
        missing = [m for m in missing if root / m in imported]
    assert not missing, missing


def test_the_bytecode_written_is_removed_and_nothing_else(tmp_path):
    made = tmp_path / "pkg" / "__pycache__"
    made.mkdir(parents=True)
    kept = tmp_path / "other" / "__pycache__"
    kept.mkdir(parents=True)
    created = [made / "a.cpython-311.pyc", made / "b.cpython-311.pyc",
               kept / "c.cpython-311.pyc"]
    for path in created:
        path.write_bytes(b"x")
    (kept / "older.cpython-311.pyc").write_bytes(b"y")  # there before the session
    config = SimpleNamespace(stash=pytest.Stash())
    config.stash[conftest._CREATED] = created
    conftest.pytest_unconfigure(config)
    assert not made.exists()  # emptied: removed
    assert sorted(p.name for p in kept.iterdir()) == ["older.cpython-311.pyc"]
    conftest.pytest_unconfigure(SimpleNamespace(stash=pytest.Stash()))  # compiled nothing


def test_a_child_that_tests_ctrl_c_gets_sigint_as_in_a_terminal():
    """A suite started as a background job (``pytest ... &`` in a script) inherits SIGINT
    ignored, and so would every child a test starts to stop with Ctrl-C: editrain keeps an
    inherited ignore (``nohup``), and the child would sleep through the signal.
    ``tests.cli.sigint_as_in_a_terminal`` gives such a child the default back."""
    import signal
    import subprocess

    from tests.cli import sigint_as_in_a_terminal

    probe = [sys.executable, "-c", "import signal; "
             "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job has it
    try:
        inherited = subprocess.run(probe, capture_output=True, text=True, check=True)
        reset = subprocess.run(probe, capture_output=True, text=True, check=True,
                               preexec_fn=sigint_as_in_a_terminal)
    finally:
        signal.signal(signal.SIGINT, old)
    assert inherited.stdout.strip() == "False"
    assert reset.stdout.strip() == "True"
