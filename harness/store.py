"""Where a sweep's rows are kept: results.csv, the append-only journal of the running sweep, and each
row's volatile fields in .provenance/rows.json.

While a sweep runs, finished rows are appended as whole JSON lines (written, flushed and fsynced in one
go) to .journal.jsonl; `ResultStore.finalize` rewrites results.csv from results.csv + the journal
atomically (only the rows of the current sweep, in its order) and removes the journal. An interruption
leaves whole rows, or a torn last line that reading ignores.

results.csv holds what the same code and inputs reproduce (settings, run_id, metrics), so an unchanged
re-run writes it byte for byte. The columns of VOLATILE (the code version that made the row, its wall
time) go to .provenance/rows.json (not tracked by git), keyed by run_id, together with the SHA-256 of
the results.csv they belong to: when results.csv changed without them (a `git pull`, a fresh clone, an
edit) they are ignored, so its rows count as made by unknown code and resume runs them again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dmuon.io import atomic_path, atomic_write_text

from .provenance import VOLATILE_DIR

JOURNAL = ".journal.jsonl"
RESULTS = "results.csv"
ROW_PROVENANCE = "rows.json"
VOLATILE = ("code", "sim_wall_s")  # per-row fields that change from run to run: not in results.csv


def write_text_atomic(path: Path, text: str) -> None:
    """`dmuon.io.atomic_write_text`: temp file in the same folder, then os.replace."""
    atomic_write_text(path, text)


class ResultStore:
    """results.csv + the append-only journal of rows finished in the current sweep."""

    def __init__(self, out_dir: Path):
        self.dir = Path(out_dir)
        self.csv = self.dir / RESULTS
        self.journal = self.dir / JOURNAL
        self.row_provenance = self.dir / VOLATILE_DIR / ROW_PROVENANCE

    def _volatile(self) -> dict[str, dict]:
        """run_id -> the row's VOLATILE fields, when .provenance/rows.json belongs to this results.csv."""
        try:
            doc = json.loads(self.row_provenance.read_text())
            if doc.get("results_sha256") != _sha256(self.csv) or not isinstance(doc.get("rows"), dict):
                return {}
            return doc["rows"]
        except (OSError, ValueError, AttributeError):
            return {}

    def read_rows(self) -> list[dict]:
        """Rows of results.csv (with their volatile fields, where known), then the journal's whole lines
        (a torn last line is ignored)."""
        import pandas as pd

        rows = []
        if self.csv.exists() and self.csv.stat().st_size:
            df = pd.read_csv(self.csv, keep_default_na=False)
            volatile = self._volatile()
            for r in df.to_dict("records"):
                row = dict(r)
                row.update(volatile.get(str(row.get("run_id")), {}))
                rows.append(row)
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
        """Rewrite results.csv atomically: the rows of `order` (run ids) that exist, in that order, without
        the VOLATILE columns; those go to .provenance/rows.json with the new results.csv's checksum."""
        import pandas as pd

        by_id = {}
        for r in self.read_rows():
            by_id[str(r.get("run_id"))] = r
        rows = [by_id[i] for i in order if i in by_id]
        cols = [c for c in columns if c not in VOLATILE]
        for r in rows:
            cols.extend(k for k in r if k not in cols and k not in VOLATILE)
        df = pd.DataFrame(rows, columns=cols)
        with atomic_path(self.csv) as tmp:
            df.to_csv(tmp, index=False)
        volatile = {
            str(r.get("run_id")): {k: r[k] for k in VOLATILE if k in r and r[k] not in (None, "")}
            for r in rows
        }
        self.row_provenance.parent.mkdir(parents=True, exist_ok=True)
        doc = {"results_sha256": _sha256(self.csv), "rows": volatile}
        atomic_write_text(self.row_provenance, json.dumps(doc, indent=0, default=_json_default) + "\n")
        if self.journal.exists():
            self.journal.unlink()
        return len(rows)


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _json_default(v):
    if isinstance(v, (set, tuple)):
        return list(v)
    return str(v)


__all__ = ["JOURNAL", "RESULTS", "ROW_PROVENANCE", "VOLATILE", "ResultStore", "write_text_atomic"]
