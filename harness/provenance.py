"""Provenance of stored results: the code version (git commit, dirty or not), the host, the command.

Two files beside every results table, so that a re-run that simulates the same numbers writes the same
bytes into the tracked files (`git status` stays clean after `make run`):
  provenance.json            tracked: only what the same code and inputs reproduce (experiment, kind,
                             profiles, rows, the command that writes the table);
  .provenance/run.json       not tracked (.gitignore): what changes from run to run (git commit and
                             whether the tree was dirty, host, CPU, Python, date, the command line as
                             typed, wall time, worker count, load average).

`code_version()` names the code a row was produced by (resume re-runs rows of other code; the row's
code version is kept in .provenance/rows.json by harness.store); `write_provenance(...)` writes both
files; `cpu_name()` names this machine's CPU for measured rows; `shown_path` keeps stored paths relative
to the project root.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
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


ARGV: list[str] | None = None  # the arguments harness.cli.main was called with (tests call it in-process)
VOLATILE_DIR = ".provenance"  # beside results.csv; not tracked (.gitignore: .provenance/, at any depth)
RUN_FILE = "run.json"


def provenance(exp, rows: list[dict], *, kind: str, command: str | None = None) -> dict:
    """The tracked provenance.json of a results table: only fields the same code and inputs reproduce.

    `exp` is anything with a name and a path (an Experiment); `command` the canonical command that writes
    the table (default: `harness run <experiment>` plus its --set overrides)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("dmuon-harness")
    except PackageNotFoundError:
        ver = "unknown"
    profiles = sorted({str(r.get("profile")) for r in rows if r.get("profile") not in (None, "")})
    return {
        "experiment": exp.name,
        "experiment_file": shown_path(exp.path),
        "project_version": ver,
        "kind": kind,
        "profiles": profiles,
        "profile_descriptions": sorted(
            {
                str(r.get("profile_description"))
                for r in rows
                if r.get("profile_description") not in (None, "")
            }
        ),
        "command": command if command is not None else canonical_command(exp),
        "rows": len(rows),
        "volatile": f"{VOLATILE_DIR}/{RUN_FILE} (not tracked): git commit, host, CPU, date, wall time",
    }


def canonical_command(exp) -> str:
    """`harness run <name>` (or the experiment file's path) plus one --set per override, in key order."""
    from .values import parse_value

    path = Path(exp.path)
    in_project = path.resolve().parent == (ROOT / "experiments").resolve() and path.stem == exp.name
    words = ["harness", "run", exp.name if in_project else shlex.quote(shown_path(path))]
    for key, value in sorted((getattr(exp, "overrides", None) or {}).items()):
        text = json.dumps(value, separators=(",", ":"))
        try:
            if isinstance(value, str) and parse_value(value) == value:
                text = value  # a bare word reads back as itself (--set workload=pi0)
        except ValueError:  # InputError: not a bare word; the quoted form it is
            pass
        words += ["--set", shlex.quote(f"{key}={text}")]
    return " ".join(words)


def run_provenance(*, wall_s: float, jobs: int, command: str | None = None, **extra) -> dict:
    """What changes from run to run (the untracked .provenance/run.json)."""
    status = _code_status()
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "code_version": code_version(),
        "host": platform.node(),
        "cpu": f"{cpu_name()} ({os.cpu_count()} cores)",
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command_line": command if command is not None else shlex.join(["harness", *(ARGV or sys.argv[1:])]),
        "wall_s": round(wall_s, 2),
        "jobs": jobs,
        "load_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        **extra,
    }


def write_provenance(
    out_dir: Path,
    exp,
    rows: list[dict],
    *,
    kind: str,
    wall_s: float,
    jobs: int,
    command: str | None = None,
    command_line: str | None = None,
    **extra,
) -> tuple[Path, Path]:
    """provenance.json (tracked, reproducible) and .provenance/run.json (untracked, this run's)."""
    from dmuon.io import atomic_write_text

    out_dir = Path(out_dir)
    tracked = out_dir / "provenance.json"
    volatile = out_dir / VOLATILE_DIR / RUN_FILE
    atomic_write_text(tracked, json.dumps(provenance(exp, rows, kind=kind, command=command), indent=1) + "\n")
    volatile.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        volatile,
        json.dumps(run_provenance(wall_s=wall_s, jobs=jobs, command=command_line, **extra), indent=1) + "\n",
    )
    return tracked, volatile


__all__ = [
    "GENERATED",
    "ROOT",
    "RUN_FILE",
    "VOLATILE_DIR",
    "canonical_command",
    "code_version",
    "cpu_name",
    "provenance",
    "run_provenance",
    "shown_path",
    "write_provenance",
]
