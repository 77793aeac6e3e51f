"""Experiments as data: load an experiment file, expand its sweep, apply `--set` overrides, run the rows in
worker processes, store them (whole rows only, resumable) and record provenance.

An experiment is a TOML file (experiments/<name>.toml, or any path):

    description = "one line"
    runner = "simulate"             simulate | plan | measure-kernels   (harness.runners)
    figures = ["optimizer_time"]    figures `harness figures` draws from the results (harness.figures)
    [fixed]       key = value       settings every row shares
    [axes]        key = [v, ...]    the sweep: the product of the axes (one row per combination)
    [[grid]]                        several products, concatenated (instead of or besides [axes]);
    name = "..."; fixed = {...}; axes = {...}    each adds its own fixed settings and axes
    [variants.<name>]  key = value  named bundles of settings, chosen by the axis `variant = [names]`
    [[trace]]     key = value       simulate: points whose Chrome trace is saved (traces/ in the output)

A row's settings are the runner's defaults, then [fixed], the grid's fixed, the variant's bundle and the
point's axis values (a variant may not set a key that is also an axis). `--set key=value` (value in TOML
syntax, or a bare word) replaces the key everywhere: a list becomes that key's axis in every grid, a
scalar fixes it in every grid. Unknown keys (file or --set) and empty sweeps raise InputError.

Output folder (default results/<name>): results.csv (one row per run: every setting, `run_id`, every
metric; written atomically), config.json (the resolved experiment), provenance.json. While a sweep runs,
finished rows are appended as whole JSON lines (flushed) to .journal.jsonl; results.csv is rewritten
from it atomically at the end, also when the sweep fails or is interrupted. With resume (the default)
rows whose run_id is already in results.csv or the journal, stored by the same code version (column
`code`: git commit, '+dirty' for a modified tree), are not run again; rows from other code are.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from dmuon.errors import InputError, choice_error
from dmuon.io import atomic_path, atomic_write_text, file_mode  # noqa: F401 - file_mode re-exported

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS_DIR = ROOT / "experiments"
TOP_KEYS = ("description", "runner", "figures", "fixed", "axes", "grid", "variants", "trace")
GRID_KEYS = ("name", "fixed", "axes")
JOURNAL = ".journal.jsonl"
RESULTS = "results.csv"


# ---- the experiment ------------------------------------------------------------------------------
@dataclass
class Grid:
    name: str
    fixed: dict
    axes: dict  # key -> list of values (insertion order = column order)


@dataclass
class Experiment:
    name: str
    path: Path
    description: str
    runner: str
    figures: list[str]
    fixed: dict
    grids: list[Grid]
    variants: dict[str, dict]
    traces: list[dict]
    overrides: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "source": shown_path(self.path),
            "description": self.description,
            "runner": self.runner,
            "figures": self.figures,
            "fixed": self.fixed,
            "grids": [{"name": g.name, "fixed": g.fixed, "axes": g.axes} for g in self.grids],
            "variants": self.variants,
            "traces": self.traces,
            "overrides": self.overrides,
        }


def shown_path(p) -> str:
    """A path relative to the project root when it lies inside it (stored files stay portable)."""
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def experiment_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.toml")))


def experiment_path(name_or_path: str) -> Path:
    """experiments/<name>.toml for a name, else the path itself (must exist)."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or os.sep in str(name_or_path):
        if not p.is_file():
            raise InputError(f"experiment file {str(p)!r} does not exist")
        return p
    if name_or_path not in experiment_names():
        raise choice_error("experiment", name_or_path, experiment_names() + ("<path>.toml",))
    return EXPERIMENTS_DIR / f"{name_or_path}.toml"


