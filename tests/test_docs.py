"""The documentation cannot drift: the configuration reference is generated and checked, and
the hand-written pages only name modules and API names that exist."""

from __future__ import annotations

import re
from pathlib import Path

import editrain
from editrain import docs
from editrain.config import describe_options

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_md_is_up_to_date():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == docs.render_configuration(), (
        "docs/configuration.md is out of date: run `python -m editrain.docs`")
    assert docs.main(["--check", "--out", str(ROOT / "docs" / "configuration.md")]) == 0


def test_check_mode_reports_a_stale_page(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text("stale\n")
    assert docs.main(["--check", "--out", str(page)]) == 1
    assert "python -m editrain.docs" in capsys.readouterr().err
    assert docs.main(["--out", str(page)]) == 0
    assert page.read_text() == docs.render_configuration()


def test_every_option_is_documented_with_its_methods():
    options = [row[0] for row in describe_options()]
    page = docs.render_configuration()
    for name, _tp, _default, doc in describe_options():
        assert doc, f"{name} has no one-line docstring"
        assert f"| `{name}` |" in page
    # Method-specific options are listed on purpose; a new sync option must be classified.
    unclassified = [o for o in options if o.startswith("sync.") and o != "sync.method"
                    and o not in docs.USED_BY]
    assert not unclassified, f"add these to editrain.docs.USED_BY: {unclassified}"
    stale = [o for o in docs.USED_BY if o not in options]
    assert not stale, f"editrain.docs.USED_BY names options that do not exist: {stale}"
    assert docs.used_by("sync.local_sgd_sync_time") == ("aedit",)


def test_architecture_names_real_modules():
    text = (ROOT / "docs" / "architecture.md").read_text()
    names = set(re.findall(r"\b([a-z_]+(?:/[a-z_]+)*\.py)\b", text))
    assert len(names) > 15
    missing = [n for n in sorted(names)
               if not (ROOT / n).is_file() and not any(
                   (ROOT / "editrain" / d / n).is_file()
                   for d in ("", "sync", "models", "data", "optim", "bench", "config"))]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_api_md_covers_the_public_api():
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in editrain.__all__ if n != "__version__" and f"`{n}" not in text]
    assert not missing, f"docs/api.md does not mention: {missing}"


REFUSAL = re.compile(r"`(--[a-z][\w.-]*: [^`]*)`")
"""A refusal the pages quote: an option, a colon, the message (an inline code span, which
may run over a line break)."""
BARE_PLACEHOLDER = re.compile(r'(?<!["\w/])(DIR|RUN_DIR|CKPT|PATH|FILE|OUT)(?![\w/"])')
"""A path placeholder written bare, where editrain quotes the path (``"DIR"``)."""


def test_a_refusal_quoted_in_the_docs_names_its_path_as_editrain_writes_it():
    """Every refusal names a path as :func:`editrain.paths.shown` spells it, in double
    quotes (``--run-dir: "DIR" is in use ...``); a page that quotes one writes its path
    placeholder so too. Three refusals of the run directory (a group started after the
    run ended, a replica group's lock held, a rank waiting for rank 0) were still quoted
    with a bare DIR after 9668aa8 had quoted the path in the code."""
    bare = []
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for span in REFUSAL.findall(page.read_text()):
            bare += [f"{page.name}: `{' '.join(span.split())}`"
                     for _ in BARE_PLACEHOLDER.finditer(span)]
    assert bare == [], bare
