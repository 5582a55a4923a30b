"""Check that the golden fixtures only gained sync entries at the end of their runs.

Usage: ``python scripts/golden_added_syncs.py [REV]`` (default ``HEAD``): compares every
fixture under ``tests/golden`` (``machines/`` included) in the working tree with the one
at git revision ``REV`` and exits 1 unless, for each:

* everything but the runs' ``syncs`` lists (and a ``patched`` list, see below) is
  equal, every float by its value and every other value exactly;
* each run's ``syncs`` starts with the recorded entries, unchanged, and what follows them
  are entries of rounds that ended at the run's last step (those that
  ``engine.finish(force=True)`` completes after the last step, which metrics.jsonl holds
  since they were logged; docs/golden.md, "Regenerations");
* a ``patched`` list, if one was added, names exactly the added entries (values a main
  fixture took from a replay on another machine: tests/test_golden.py compares them to
  tolerance there).

It prints, per fixture, the entries added.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = "tests/golden"


def at_revision(rev: str, path: str) -> Any:
    """The JSON of ``path`` at git revision ``rev`` (None if it did not exist)."""
    done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True,
                          text=True)
    return json.loads(done.stdout) if done.returncode == 0 else None


def fixture_paths() -> list[str]:
    """The CLI and DDP case fixtures, main and per machine (not the benchmark records)."""
    folder = ROOT / GOLDEN
    found = [*folder.glob("*.json"), *(folder / "machines").glob("*.json")]
    return sorted(str(p.relative_to(ROOT)) for p in found)


def check(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(problems, added entry paths)`` of one fixture."""
    problems, added = [], []
    new = dict(new)
    patched = new.pop("patched", [])
    old_patched = old.get("patched", [])
    if set(old) - {"patched"} != set(new):
        problems.append(f"top-level keys differ: {sorted(old)} vs {sorted(new)}")
    for key in set(old) & set(new) - {"runs"}:
        if old[key] != new[key]:
            problems.append(f"{key} changed")
    for run, was in old.get("runs", {}).items():
        now = new["runs"].get(run)
        if now is None:
            problems.append(f"run {run} missing")
            continue
        for key in set(was) | set(now):
            if key != "syncs" and was.get(key) != now.get(key):
                problems.append(f"runs.{run}.{key} changed")
        before, after = was.get("syncs", []), now.get("syncs", [])
        if after[:len(before)] != before:
            problems.append(f"runs.{run}.syncs: a recorded entry changed")
        steps = [r["step"] for r in now.get("steps", []) if isinstance(r.get("step"), int)]
        last = max(steps, default=None)
        for i, entry in enumerate(after[len(before):], start=len(before)):
            if entry.get("step") != last:
                problems.append(f"runs.{run}.syncs[{i}]: step {entry.get('step')} is not "
                                f"the run's last step ({last})")
            added.append(f"runs.{run}.syncs[{i}]")
    new_paths = [p for patch in patched[len(old_patched):] for p in patch["paths"]]
    if patched[:len(old_patched)] != old_patched:
        problems.append("a recorded 'patched' entry changed")
    if new_paths and sorted(new_paths) != sorted(added):
        problems.append(f"'patched' names {new_paths}, the added entries are {added}")
    return problems, added


def main(argv: list[str]) -> int:
    rev = argv[0] if argv else "HEAD"
    failed = False
    for path in fixture_paths():
        old = at_revision(rev, path)
        if old is None:
            print(f"{path}: new (not at {rev})")
            failed = True
            continue
        problems, added = check(old, json.loads((ROOT / path).read_text()))
        failed |= bool(problems)
        print(f"{path}: " + ("; ".join(problems) if problems else
                             f"unchanged, {len(added)} entries added {added}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
