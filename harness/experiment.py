"""Experiments as data: load an experiment file, check it, apply `--set` overrides, expand its sweep.

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
Each row is identified by `run_id` (a hash of its settings). Running the rows is `harness.sweep`'s.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from dmuon.errors import InputError, choice_error

from .provenance import ROOT, shown_path
from .runners import get_runner
from .values import parse_value  # noqa: F401 (harness.experiment.parse_value, as before)

EXPERIMENTS_DIR = ROOT / "experiments"
TOP_KEYS = ("description", "runner", "figures", "fixed", "axes", "grid", "variants", "trace")
GRID_KEYS = ("name", "fixed", "axes")


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


__all__ = [
    "EXPERIMENTS_DIR",
    "Experiment",
    "Grid",
    "apply_overrides",
    "expand",
    "experiment_names",
    "experiment_path",
    "load_experiment",
    "parse_overrides",
    "parse_value",
    "run_id",
]
