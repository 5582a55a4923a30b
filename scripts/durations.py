#!/usr/bin/env python3
"""Per-module test times, from saved pytest output, into ``tests/durations.md``.

The suite runs in two parts (README.md's test command): the parallel part on two
pytest-xdist workers and the ``serial`` tests alone. Each part's output, saved with
``--durations=0`` (or its JUnit XML, ``--junitxml``), is read here; every test's setup,
call and teardown time is added to its module, and the modules are listed slowest first,
so the next slow test is seen when it lands. The exact commands are in tests/README.md.

    python scripts/durations.py --parallel parallel.log --serial serial.log \\
        -o tests/durations.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# One line of pytest's durations report: "12.34s call     tests/test_x.py::test_y[a]".
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+([^\s:]+)::\S")
# The last line of a run: "== 3 failed, 120 passed, 2 skipped in 491.23s (0:08:11) ==".
_SUMMARY = re.compile(r"\b(?:passed|failed|error|errors|skipped|deselected)\b.* in "
                      r"(\d+(?:\.\d+)?)s\b")


@dataclass
class Part:
    """One part of the suite (parallel or serial): seconds and test count per module."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    tests: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    wall_s: float | None = None
    """The run's own wall time from pytest's last line (None where it was not found)."""

    def add(self, module: str, test: str, seconds: float) -> None:
        self.seconds[module] += seconds
        self.tests[module].add(test)

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def parse_log(text: str) -> Part:
    """A pytest run's output with ``--durations=0``: each module's summed phases.

    Raises:
        ValueError: when the text holds no durations line (the run was not given
            ``--durations=0``, or this is not pytest's output).
    """
    part = Part()
    found = False
    for line in text.splitlines():
        m = _DURATION.match(line)
        if m:
            found = True
            seconds, _phase, module = float(m.group(1)), m.group(2), m.group(3)
            test = line[m.start(3):].strip()
            part.add(module, test, seconds)
            continue
        s = _SUMMARY.search(line)
        if s and line.lstrip()[:1] in "=0123456789":  # the run's last line wins
            part.wall_s = float(s.group(1))
    if not found:
        raise ValueError("no durations in the log: run pytest with --durations=0")
    return part


def _module_of(classname: str, file: str | None) -> str:
    """A JUnit test case's module path: its ``file`` attribute where pytest wrote one, or
    its dotted ``classname`` without the trailing class names (capitalised)."""
    if file:
        return file
    parts = classname.split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py"


def parse_junit(text: str) -> Part:
    """A JUnit XML report (``--junitxml``): each module's summed test times (pytest's
    ``time`` holds the setup, call and teardown of one test)."""
    root = ET.fromstring(text)
    part = Part()
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    wall = 0.0
    for suite in suites:
        wall += float(suite.get("time", 0.0))
        for case in suite.iter("testcase"):
            module = _module_of(case.get("classname", ""), case.get("file"))
            part.add(module, f"{module}::{case.get('name')}", float(case.get("time", 0.0)))
    if not part.seconds:
        raise ValueError("no test cases in the JUnit report")
    part.wall_s = wall
    return part


def read_part(path: Path) -> Part:
    """A saved log (any extension but .xml) or a JUnit XML report."""
    text = path.read_text(errors="replace")
    try:
        return parse_junit(text) if path.suffix == ".xml" else parse_log(text)
    except (ValueError, ET.ParseError) as e:
        raise ValueError(f"{path}: {e}") from None


def cpu_name() -> str:
    """The CPU's model name as lscpu gives it (with its widest AVX), else platform's."""
    name, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value
    except OSError:
        pass
    if not name:
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            name = next((x.split(":", 1)[1].strip() for x in out.splitlines()
                         if x.startswith("Model name")), "")
        except (OSError, subprocess.SubprocessError):
            pass
    name = name or platform.processor() or platform.machine()
    avx = "AVX-512" if "avx512f" in flags.split() else "AVX2" if "avx2" in flags.split() else ""
    return f"{name} ({avx})" if avx else name


def render(parallel: Part | None, serial: Part | None, cpu: str, cores: int,
           date: str) -> str:
    """The markdown of tests/durations.md: one row per module, slowest (both parts added)
    first, then the totals."""
    parts = {"parallel": parallel, "serial": serial}
    modules = sorted({m for p in parts.values() if p for m in p.seconds})

    def sec(p: Part | None, m: str) -> float:
        return p.seconds.get(m, 0.0) if p else 0.0

    def count(p: Part | None, m: str) -> int:
        return len(p.tests.get(m, ())) if p else 0

    modules.sort(key=lambda m: (-(sec(parallel, m) + sec(serial, m)), m))
    lines = [
        "# Test times per module",
        "",
        f"Generated by `scripts/durations.py` on {date}, on a {cores}-core {cpu}. "
        "Each module's setup, call and teardown times summed over its tests (in the "
        "parallel part, the work it gives the two workers, not wall time), slowest first. "
        "Tests are counted where pytest reported a time (it hides those under 5 ms unless "
        "-vv). To regenerate, see tests/README.md (Per-module times).",
        "",
    ]
    for label, p in parts.items():
        if p is not None:
            wall = f"{p.wall_s:.1f} s wall" if p.wall_s is not None else "wall not found"
            lines.append(f"- {label} part: {p.total_s:.1f} s of test time, {wall}, "
                         f"{sum(len(t) for t in p.tests.values())} tests")
    lines += ["", "| module | parallel s | serial s | total s | tests |",
              "|---|---:|---:|---:|---:|"]
    for m in modules:
        lines.append(f"| {m} | {sec(parallel, m):.1f} | {sec(serial, m):.1f} | "
                     f"{sec(parallel, m) + sec(serial, m):.1f} | "
                     f"{count(parallel, m) + count(serial, m)} |")
    tp, ts = (p.total_s if p else 0.0 for p in (parallel, serial))
    lines.append(f"| **all** | {tp:.1f} | {ts:.1f} | {tp + ts:.1f} | "
                 f"{sum(count(parallel, m) + count(serial, m) for m in modules)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parallel", type=Path, help="the parallel part's saved output or XML")
    ap.add_argument("--serial", type=Path, help="the serial part's saved output or XML")
    ap.add_argument("-o", "--output", type=Path, default=Path("tests/durations.md"),
                    help="where to write the markdown (default tests/durations.md)")
    args = ap.parse_args(argv)
    if args.parallel is None and args.serial is None:
        ap.error("give --parallel and/or --serial: a saved pytest log or JUnit XML")
    for path in (args.parallel, args.serial):
        if path is not None and not path.is_file():
            ap.error(f"{path}: no such file")
    try:
        parts = [read_part(p) if p else None for p in (args.parallel, args.serial)]
    except ValueError as e:
        print(f"durations: {e}", file=sys.stderr)
        return 2
    now = datetime.datetime.now(datetime.UTC)
    text = render(*parts, cpu=cpu_name(), cores=os.cpu_count() or 0,
                  date=now.strftime("%Y-%m-%d %H:%M UTC"))
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
