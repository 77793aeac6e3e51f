"""Provenance of stored results: the code version (git commit, dirty or not), the host, the command.

`code_version()` names the code a row was produced by (resume re-runs rows of other code);
`provenance(...)` is the provenance.json written beside every results table; `cpu_name()` names this
machine's CPU for measured rows; `shown_path` keeps stored paths relative to the project root.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shown_path(p) -> str:
    """A path relative to the project root when it lies inside it (stored files stay portable)."""
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


GENERATED = ("results", "paper_figures")  # outputs, not code: ignored when asking whether the tree is dirty


def _code_status() -> str | None:
    """`git status` of tracked files outside the generated outputs ('' = clean, None = no git)."""
    return _git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{g}" for g in GENERATED))


def code_version() -> str:
    """The git commit (12 hex digits), '+dirty' when tracked files other than the generated outputs differ
    from it; else the package version. Resume skips only rows stored by the same code version."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"v{version('dmuon-harness')}"
        except PackageNotFoundError:
            return "unknown"
    dirty = _code_status()
    return commit[:12] + ("+dirty" if dirty else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(
    exp, rows: list[dict], *, kind: str, wall_s: float, jobs: int, command: str | None = None
) -> dict:
    """provenance.json of a results table; `exp` is anything with a name and a path (an Experiment)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("dmuon-harness")
    except PackageNotFoundError:
        ver = "unknown"
    status = _code_status()
    profiles = sorted({str(r.get("profile")) for r in rows if r.get("profile") not in (None, "")})
    return {
        "experiment": exp.name,
        "experiment_file": shown_path(exp.path),
        "project_version": ver,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "kind": kind,
        "profiles": profiles,
        "profile_descriptions": sorted(
            {
                str(r.get("profile_description"))
                for r in rows
                if r.get("profile_description") not in (None, "")
            }
        ),
        "host": platform.node(),
        "cpu": f"{cpu_name()} ({os.cpu_count()} cores)",
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(["harness", *sys.argv[1:]]),
        "rows": len(rows),
        "wall_s": round(wall_s, 2),
        "jobs": jobs,
        "load_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


__all__ = ["GENERATED", "ROOT", "code_version", "cpu_name", "provenance", "shown_path"]
