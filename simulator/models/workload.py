"""Workloads: the weight matrices of a model, from the built-in catalog or a user's TOML/CSV file.

The catalog is `experiments/workloads.csv` (copied from the project's shared reference facts). A row
gives a matrix shape and how many times it occurs (`count`) in a component; this module expands the rows
into one `ParamSpec` per weight matrix, with a forward-order layer index:

- per component (in file order): embeddings first (their own layer), then the blocks, then matrices that
  occur once (projectors, mergers, heads), each its own layer;
- blocks: L = gcd of the counts > 1 in the component; a row with count c (c % L == 0) puts c / L
  matrices in each of the L blocks; a count that does not divide into the blocks is an error.

Custom workloads (what-if questions about your own model), TOML:

    name = "my-model"            # optional (defaults to the file stem)
    notes = ["anything to say"]  # optional
    [[matrices]]
    name = "q_proj"              # required
    rows = 4096                  # required, positive integer
    cols = 4096                  # required, positive integer
    count = 32                   # optional, default 1
    optimizer = "muon"           # optional: muon | adamw (default muon)
    component = "lm"             # optional (default "model")

or CSV with the catalog's columns (`matrix,rows,cols` required; `component,count,optimizer,note,workload`
optional), or a Hugging Face config.json (`simulator.models.hf_config`: every weight tensor of the model, fused
MoE experts one ParamSpec of E matrices each, as `dmuon.params.decide` routes them). No torch, no simpy:
importable anywhere. The types (ParamSpec, Workload) are simulator.models.workload_spec's.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import tomllib

from dmuon.errors import choice_error

from .workload_spec import MAX_COUNT, MAX_DIM, OPTIMIZERS, ParamSpec, Workload, WorkloadError

CATALOG_PATH = Path(__file__).resolve().parents[2] / "experiments" / "workloads.csv"
_ROW_KEYS = ("matrix", "rows", "cols", "count", "optimizer", "component", "note", "workload")
_TOML_TOP_KEYS = ("name", "notes", "matrices")
_TOML_MATRIX_KEYS = ("name", "rows", "cols", "count", "optimizer", "component", "note")


@dataclass(frozen=True)
class _Row:
    component: str
    matrix: str
    rows: int
    cols: int
    count: int
    optimizer: str
    note: str


def _positive_int(value, what: str, where: str, maximum: int = MAX_DIM) -> int:
    if isinstance(value, bool):
        raise WorkloadError(f"{where}: {what} must be a positive integer, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not (text.isascii() and text.isdigit()):  # int() rejects some Unicode digits (e.g. '²')
            raise WorkloadError(f"{where}: {what} must be a positive integer, got {value!r}")
        value = int(text)
    if not isinstance(value, int) or value <= 0:
        raise WorkloadError(f"{where}: {what} must be a positive integer, got {value!r}")
    if value > maximum:
        raise WorkloadError(f"{where}: {what} must be a positive integer <= {maximum}, got {value!r}")
    return value


def _make_row(raw: dict, where: str) -> _Row:
    name = raw.get("matrix", raw.get("name"))
    if not isinstance(name, str) or not name.strip():
        raise WorkloadError(f"{where}: a matrix needs a non-empty name")
    optimizer = str(raw.get("optimizer") or "muon").strip().lower()
    if optimizer not in OPTIMIZERS:
        raise WorkloadError(f"{where}: optimizer {optimizer!r} is not accepted; accepted: "
                            f"{', '.join(OPTIMIZERS)}")
    count = raw.get("count")
    return _Row(
        component=str(raw.get("component") or "model").strip(),
        matrix=name.strip(),
        rows=_positive_int(raw.get("rows"), "rows", where),
        cols=_positive_int(raw.get("cols"), "cols", where),
        count=1 if count in (None, "") else _positive_int(count, "count", where, MAX_COUNT),
        optimizer=optimizer,
        note=str(raw.get("note") or ""),
    )


def _expand(name: str, rows: list[_Row], source: str, notes: tuple[str, ...]) -> Workload:
    """Rows -> one ParamSpec per matrix with forward-order layer indices (see the module docstring)."""
    if not rows:
        raise WorkloadError(f"workload {name!r} ({source}) has no matrices")
    components: dict[str, list[_Row]] = {}
    for r in rows:
        components.setdefault(r.component, []).append(r)
    params: list[ParamSpec] = []
    layer = 0
    for comp, comp_rows in components.items():
        multi = [r.count for r in comp_rows if r.count > 1]
        blocks = math.gcd(*multi) if multi else 0
        embeds = [r for r in comp_rows if r.count == 1 and "embed" in r.matrix.lower()]
        singles = [r for r in comp_rows if r.count == 1 and r not in embeds]
        for r in embeds:
            params.append(ParamSpec(f"{comp}.{r.matrix}", comp, r.matrix, r.rows, r.cols, layer, r.optimizer,
                                    note=r.note))
            layer += 1
        for b in range(blocks):
            for r in comp_rows:
                if r.count <= 1:
                    continue
                per_block = r.count // blocks
                for k in range(per_block):
                    suffix = f".{k}" if per_block > 1 else ""
                    params.append(ParamSpec(f"{comp}.{b}.{r.matrix}{suffix}", comp, r.matrix, r.rows, r.cols,
                                            layer, r.optimizer, block=b, note=r.note))
            layer += 1
        for r in singles:
            params.append(ParamSpec(f"{comp}.{r.matrix}", comp, r.matrix, r.rows, r.cols, layer, r.optimizer,
                                    note=r.note))
            layer += 1
    names = Counter(p.name for p in params)
    dup = [n for n, c in names.items() if c > 1]
    if dup:
        raise WorkloadError(f"workload {name!r} ({source}): duplicate matrix names {dup[:5]}; "
                            "give each (component, matrix) row a distinct name")
    return Workload(name=name, params=tuple(params), notes=notes, source=source)


@lru_cache(maxsize=1)
def _catalog() -> dict[str, tuple[tuple[_Row, ...], tuple[str, ...]]]:
    out: dict[str, tuple[list[_Row], list[str]]] = {}
    with open(CATALOG_PATH, newline="") as f:
        for i, raw in enumerate(csv.DictReader(f), start=2):
            row = _make_row(raw, f"{CATALOG_PATH}:{i}")
            rows, notes = out.setdefault(raw["workload"], ([], []))
            rows.append(row)
            if "ASSUMPTION" in row.note and row.note not in notes:
                notes.append(row.note)
    return {k: (tuple(r), tuple(n)) for k, (r, n) in out.items()}


def catalog_names() -> tuple[str, ...]:
    """Names of the built-in workloads, in catalog order."""
    return tuple(_catalog())


def load_workload(name_or_path: str | Path) -> Workload:
    """A catalog workload by name, a custom workload from a .toml / .csv file, or a model from a Hugging
    Face config.json (a .json path, a folder holding config.json, or a model shipped in
    experiments/models/: simulator.models.hf_config)."""
    from .hf_config import load_model, model_names, model_path

    text = str(name_or_path)
    if text in _catalog():
        rows, notes = _catalog()[text]
        return _expand(text, list(rows), "catalog", notes)
    path = Path(text)
    if path.suffix.lower() in (".toml", ".csv"):
        if not path.is_file():
            raise WorkloadError(f"workload file {text!r} does not exist")
        return _load_toml(path) if path.suffix.lower() == ".toml" else _load_csv(path)
    if model_path(text) is not None:
        return load_model(text)
    raise choice_error("workload", text, list(catalog_names()) + list(model_names())
                       + ["<path>.toml", "<path>.csv", "<path>/config.json"])


def resolve_workload(workload, model=None, per_head: bool = False) -> Workload:
    """The workload a configuration names: `model` (a Hugging Face config.json path, folder or shipped
    model name; per_head: its attention matrices cut per head) when given, else `workload` (a Workload, a
    catalog name or a file)."""
    if model is not None:
        from .hf_config import load_model

        if not isinstance(model, (str, Path)) or not str(model).strip():
            raise WorkloadError(f"model must be a config.json path, a folder holding one or a shipped "
                                f"model's name, got {model!r}")
        return load_model(model, per_head)
    return workload if isinstance(workload, Workload) else load_workload(workload)


def _load_toml(path: Path) -> Workload:
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: malformed TOML: {e}") from None
    unknown = sorted(set(data) - set(_TOML_TOP_KEYS))
    if unknown:
        raise WorkloadError(f"{path}: unknown key {unknown[0]!r}; accepted: {', '.join(_TOML_TOP_KEYS)}")
    mats = data.get("matrices")
    if not isinstance(mats, list) or not mats or not all(isinstance(m, dict) for m in mats):
        raise WorkloadError(f"{path}: needs at least one [[matrices]] table with name, rows, cols")
    rows = []
    for i, m in enumerate(mats):
        where = f"{path}: matrices[{i}]"
        bad = sorted(set(m) - set(_TOML_MATRIX_KEYS))
        if bad:
            raise WorkloadError(f"{where}: unknown key {bad[0]!r}; accepted: {', '.join(_TOML_MATRIX_KEYS)}")
        rows.append(_make_row(m, where))
    name = data.get("name", path.stem)
    notes = data.get("notes", [])
    if not isinstance(name, str) or not name.strip():
        raise WorkloadError(f"{path}: name must be a non-empty string")
    if isinstance(notes, str):
        notes = [notes]
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise WorkloadError(f"{path}: notes must be a string or a list of strings")
    return _expand(name, rows, str(path), tuple(notes))


def _load_csv(path: Path) -> Workload:
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [k for k in ("matrix", "rows", "cols") if k not in header]
            if missing:
                raise WorkloadError(f"{path}: missing column {missing[0]!r}; required: matrix, rows, cols; "
                                    "optional: "
                                    + ", ".join(k for k in _ROW_KEYS if k not in ("matrix", "rows", "cols")))
            unknown = [k for k in header if k not in _ROW_KEYS]
            if unknown:
                raise WorkloadError(f"{path}: unknown column {unknown[0]!r}; accepted: "
                                    f"{', '.join(_ROW_KEYS)}")
            rows = []
            for i, raw in enumerate(reader, start=2):
                if None in raw:
                    raise WorkloadError(f"{path}:{i}: more fields than columns")
                rows.append(_make_row(raw, f"{path}:{i}"))
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: not a text CSV file: {e}") from None
    except csv.Error as e:
        raise WorkloadError(f"{path}: malformed CSV: {e}") from None
    return _expand(path.stem, rows, str(path), ())
