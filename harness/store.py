"""Where a sweep's rows are kept: results.csv and the append-only journal of the running sweep.

While a sweep runs, finished rows are appended as whole JSON lines (written, flushed and fsynced in one
go) to .journal.jsonl; `ResultStore.finalize` rewrites results.csv from results.csv + the journal
atomically (only the rows of the current sweep, in its order) and removes the journal. An interruption
leaves whole rows, or a torn last line that reading ignores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dmuon.io import atomic_path, atomic_write_text

JOURNAL = ".journal.jsonl"
RESULTS = "results.csv"


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


__all__ = ["JOURNAL", "RESULTS", "ResultStore", "write_text_atomic"]
