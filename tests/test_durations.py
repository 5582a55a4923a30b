"""scripts/durations.py: pytest's --durations=0 output and JUnit XML into per-module times."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "durations.py"
_spec = importlib.util.spec_from_file_location("durations_script", _PATH)
durations = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = durations  # dataclasses look their module up there
_spec.loader.exec_module(durations)

LOG = """\
bringing up nodes...
........x.                                                               [100%]
============================== slowest durations ===============================
12.50s call     tests/test_b.py::test_slow[fp32-gpipe-4mb]
2.25s setup    tests/test_b.py::test_slow[fp32-gpipe-4mb]
0.25s teardown tests/test_b.py::test_slow[fp32-gpipe-4mb]
3.00s call     tests/test_a.py::test_one
1.00s call     tests/test_a.py::TestGroup::test_two[a b]
0.01s call     tests/test_c.py::test_quick

(7 durations < 0.005s hidden.  Use -vv to show these durations.)
9 passed, 1 xfailed in 491.23s (0:08:11)
"""

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">
<testsuite name="pytest" tests="3" time="61.5">
<testcase classname="tests.test_a" name="test_one" time="3.0" />
<testcase classname="tests.test_a.TestGroup" name="test_two" time="1.5" />
<testcase classname="tests.test_d" name="test_x" time="40.25" />
</testsuite></testsuites>"""


def test_log_sums_each_modules_phases_and_reads_the_wall_time():
    part = durations.parse_log(LOG)
    assert dict(part.seconds) == {"tests/test_b.py": 15.0, "tests/test_a.py": 4.0,
                                  "tests/test_c.py": 0.01}
    # one test however many phases it reported; a class's test counts for its module
    assert {m: len(t) for m, t in part.tests.items()} == {
        "tests/test_b.py": 1, "tests/test_a.py": 2, "tests/test_c.py": 1}
    assert part.wall_s == 491.23 and part.total_s == pytest.approx(19.01, abs=1e-12)


def test_junit_modules_drop_the_class_name():
    part = durations.parse_junit(JUNIT)
    assert dict(part.seconds) == {"tests/test_a.py": 4.5, "tests/test_d.py": 40.25}
    assert part.wall_s == 61.5


def test_render_lists_modules_slowest_first_with_both_parts():
    text = durations.render(durations.parse_log(LOG), durations.parse_junit(JUNIT),
                            cpu="AMD EPYC (AVX2)", cores=2, date="2026-11-27 18:00 UTC")
    assert "on 2026-11-27 18:00 UTC, on a 2-core AMD EPYC (AVX2)" in text
    assert "- parallel part: 19.0 s of test time, 491.2 s wall, 4 tests" in text
    assert "- serial part: 44.8 s of test time, 61.5 s wall, 3 tests" in text
    rows = [x for x in text.splitlines() if x.startswith("| tests/")]
    assert rows == ["| tests/test_d.py | 0.0 | 40.2 | 40.2 | 1 |",
                    "| tests/test_b.py | 15.0 | 0.0 | 15.0 | 1 |",
                    "| tests/test_a.py | 4.0 | 4.5 | 8.5 | 4 |",
                    "| tests/test_c.py | 0.0 | 0.0 | 0.0 | 1 |"]
    assert "| **all** | 19.0 | 44.8 | 63.8 | 7 |" in text


def test_a_log_without_durations_is_refused_by_name(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("9 passed in 3.00s\n")
    assert durations.main(["--serial", str(log), "-o", str(tmp_path / "d.md")]) == 2
    assert f"{log}: no durations in the log: run pytest with --durations=0" in \
        capsys.readouterr().err
    assert not (tmp_path / "d.md").exists()
    with pytest.raises(SystemExit):
        durations.main(["-o", str(tmp_path / "d.md")])  # neither part given


def test_main_writes_the_file(tmp_path):
    log, xml = tmp_path / "p.log", tmp_path / "s.xml"
    log.write_text(LOG)
    xml.write_text(JUNIT)
    out = tmp_path / "durations.md"
    assert durations.main(["--parallel", str(log), "--serial", str(xml), "-o", str(out)]) == 0
    assert "| tests/test_d.py | 0.0 | 40.2 | 40.2 | 1 |" in out.read_text()
