"""Run an experiment's rows in worker processes, store them (whole rows only, resumable), record provenance.

`run_sweep(exp, out_dir)` expands the experiment (harness.experiment), skips the rows already stored,
groups the rest by the runner's `group_key` (harness.runners) and runs the groups, biggest first, on an
executor (harness.executors): `local`, in `jobs` spawned worker processes (one at a time for runners
that measure), or `ray`, one Ray task per group on a Ray cluster. Either way the finished rows come back
to this process, which alone writes them, so results, journal and resume do not depend on the executor.

Output folder (default results/<name>): results.csv (one row per run: every setting, `run_id`, every
metric; written atomically), config.json (the resolved experiment), provenance.json (what reproduces),
and, not tracked by git, .provenance/ (run.json: commit, host, date, wall time of the last run;
rows.json: each row's code version and wall time). While a sweep runs, finished rows are appended as
whole JSON lines (flushed) to .journal.jsonl (harness.store); results.csv is rewritten from it atomically
at the end, also when the sweep fails or is interrupted. With resume (the default) rows whose run_id is
already in results.csv or the journal, stored by the same code version (`code` in .provenance/rows.json:
git commit, '+dirty' for a modified tree), are not run again; rows from other code, or of unknown code (a
fresh clone has no .provenance/), are, and an unchanged simulation then rewrites the same bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .executors import make_executor, run_group, worker_init
from .experiment import Experiment, expand, run_id
from .provenance import code_version, write_provenance
from .runners import get_runner
from .store import ResultStore, write_text_atomic


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


_worker_init, _run_group = worker_init, run_group  # their old names here


def run_sweep(
    exp: Experiment,
    out_dir: Path,
    *,
    jobs: int | None = 1,
    resume: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
    command: str | None = None,
    executor: str = "local",
    address: str | None = None,
) -> SweepSummary:
    """Run every row of `exp` not finished yet; write results.csv, config.json, provenance.json.

    executor: `local` (this machine, `jobs` processes; None: one per core) or `ray` (Ray tasks on the
    cluster at `address`, a local Ray instance when None; `jobs`: at most that many tasks in flight, None:
    no limit); see harness.executors. Both write the same results."""
    runner = get_runner(exp.runner)
    execu = make_executor(executor, address=address, jobs=jobs)  # checked before anything is touched
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
    execu.prepare(ordered)  # connects to a Ray cluster (when there is work) before anything is written
    columns = [*dict.fromkeys(k for s in points for k in s), "run_id"]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(
            out_dir / "config.json",
            json.dumps({**exp.to_dict(), "rows": len(points), "columns": columns}, indent=1, default=str)
            + "\n",
        )
    except BaseException:
        execu.close()
        raise
    t0 = time.perf_counter()
    finished = len(done)
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
        execu.run(runner, ordered, ctx, record)
    finally:
        try:
            store.finalize(ids, columns)
        finally:
            execu.close()
    wall = time.perf_counter() - t0
    rows = store.read_rows()
    write_provenance(
        out_dir,
        exp,
        rows,
        kind=runner.kind,
        wall_s=wall,
        jobs=execu.jobs,
        command_line=command,
        **execu.describe(),
        rows_run=len(todo),
        rows_skipped=len(done),
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


__all__ = ["SweepSummary", "run_sweep"]
