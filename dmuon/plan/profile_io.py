"""The profile CSV format: what a cost table is built from (read, validate, write atomically).

One row per measured (or derived) number, columns:

    device,op,rows,cols,batch,method,dtype,time_s,source

op              meaning of the row                                   rows, cols, batch, method
ns              one orthogonalization call of a (batch, rows, cols)   shape as called (the cost table keys
                stack, 5 steps, restart at 2, wall seconds            it by (min, max)); method in
                                                                      standard|standard_sym|gram|gram_sym
muon_momentum   one fused pass over rows*cols elements: momentum,     numel = rows * cols (cols = 1);
adamw           Nesterov, apply / one AdamW step                      batch = the number of equal tensors
grad_prep       (gradient sum -> mean, non-finite check)              the elements are split over (1: one
                                                                      tensor); method empty
matmul          one dense (rows x rows) @ (rows x rows) product:      rows = cols = n; sets the device's
                2 n^3 FLOPs (CPU peak, measured)                      achieved peak for `dtype`
copy            one tensor copy of rows*cols elements: read + write   numel as above; sets the bandwidth
model_scale     time_s holds a dimensionless factor that multiplies   rows/cols/batch empty; method named
                the *modelled* (never a measured) time of `method`    (a calibration; see `source`)

dtype: bf16 | fp16 | fp32. source: where the number came from (a table of reported.csv, or
"measured here: <host>, <torch>, median of K"). Timings are seconds (SI), never ms.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .flops import METHODS

COLUMNS = ("device", "op", "rows", "cols", "batch", "method", "dtype", "time_s", "source")
NS_OP = "ns"
ELEMENTWISE_OPS = ("muon_momentum", "adamw", "grad_prep")
OPS = (NS_OP, *ELEMENTWISE_OPS, "matmul", "copy", "model_scale")
DTYPES = ("bf16", "fp16", "fp32")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ProfileRow:
    device: str
    op: str
    rows: int
    cols: int
    batch: int
    method: str
    dtype: str
    time_s: float
    source: str

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def shape_key(self) -> tuple[int, int]:
        """(n, m) = (min, max): the NS cost of a matrix and of its transpose are the same."""
        return (min(self.rows, self.cols), max(self.rows, self.cols))


def _int_field(raw: dict, key: str, where: str, default: int | None = None) -> int:
    text = (raw.get(key) or "").strip()
    if not text and default is not None:
        return default
    try:
        v = int(text)
    except ValueError:
        raise InputError(f"{where}: {key} must be a positive integer, got {text!r}") from None
    if v <= 0:
        raise InputError(f"{where}: {key} must be a positive integer, got {v}")
    return v


def parse_row(raw: dict, where: str) -> ProfileRow:
    """One CSV record -> a validated ProfileRow (InputError saying what is wrong and what is accepted)."""
    op = (raw.get("op") or "").strip()
    if op not in OPS:
        raise InputError(f"{where}: unknown op {op!r}; accepted: {', '.join(OPS)}")
    method = (raw.get("method") or "").strip()
    dtype = (raw.get("dtype") or "").strip()
    if op in (NS_OP, "model_scale") and method not in METHODS:
        raise InputError(f"{where}: unknown method {method!r} for op {op}; accepted: {', '.join(METHODS)}")
    if op != "model_scale" and dtype not in DTYPES:
        raise InputError(f"{where}: unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    try:
        t = float((raw.get("time_s") or "").strip())
    except ValueError:
        raise InputError(f"{where}: time_s must be a number, got {raw.get('time_s')!r}") from None
    if not (math.isfinite(t) and t > 0):
        raise InputError(f"{where}: time_s must be a positive finite number, got {t!r}")
    sized = op != "model_scale"
    return ProfileRow(
        device=(raw.get("device") or "").strip(),
        op=op,
        rows=_int_field(raw, "rows", where) if sized else 1,
        cols=_int_field(raw, "cols", where, default=1) if sized else 1,
        batch=_int_field(raw, "batch", where, default=1),
        method=method,
        dtype=dtype,
        time_s=t,
        source=(raw.get("source") or "").strip(),
    )


def read_profile(path: str | Path) -> list[ProfileRow]:
    """All rows of a profile CSV; InputError for a missing file, a bad header or a bad row."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"profile file {str(path)!r} does not exist")
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = tuple(reader.fieldnames or ())
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise InputError(
                    f"{path}: missing column(s) {', '.join(missing)}; "
                    f"a profile CSV has the columns {','.join(COLUMNS)}"
                )
            return [parse_row(raw, f"{path}:{i}") for i, raw in enumerate(reader, start=2)]
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a text CSV file: {e}") from None
    except csv.Error as e:
        raise InputError(f"{path}: malformed CSV: {e}") from None


def format_rows(rows: list[ProfileRow]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        sized = r.op != "model_scale"
        w.writerow(
            [
                r.device,
                r.op,
                r.rows if sized else "",
                r.cols if sized else "",
                r.batch if sized else "",
                r.method,
                r.dtype,
                repr(float(r.time_s)),
                r.source,
            ]
        )
    return buf.getvalue()


def keep_faster(rows: list[ProfileRow], earlier: list[ProfileRow]) -> list[ProfileRow]:
    """Merge a new run with an earlier one of the same points: per point the faster time (contention on
    a shared machine only ever slows a run down). Points only in one run are kept as they are; the source
    says how many runs a point is the best of."""
    import re

    def key(r: ProfileRow):
        return (r.device, r.op, r.rows, r.cols, r.batch, r.method, r.dtype)

    def runs(r: ProfileRow) -> int:
        m = re.search(r"; fastest of (\d+) runs$", r.source)
        return int(m.group(1)) if m else 1

    old = {key(r): r for r in earlier}
    out = []
    for r in rows:
        e = old.get(key(r))
        if e is None or r.op == "model_scale":
            out.append(r)
            continue
        best = r if r.time_s <= e.time_s else e
        base = re.sub(r"; fastest of \d+ runs$", "", best.source)
        out.append(ProfileRow(*key(best), best.time_s, f"{base}; fastest of {runs(r) + runs(e)} runs"))
    return out


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` via a temp file in the same folder and os.replace: never half-written
    (`dmuon.io.atomic_write_text`)."""
    from ..io import atomic_write_text

    atomic_write_text(path, text)


def write_profile(path: str | Path, rows: list[ProfileRow]) -> None:
    """Write a profile CSV atomically (rows in the given order)."""
    write_text_atomic(path, format_rows(rows))
