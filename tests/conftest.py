"""Test-suite wiring: a test that needs more than the per-test timeout is marked slow; the
ranks that tests start with :func:`editrain.spawn.run_ranks` are forked from a server that
has imported torch and editrain once; editrain's bytecode is compiled once for the session
when the environment says not to write it (see :func:`_compile_once`)."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from editrain.spawn import START_METHOD_ENV

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "editrain.api",
           "editrain.train", "tests.reference", "torch._dynamo"]
"""Modules the fork server imports before it forks any rank (a module that does not exist
is skipped). A spawned rank imports torch and editrain again, several CPU seconds each;
a forked one starts in a fraction of a second. ``torch._dynamo``: torch imports it when a
process builds its first optimizer, 0.4 CPU s in every rank that trains (it starts no
thread)."""


COMPILED_ENV = "EDITRAIN_TESTS_COMPILED"
"""Set once :func:`_compile_once` has compiled the sources, so that the pytest processes
this session starts (pytest-xdist's workers, a test's own pytest) do not compile again."""
_CREATED = pytest.StashKey[list[Path]]()


def _compile_once(config: pytest.Config) -> None:
    """Compile editrain and the tests to bytecode once, when ``PYTHONDONTWRITEBYTECODE``
    (``sys.dont_write_bytecode``) is set, as it is on CI's machines; the files this writes
    are removed at the end of the session (:func:`pytest_unconfigure`), so the tree is left
    as the setting wants it.

    Without it, every process the suite starts (each ``editrain`` command, launcher and
    rank) compiles what it imports of editrain from source: about 22,000 lines for a
    training rank, 0.25 of the 4.7 CPU-s its imports take (``import editrain.train``, 6
    interleaved pairs, 2-core AMD EPYC), and the suite starts hundreds of them.
    Python reads bytecode that exists whatever the setting; ``compileall`` writes it
    explicitly. Nothing is done in pytest-xdist's workers (the controller compiled before
    it started them), when the tree is read-only (the tests only run slower), or when the
    files are there already.
    """
    if (not sys.dont_write_bytecode or hasattr(config, "workerinput")
            or os.environ.get(COMPILED_ENV)):
        return
    import editrain

    roots = [Path(editrain.__file__).resolve().parent, Path(__file__).resolve().parent]

    def compiled() -> set[Path]:
        return {p for root in roots for p in root.rglob("__pycache__/*.pyc")}

    before = compiled()
    try:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0",
                        *map(str, roots)], check=True, stdout=subprocess.DEVNULL,
                       timeout=600)
    except (OSError, subprocess.SubprocessError):
        pass  # what it wrote is still removed at the end
    config.stash[_CREATED] = sorted(compiled() - before)
    os.environ[COMPILED_ENV] = "1"


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the bytecode :func:`_compile_once` wrote, and the ``__pycache__`` folders it
    made (those left empty)."""
    created = config.stash.get(_CREATED, [])
    for path in created:
        path.unlink(missing_ok=True)
    for folder in sorted({p.parent for p in created}, reverse=True):
        try:
            folder.rmdir()
        except OSError:  # not empty: something else keeps files there
            pass


def pytest_configure(config: pytest.Config) -> None:
    """Compile editrain's bytecode once (:func:`_compile_once`). Start ranks with the fork
    server (unless :data:`START_METHOD_ENV` says otherwise).

    The server is started once, from this process, at the first ``run_ranks``; a rank forks
    from it, a process that never ran a torch operation or started a thread, so that the
    fork is as clean as a spawn. Ranks get their environment from the server (this
    process's at that moment); ``run_ranks`` sets what they need (rank, world, port)."""
    _compile_once(config)
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    if os.environ.setdefault(START_METHOD_ENV, "forkserver") == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory):
    """One token cache for the training runs of every module in this process: a corpus
    setting's entry (its tokenizer trained, its splits encoded, about 3 s) is built once,
    not once per module or test. The tests of the cache itself use caches of their own."""
    return tmp_path_factory.mktemp("data-cache")


SPREAD_MODULES = frozenset({"test_bench.py", "test_fault_tolerance.py", "test_examples.py"})
"""Modules whose tests share nothing expensive (a module fixture at most trains a tokenizer)
and run long: with ``pytest -n N --dist loadscope`` (README's test command) each of their
tests is a unit of its own that any worker may take, and they are handed out first, so the
long ones spread over the workers. Every other module is one unit, run by one worker, so
that its module-scoped fixtures (a spawn shared by many cases, a checkpointed run) run once,
not once per worker."""


def _unit(nodeid: str) -> str:
    """The scheduling unit of a test: its own id in :data:`SPREAD_MODULES`, else its
    module."""
    module = nodeid.split("::", 1)[0]
    return nodeid if module.rsplit("/", 1)[-1] in SPREAD_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadscope`` with :func:`_unit` as the scope (pytest-xdist's scheduler of
    scopes, which hands units out in collection order with ``--no-loadscope-reorder``);
    other ``--dist`` modes are pytest-xdist's own."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleScheduling(config, log)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
"""An object's default repr in a test id (``<object object at 0x7f...>``): another address
in every process, so two pytest-xdist workers collect different tests."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test whose own ``@pytest.mark.timeout(N)`` exceeds the suite's
    ``timeout`` (120 s): it says itself that it is slow (the benchmark smoke tests). In a
    pytest-xdist worker, put the tests of :data:`SPREAD_MODULES` first (every worker sorts
    alike, so their collections still agree), so that they are handed out first."""
    unstable = [item.nodeid for item in items if _ADDRESS.search(item.nodeid)]
    if unstable:  # each xdist worker would name it otherwise, and the run fails to start
        raise pytest.UsageError("test ids that hold an object's address (give the "
                                "parametrization ids=): " + ", ".join(unstable[:5]))
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.path.name not in SPREAD_MODULES)  # stable
    try:
        default = float(config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout not loaded
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        if default and marker is not None and marker.args and float(marker.args[0]) > default:
            item.add_marker(pytest.mark.slow)
