"""The paper figures: a registry of every figure (number, the experiment whose results it draws, title),
rendering to PNG + PDF, and the index (paper_figures/index.md, from figures.json) that names for each
figure the command and the data file behind it. comparison.md is written by `harness.figures.comparison`.

    render_experiment("paper", results_root=Path("results"), figures_dir=Path("paper_figures"))

Modules: common (style, saving), paper (1, 2, 6), scaling (3), ablation (4), balancers (5),
validation (7), kernels (8), moe (9), moe_ep (10), sensitivity (11: the tornado chart of
`harness sensitivity`, drawn from its CSV), published (12: the overhead breakdown per model of
`scripts/published_vs_ours.py --breakdown`), comparison (comparison.md).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from dmuon.errors import InputError, choice_error


@dataclass(frozen=True)
class FigureSpec:
    number: int
    name: str
    experiment: str  # results/<experiment>/ holds its data
    title: str
    func: str  # "module:function", called as function(df, results_dir) -> matplotlib Figure
    data: str = "results.csv"  # file inside results/<experiment>/
    file_stem: str | None = None  # the files' name when not <number>_<name>
    command: str | None = None  # what writes the data, when not `harness run <experiment>`

    @property
    def stem(self) -> str:
        return self.file_stem or f"{self.number:02d}_{self.name}"


SENSITIVITY_CSV = "qwen2.5-7b_128_dmuon_step.csv"  # the configuration figure 11 shows (docs/simulator.md)

FIGURES = {
    f.name: f
    for f in (
        FigureSpec(
            1,
            "optimizer_time",
            "paper",
            "Optimizer step time per workload and GPU count (log scale)",
            "paper:optimizer_time",
        ),
        FigureSpec(
            2,
            "step_speedup",
            "paper",
            "Step time, speedup over naive Muon, overhead over AdamW",
            "paper:step_speedup",
        ),
        FigureSpec(
            3,
            "scaling",
            "scaling",
            "Scaling what-if: throughput vs GPUs (A800, H200), NIC bandwidth, GPUs per node, split NS",
            "scaling:scaling",
        ),
        FigureSpec(
            4,
            "ablation",
            "ablation",
            "Ablation: contribution of each optimization, ours beside the paper's",
            "ablation:ablation",
        ),
        FigureSpec(
            5,
            "balancer_loads",
            "balancers",
            "Per-rank optimizer load: round-robin vs LPT vs MILP",
            "balancers:balancer_loads",
        ),
        FigureSpec(
            6,
            "timeline",
            "paper",
            "Simulated timeline of one training step per strategy (Gantt)",
            "paper:timeline",
        ),
        FigureSpec(
            7,
            "validation",
            "validation",
            "Validation: simulated vs published / measured",
            "validation:validation",
            data="validation.csv",
        ),
        FigureSpec(
            8, "kernels", "kernels", "Orthogonalization variants measured on this CPU", "kernels:kernels"
        ),
        FigureSpec(
            9, "moe", "moe", "MoE what-if: step and optimizer time vs GPUs per model and cluster", "moe:moe"
        ),
        FigureSpec(
            10, "moe_ep", "moe_ep", "MoE owner plans: NS makespan vs expert-parallel degree", "moe_ep:moe_ep"
        ),
        FigureSpec(
            11,
            "sensitivity",
            "sensitivity",
            "Sensitivity: which uncertain profile input moves the simulated step most (tornado)",
            "sensitivity:sensitivity",
            data=SENSITIVITY_CSV,
            file_stem="sensitivity",
            command="harness sensitivity --workload qwen2.5-7b --gpus 128 --csv "
            f"results/sensitivity/{SENSITIVITY_CSV}",
        ),
        FigureSpec(
            12,
            "overhead_breakdown",
            "published",
            "Why DMuon's overhead differs between models: its parts per model, published schedule",
            "published:overhead_breakdown",
            data="breakdown.csv",
            command="python -m scripts.published_vs_ours --breakdown results/published/breakdown.csv",
        ),
    )
}


def _call(spec: FigureSpec, df, results_dir: Path):
    mod, fn = spec.func.split(":")
    f = getattr(importlib.import_module(f"{__name__}.{mod}"), fn)
    return f(df, results_dir) if fn == "timeline" else f(df)


def figure_caption(fig) -> str:
    texts = [t.get_text() for t in fig.texts if t.get_position()[1] < 0]
    return texts[0] if texts else ""


def render(
    name: str, results_dir: Path, figures_dir: Path, *, stem: str | None = None, command: str | None = None
) -> dict:
    """Draw figure `name` from results_dir/<its data file>; returns its index entry."""
    from .common import plt, read_results, save

    if name not in FIGURES:
        raise choice_error("figure", name, tuple(FIGURES))
    spec = FIGURES[name]
    data = Path(results_dir) / spec.data
    df = read_results(data)
    if df.empty:
        raise InputError(f"{data} has no rows")
    try:
        fig = _call(spec, df, Path(results_dir))
    except KeyError as e:  # a table from another experiment or an older version of it
        raise InputError(
            f"{data} lacks the column {e.args[0]!r} that figure {spec.number} ({name}) needs; it holds "
            f"{', '.join(map(str, df.columns[:12]))}{', ...' if len(df.columns) > 12 else ''}. Re-run "
            f"`harness run {spec.experiment}` to rewrite it"
        ) from None
    paths = save(fig, figures_dir, stem or spec.stem)
    entry = {
        "number": spec.number,
        "name": name,
        "title": spec.title,
        "caption": figure_caption(fig),
        "files": [p.name for p in paths],
        "data": _rel(data),
        "command": command
        or spec.command
        or (
            "harness validate && harness figures validation"
            if spec.experiment == "validation"
            else f"harness run {spec.experiment}"
        ),
        "redraw": f"harness figures {spec.experiment}",
    }
    plt().close(fig)
    return entry


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def figures_of(experiment: str, names: list[str] | None = None) -> list[str]:
    if names:
        return list(names)
    return [n for n, f in FIGURES.items() if f.experiment == experiment]


def render_experiment(
    experiment: str,
    results_root: Path,
    figures_dir: Path,
    names: list[str] | None = None,
    *,
    results_dir: Path | None = None,
    update_index: bool = True,
) -> list[dict]:
    """Every figure of `experiment` (or `names`) from results_root/<experiment>/ (or results_dir)."""
    rdir = Path(results_dir) if results_dir is not None else Path(results_root) / experiment
    entries = []
    canonical = experiment in {f.experiment for f in FIGURES.values()}
    for name in figures_of(experiment, names):
        stem = None if canonical else f"{experiment}_{name}"
        entries.append(
            render(
                name, rdir, figures_dir, stem=stem, command=None if canonical else f"harness run {experiment}"
            )
        )
    if update_index:
        write_index(figures_dir, entries)
    return entries


_ENTRY_KEYS = frozenset({"number", "title", "files", "data", "command", "redraw", "caption"})


def write_index(figures_dir: Path, entries: list[dict]) -> Path:
    """Merge `entries` into figures.json and regenerate index.md from it (both atomically)."""
    from dmuon.io import atomic_write_text as write_text_atomic

    figures_dir = Path(figures_dir)
    store = figures_dir / "figures.json"
    known = {}
    if store.exists():
        try:
            known = json.loads(store.read_text())
            if not isinstance(known, dict) or not all(isinstance(v, dict) and _ENTRY_KEYS <= set(v)
                                                      for v in known.values()):
                raise ValueError("not a map of figure entries")
        except (ValueError, UnicodeDecodeError) as e:
            import warnings

            warnings.warn(f"ignoring corrupt {store} ({e}); the index is rebuilt from the figures drawn now",
                          stacklevel=2)
            known = {}
    for e in entries:
        known[e["files"][0].rsplit(".", 1)[0]] = e
    write_text_atomic(store, json.dumps(dict(sorted(known.items())), indent=1) + "\n")
    lines = [
        "# Paper figures",
        "",
        "Generated by the `harness` CLI from the committed result tables; every caption says whether its",
        "numbers are simulated (and with which hardware profile) or measured (and where).",
        "Regenerate one experiment's data with the first command, redraw with the second. "
        "[comparison.md](comparison.md) puts our numbers beside the published ones.",
        "",
    ]
    for _stem, e in sorted(known.items(), key=lambda kv: (kv[1]["number"], kv[0])):
        png, pdf = e["files"][0], e["files"][1] if len(e["files"]) > 1 else ""
        lines += [
            f"## {e['number']}. {e['title']}",
            "",
            f"![{e['title']}]({png})",
            "",
            f"- files: [{png}]({png})" + (f", [{pdf}]({pdf})" if pdf else ""),
            f"- data: `{e['data']}`",
            f"- data command: `{e['command']}`",
            f"- redraw: `{e['redraw']}`",
            f"- caption: {e['caption']}",
            "",
        ]
    path = figures_dir / "index.md"
    write_text_atomic(path, "\n".join(lines))
    return path


__all__ = ["FIGURES", "FigureSpec", "figures_of", "render", "render_experiment", "write_index"]
