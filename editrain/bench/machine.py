"""The machine a benchmark ran on: CPUs, platform, versions, load, source commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    """The machine a benchmark runs on (CPU count, torch version, platform, load, commit)."""
    import torch

    import editrain

    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(), "usable_cpus": usable, "torch": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "editrain": getattr(editrain, "__version__", "?"), "cuda": torch.cuda.is_available(),
    }
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    info["git_commit"] = git_commit()
    return info


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def git_commit() -> str | None:
    """Read-only ``git rev-parse`` of the source tree editrain is imported from
    (``+dirty`` when tracked files are modified; None outside a git checkout)."""
    import editrain

    root = str(Path(editrain.__file__).resolve().parent.parent)

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              timeout=10, check=False)

    try:
        head = git("rev-parse", "--short", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def describe_machine(m: dict[str, Any]) -> str:
    """One line: CPUs, platform, torch, Python, commit, load average (``m``: a record from
    :func:`machine_info`)."""
    load = m.get("load_average")
    text = (f"{m.get('usable_cpus')} usable CPUs ({m.get('cpu_count')} total, "
            f"{m.get('processor')}), {m.get('platform')}, torch {m.get('torch')}, "
            f"Python {m.get('python')}, editrain {m.get('editrain')}")
    if m.get("git_commit"):
        text += f" (commit {m['git_commit']})"
    if load:
        text += f"; load average at start {load[0]:.2f}"
    return text


__all__ = ["describe_machine", "git_commit", "load_average", "machine_info"]