def _table(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise InputError(f"{where} must be a table (key = value lines), got {type(v).__name__}")
    return dict(v)


def _axis_values(key: str, v, where: str) -> list:
    if not isinstance(v, list):
        raise InputError(f"{where}: axis {key!r} must be a list of values, e.g. {key} = [1, 2]; got {v!r}")
    if not v:
        raise InputError(f"{where}: axis {key!r} is empty, so the sweep has no rows; give at least one value")
    return list(v)


def load_experiment(name_or_path: str, overrides: list[str] | dict | None = None) -> Experiment:
    """Read, check and (with overrides: ['key=value', ...] or a dict) resolve an experiment file."""
    from .runners import get_runner

    path = experiment_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid TOML: {e}") from None
    where = str(path)
    for k in raw:
        if k not in TOP_KEYS:
            raise InputError(f"{where}: unknown key {k!r}; accepted: {', '.join(TOP_KEYS)}")
    runner = get_runner(raw.get("runner", "simulate"))
    figures = raw.get("figures", [])
    if not isinstance(figures, list) or not all(isinstance(f, str) for f in figures):
        raise InputError(f"{where}: figures must be a list of figure names")
    variants = {
        str(n): _table(v, f"{where}: [variants.{n}]")
        for n, v in _table(raw.get("variants", {}), f"{where}: [variants]").items()
    }
    grids = []
    if "axes" in raw or "grid" not in raw:
        grids.append(
            Grid(
                "",
                {},
                {
                    k: _axis_values(k, v, where)
                    for k, v in _table(raw.get("axes", {}), f"{where}: [axes]").items()
                },
            )
        )
    raw_grids = raw.get("grid", [])
    if not isinstance(raw_grids, list):
        raise InputError(f"{where}: grid must be an array of tables ([[grid]])")
    for i, g in enumerate(raw_grids):
        g = _table(g, f"{where}: [[grid]] #{i + 1}")
        gw = f"{where}: [[grid]] {g.get('name', i + 1)!s}"
        for k in g:
            if k not in GRID_KEYS:
                raise InputError(f"{gw}: unknown key {k!r}; accepted: {', '.join(GRID_KEYS)}")
        grids.append(
            Grid(
                str(g.get("name", f"grid{i + 1}")),
                _table(g.get("fixed", {}), f"{gw} fixed"),
                {k: _axis_values(k, v, gw) for k, v in _table(g.get("axes", {}), f"{gw} axes").items()},
            )
        )
    traces = raw.get("trace", [])
    if not isinstance(traces, list):
        raise InputError(f"{where}: trace must be an array of tables ([[trace]])")
    exp = Experiment(
        name=path.stem,
        path=path,
        description=str(raw.get("description", "")),
        runner=runner.name,
        figures=list(figures),
        fixed=_table(raw.get("fixed", {}), f"{where}: [fixed]"),
        grids=grids,
        variants=variants,
        traces=[_table(t, f"{where}: [[trace]]") for t in traces],
    )
    check_keys(exp, runner, where)
    if overrides:
        apply_overrides(
            exp, parse_overrides(overrides) if not isinstance(overrides, dict) else overrides, runner
        )
    return exp


def check_keys(exp: Experiment, runner, where: str) -> None:
    accepted = (*runner.settings, "variant")

    def check(keys, place: str):
        for k in keys:
            if k not in accepted:
                raise InputError(
                    f"{where}: unknown setting {k!r} in {place}; accepted: {', '.join(accepted)}"
                )

    check(exp.fixed, "[fixed]")
    for g in exp.grids:
        check(g.fixed, f"grid {g.name or '[axes]'} fixed")
        check(g.axes, f"grid {g.name or '[axes]'} axes")
        if "variant" in g.axes:
            for v in g.axes["variant"]:
                if v not in exp.variants:
                    raise InputError(
                        f"{where}: variant {v!r} has no [variants.{v}] table; defined: "
                        f"{', '.join(exp.variants) or 'none'}"
                    )
    for name, bundle in exp.variants.items():
        check(bundle, f"[variants.{name}]")
        if "variant" in bundle:
            raise InputError(f"{where}: [variants.{name}] may not set 'variant'")
    for t in exp.traces:
        check(t, "[[trace]]")


# ---- overrides -----------------------------------------------------------------------------------
def parse_value(text: str):
    """A --set value: TOML syntax ([8, 64], 2048, 1.5, true, "x"), a bare word (pi0), or a list whose items
    are either ([pi0, wall-oss], [8, "a800"])."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        t = text.strip()
        if t.startswith("[") and t.endswith("]") and t[1:-1].strip():
            return [_scalar(x, text) for x in t[1:-1].split(",")]
        return _scalar(t, text)


def _scalar(item: str, text: str):
    item = item.strip()
    try:
        v = tomllib.loads(f"v = {item}")["v"]
        if not isinstance(v, (list, dict)):
            return v
    except tomllib.TOMLDecodeError:
        if item and not any(c in item for c in "[]{}=\"' "):
            return item
    raise InputError(
        f'--set value {text!r} is not a TOML value (e.g. 8, [8, 64], true, "a800"), a bare word '
        "(pi0) or a list of them ([pi0, wall-oss])"
    )


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or not key.replace("_", "").isalnum():
            raise InputError(
                f"--set {item!r}: expected key=value, e.g. --set gpus=[8,64] or --set workload=pi0"
            )
        out[key] = parse_value(value)
    return out


def apply_overrides(exp: Experiment, overrides: dict, runner) -> None:
    accepted = (*runner.settings, "variant")
    for key, value in overrides.items():
        if key not in accepted:
            raise InputError(
                f"--set {key}: unknown setting for experiment {exp.name!r} ({exp.path}); "
                f"accepted: {', '.join(accepted)}"
            )
        if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, (dict, list))
                                                                       for v in value)):
            raise InputError(
                f"--set {key}={value!r}: a table or nested list is not a setting value; give a scalar "
                f"(--set {key}=8) or a list of scalars (--set {key}=[8,64])"
            )
        if isinstance(value, list):
            _axis_values(key, value, f"--set {key}")
            exp.fixed.pop(key, None)
            for g in exp.grids:
                g.fixed.pop(key, None)
                g.axes[key] = list(value)
        else:
            exp.fixed[key] = value
            for g in exp.grids:
                g.fixed.pop(key, None)
                g.axes.pop(key, None)
        if key == "variant":
            for v in value if isinstance(value, list) else [value]:
                if v not in exp.variants:
                    raise InputError(
                        f"--set variant: {v!r} is not a variant of {exp.name!r}; defined: "
                        f"{', '.join(exp.variants) or 'none'}"
                    )
        exp.overrides[key] = value


# ---- expansion -----------------------------------------------------------------------------------
def run_id(settings: dict) -> str:
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def expand(exp: Experiment) -> list[dict]:
    """Every row's settings, in order (grid by grid; axes vary last-fastest). Duplicates are dropped."""
    from .runners import get_runner

    runner = get_runner(exp.runner)
    rows, seen = [], set()
    for g in exp.grids:
        keys = list(g.axes)
        for combo in itertools.product(*(g.axes[k] for k in keys)):
            point = dict(zip(keys, combo, strict=True))
            s = dict(runner.settings)
            s.update(exp.fixed)
            s.update(g.fixed)
            if "variant" in point or "variant" in s:
                name = point.get("variant", s.get("variant"))
                if name not in exp.variants:
                    raise InputError(f"{exp.path}: variant {name!r} has no [variants.{name}] table")
                clash = sorted(set(exp.variants[name]) & set(point))
                if clash:
                    raise InputError(f"{exp.path}: variant {name!r} sets {clash}, which are also axes")
                s.update(exp.variants[name])
            s.update(point)
            order = [
                *(k for k in runner.lead if k in s),
                *point,
                *(exp.variants.get(s.get("variant"), {})),
                *g.fixed,
                *exp.fixed,
                *runner.settings,
            ]
            s = {k: s[k] for k in dict.fromkeys(order)}  # columns: axes first, then fixed, then defaults
            if g.name:
                s = {"grid": g.name, **s}
            rid = run_id(s)
            if rid not in seen:
                seen.add(rid)
                rows.append(s)
    if not rows:
        raise InputError(f"{exp.path}: the sweep is empty (no rows); give [axes] or [[grid]] with values")
    return rows


# ---- storage -------------------------------------------------------------------------------------
def write_text_atomic(path: Path, text: str) -> None:
    """`dmuon.io.atomic_write_text`: temp file in the same folder, then os.replace."""
    atomic_write_text(path, text)


class ResultStore:
    """results.csv + the append-only journal of rows finished in the current sweep."""

    def __init__(self, out_dir: Path):
        self.dir = Path(out_dir)
        self.csv = self.dir / RESULTS
        self.journal = self.dir / JOURNAL

    def read_rows(self) -> list[dict]:
        """Rows of results.csv, then the journal's whole lines (a torn last line is ignored)."""
        import pandas as pd

        rows = []
        if self.csv.exists() and self.csv.stat().st_size:
            df = pd.read_csv(self.csv, keep_default_na=False)
            rows += [dict(r) for r in df.to_dict("records")]
        if self.journal.exists():
            for line in self.journal.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return rows

    def finished_ids(self, code: str | None = None) -> set[str]:
        """Run ids stored (only those produced by code version `code`, when given)."""
        return {
            str(r["run_id"])
            for r in self.read_rows()
            if r.get("run_id") not in (None, "") and (code is None or str(r.get("code")) == code)
        }

    def append(self, rows: list[dict]) -> None:
        """Whole lines, one write + flush + fsync: an interruption leaves whole rows (or a torn last one)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(r, default=_json_default) + "\n" for r in rows)
        with open(self.journal, "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def finalize(self, order: list[str], columns: list[str]) -> int:
        """Rewrite results.csv atomically: the rows of `order` (run ids) that exist, in that order."""
        import pandas as pd

        by_id = {}
        for r in self.read_rows():
            by_id[str(r.get("run_id"))] = r
        rows = [by_id[i] for i in order if i in by_id]
        cols = list(columns)
        for r in rows:
            cols.extend(k for k in r if k not in cols)
        df = pd.DataFrame(rows, columns=cols)
        with atomic_path(self.csv) as tmp:
            df.to_csv(tmp, index=False)
        if self.journal.exists():
            self.journal.unlink()
        return len(rows)


def _json_default(v):
    if isinstance(v, (set, tuple)):
        return list(v)
    return str(v)


# ---- provenance ----------------------------------------------------------------------------------
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
    exp: Experiment, rows: list[dict], *, kind: str, wall_s: float, jobs: int, command: str | None = None
) -> dict:
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


# ---- the runner ----------------------------------------------------------------------------------
@dataclass
class SweepSummary:
    out_dir: Path
    total: int
    ran: int
    skipped: int
    dropped: int
    wall_s: float
    rows: list[dict]
    stale: int = 0  # stored rows of this sweep made by another code version, run again


def _worker_init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def _run_group(runner_name: str, group: list[dict], ctx: dict) -> tuple[list[dict], BaseException | None]:
    """In a worker: the rows of a group that finished, and the exception that stopped it (if any)."""
    from .runners import get_runner

    rows: list[dict] = []
    try:
        for row in get_runner(runner_name).run_group(group, ctx):
            rows.append(row)
    except Exception as e:  # noqa: BLE001 - handed back with the finished rows, raised in the parent
        return rows, e
    return rows, None


def run_sweep(
    exp: Experiment,
    out_dir: Path,
    *,
    jobs: int = 1,
    resume: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
    command: str | None = None,
) -> SweepSummary:
    """Run every row of `exp` not finished yet; write results.csv, config.json, provenance.json."""
    from .runners import get_runner

    runner = get_runner(exp.runner)
    out_dir = Path(out_dir)
    points = expand(exp)
    ids = [run_id(s) for s in points]
    store = ResultStore(out_dir)
    if not resume:
        if store.journal.exists():
            store.journal.unlink()
        if store.csv.exists():
            store.csv.unlink()
    code = code_version()
    done = store.finished_ids(code) & set(ids)
    stale = (store.finished_ids() & set(ids)) - done  # stored by other code: run again
    before = len(store.finished_ids())
    todo = [(i, s) for i, s in zip(ids, points, strict=True) if i not in done]
    groups: dict = {}
    for i, s in todo:
        groups.setdefault(runner.group_key(s), []).append({**s, "run_id": i})
    ordered = sorted(groups.values(), key=lambda g: -sum(runner.cost_hint(s) for s in g))
    ctx = {"out_dir": str(out_dir.resolve()), "traces": exp.traces}
    columns = [*dict.fromkeys(k for s in points for k in s), "run_id", "code"]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        out_dir / "config.json",
        json.dumps({**exp.to_dict(), "rows": len(points), "columns": columns}, indent=1, default=str) + "\n",
    )
    t0 = time.perf_counter()
    finished = len(done)
    jobs = 1 if not runner.parallel else max(1, min(jobs, len(ordered) or 1))
    if progress:
        progress(finished, len(points), "")

    def record(rows: list[dict]) -> None:
        nonlocal finished
        rows = [{**r, "code": code} for r in rows]
        store.append(rows)
        finished += len(rows)
        if progress:
            progress(finished, len(points), runner.label(rows[-1]) if rows else "")

    try:
        if jobs == 1:
            for g in ordered:
                for row in runner.run_group(g, ctx):
                    record([row])
        else:
            import multiprocessing as mp
            from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

            with ProcessPoolExecutor(
                max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init
            ) as pool:
                pending = {pool.submit(_run_group, runner.name, g, ctx) for g in ordered}
                try:
                    while pending:
                        done_f, pending = wait(pending, return_when=FIRST_EXCEPTION)
                        for f in done_f:
                            rows, error = f.result()
                            if rows:
                                record(rows)
                            if error is not None:
                                raise error
                except BaseException:
                    for f in pending:
                        f.cancel()
                    raise
    finally:
        store.finalize(ids, columns)
    wall = time.perf_counter() - t0
    rows = store.read_rows()
    write_text_atomic(
        out_dir / "provenance.json",
        json.dumps(provenance(exp, rows, kind=runner.kind, wall_s=wall, jobs=jobs, command=command), indent=1)
        + "\n",
    )
    return SweepSummary(
        out_dir=out_dir,
        total=len(points),
        ran=len(todo),
        skipped=len(done),
        dropped=max(0, before - len(done) - len(stale)),
        stale=len(stale),
        wall_s=wall,
        rows=rows,
    )


__all__ = [
    "Experiment",
    "Grid",
    "ResultStore",
    "SweepSummary",
    "expand",
    "experiment_names",
    "load_experiment",
    "parse_overrides",
    "run_id",
    "run_sweep",
]
