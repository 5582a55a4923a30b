"""Every page of docs/ that the code, the tests or the documentation name is in the repository.

Code comments and pages cite the specification by path (``docs/algorithm.md section 5``); a
citation of a page that is not committed leaves the reader without it. Paths under the
project's shared folder (``../shared/docs/...``) are outside the repository and not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CITED = re.compile(r"(?<![\w./-])docs/([\w-]+\.md)\b")
"""A path ``docs/<name>.md`` that does not continue another path (``../shared/docs/...``)."""

RETIRED = "edit-" + "algorithm.md"
"""The specification's name before it was committed as ``docs/algorithm.md`` (built from
pieces so that this file does not cite it)."""

NO_RETIRED_NAME_IN = ("docs", "tests", "README.md", "editrain")
"""Where the retired name must not appear: everywhere a reader looks."""


def _sources(*tops: str) -> list[Path]:
    """The Python and Markdown files under ``tops`` (files or folders of the repository)."""
    out: list[Path] = []
    for top in tops:
        path = ROOT / top
        if path.is_file():
            out.append(path)
        else:
            out += sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md"))
    return out


def test_the_pattern_finds_citations_and_skips_other_folders():
    text = ("see docs/algorithm.md section 5, `docs/streaming.md`; "
            "../shared/docs/optimizers.md and /x/docs/a.md are elsewhere")
    assert CITED.findall(text) == ["algorithm.md", "streaming.md"]


def test_every_cited_doc_exists():
    missing = []
    for path in _sources("editrain", "tests", "README.md", *sorted(
            str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))):
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            missing += [f"{path.relative_to(ROOT)}:{n}: docs/{name}"
                        for name in CITED.findall(line) if not (ROOT / "docs" / name).is_file()]
    assert not missing, "cited pages that are not in docs/:\n" + "\n".join(missing)


def test_the_specification_is_cited_by_its_path_in_the_repository():
    assert (ROOT / "docs" / "algorithm.md").is_file()
    stale = [f"{path.relative_to(ROOT)}:{n}"
             for path in _sources(*NO_RETIRED_NAME_IN)
             for n, line in enumerate(path.read_text().splitlines(), start=1)
             if RETIRED in line]
    assert not stale, f"cite docs/algorithm.md instead of {RETIRED}: {stale}"
