"""`harness run` (expand an experiment's sweep, run it in parallel, store results, draw its figures),
`harness figures` (redraw figures, index.md and comparison.md from stored results) and `harness validate`
(the simulator's error table against published and measured numbers; non-zero exit when a bound breaks).

  harness run                      the paper experiment -> results/paper/, figures -> paper_figures/
  harness run ablation --jobs 2    another experiment (experiments/*.toml, or a path to your own)
  harness run paper --set workload=pi0 --set gpus=[8,64] --out /tmp/pi0
  harness run paper --executor ray --address HOST:6379   rows as Ray tasks on a cluster (pip install
                                   'dmuon-harness[ray]'); no --address: a local Ray instance
  harness figures [EXPERIMENT]     all experiments with results by default
  harness validate [--no-measure]  --no-measure: use the stored bench rows instead of new CPU runs
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_RESULTS = Path("results")
DEFAULT_FIGURES = Path("paper_figures")
VALIDATION = "validation"


def _progress_bar(description: str):
    """(callback, context manager) for a rich progress bar (a plain line per update when not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    prog = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
        console=console,
        disable=not console.is_terminal,
    )
    task = prog.add_task(description, total=None, last="")
    plain = not console.is_terminal

    def update(done: int, total: int, last: str) -> None:
        prog.update(task, completed=done, total=total, last=last)
        if plain and last:
            print(f"  [{done}/{total}] {last}", file=sys.stderr, flush=True)

    return update, prog


def print_summary(exp_name: str, rows: list[dict]) -> None:
    import pandas as pd
    from rich.console import Console

    con = Console(soft_wrap=True)
    df = pd.DataFrame(rows)
    if (
        exp_name == "paper"
        and {"strategy", "optimizer_s"} <= set(df.columns)
        and {"adamw", "naive", "dmuon"} <= set(df["strategy"])  # a --set strategy=... subset: no headline
    ):
        from simulator.reference import claims

        from .figures.paper import headline

        h, c = headline(df), claims()
        con.print(
            f"[bold]paper (SIMULATED, {', '.join(sorted(set(df['profile'])))} profile), "
            f"{h['points']} (workload, GPUs) points vs the paper's abstract:"
        )
        con.print(
            f"  optimizer speedup dmuon/naive  {h['optimizer_speedup_min']:.1f}x - "
            f"{h['optimizer_speedup_max']:.0f}x   (paper {c['optimizer_speedup_min']:g}x - "
            f"{c['optimizer_speedup_max']:g}x; grad-sync tail in backward: "
            f"{h['optimizer_speedup_published_min']:.1f}x - {h['optimizer_speedup_published_max']:.0f}x)"
        )
        con.print(
            f"  step speedup dmuon/naive       {h['step_speedup_min']:.2f}x - {h['step_speedup_max']:.2f}x   "
            f"(paper {c['step_speedup_min']:g}x - {c['step_speedup_max']:g}x)"
        )
        con.print(
            f"  dmuon step overhead over adamw mean {h['step_overhead_mean_pct']:+.1f}%   "
            f"(paper ~{c['step_overhead_mean']:g}%)"
        )
    elif exp_name == "ablation" and "variant" in df.columns:
        from .figures.ablation import STEP_LABELS, mean_shares, paper_shares

        ours, paper = mean_shares(df), paper_shares()
        con.print("[bold]ablation (SIMULATED): share of the step-time saving naive -> full DMuon (mean):")
        for k, v in ours.items():
            con.print(
                f"  {STEP_LABELS[k]:36s} {v:5.1f}%   (paper {paper[k]:g}%)"
                if k in paper
                else f"  {STEP_LABELS[k]:36s} {v:5.1f}%   (paper: not attributed)"
            )


def render_figures(exp, out_dir: Path, figures_dir: Path, results_root: Path, console_print=print) -> None:
    from .figures import render_experiment
    from .figures.comparison import write_comparison

    entries = render_experiment(exp.name, results_root, figures_dir, exp.figures or None, results_dir=out_dir)
    for e in entries:
        console_print(f"figure {e['number']}: {figures_dir / e['files'][0]}")
    write_comparison(figures_dir / "comparison.md", results_root)


def register(app, bench) -> None:
    import typer

    @app.command("run")
    def run_cmd(
        experiment: str = typer.Argument(
            "paper",
            help="experiments/<name>.toml name (harness run --list: paper | ablation | scaling "
            "| balancers | kernels | moe | moe_ep | moe_sim_ep) or a path to your own .toml.",
        ),
        out: str = typer.Option(None, help="Output folder (default: results/<experiment>)."),
        jobs: int = typer.Option(
            None,
            help="Worker processes (default: CPU cores; measurements run one at a time). With --executor "
            "ray: at most this many Ray tasks at once (default: no limit; a local Ray instance gets this "
            "many CPUs, default: CPU cores).",
        ),
        executor: str = typer.Option(
            "local",
            help="Where the rows run: local (worker processes on this machine) | ray (one Ray task per "
            "group of rows; needs pip install 'dmuon-harness[ray]'). Same results either way.",
        ),
        address: str = typer.Option(
            None,
            help="With --executor ray: the Ray cluster's address (HOST:6379, or auto); default: start "
            "a local Ray instance.",
        ),
        resume: bool = typer.Option(
            True, "--resume/--no-resume", help="Skip rows already in the output (default) or start over."
        ),
        set_: list[str] = typer.Option(
            None,
            "--set",
            help="Override a setting everywhere: key=value, value in "
            "TOML syntax (--set gpus=[8,64] makes an axis, --set workload=pi0 fixes "
            "it). Repeatable.",
        ),
        figures: bool = typer.Option(
            True, "--figures/--no-figures", help="Draw the experiment's figures afterwards."
        ),
        figures_dir: str = typer.Option(
            None,
            help="Figure folder (default: paper_figures/ for results under results/, else <out>/figures).",
        ),
        list_: bool = typer.Option(
            False, "--list", help="List the experiments and their row counts, then exit."
        ),
    ):
        """Run an experiment's sweep (default: paper): results.csv, config.json, provenance.json, figures;
        commit, host and wall times in <out>/.provenance/ (not tracked by git)."""
        import time

        from rich.console import Console

        from .executors import check_executor, import_ray
        from .experiment import expand, experiment_names, load_experiment
        from .provenance import VOLATILE_DIR
        from .sweep import run_sweep

        con = Console(soft_wrap=True)
        check_executor(executor, address)  # before any work: a bad --executor / --address is one line
        if executor == "ray" and not list_:
            import_ray()  # a missing Ray is one line naming the extra to install
        if list_:
            for name in experiment_names():
                e = load_experiment(name)
                con.print(f"{name:10s} {e.runner:16s} {len(expand(e)):4d} rows  {e.description}")
            return
        exp = load_experiment(experiment, set_ or [])
        out_dir = Path(out) if out else DEFAULT_RESULTS / exp.name
        if out_dir.exists() and not out_dir.is_dir():
            from dmuon.errors import InputError

            raise InputError(f"--out {str(out_dir)!r} is a file; give a folder (it holds results.csv, "
                             "config.json, provenance.json)")
        results_root = out_dir.parent
        fig_dir = (
            Path(figures_dir)
            if figures_dir
            else (
                DEFAULT_FIGURES
                if out_dir.resolve().parent == DEFAULT_RESULTS.resolve()
                else out_dir / "figures"
            )
        )
        n_jobs = jobs if jobs is not None else (None if executor == "ray" else (os.cpu_count() or 1))
        if n_jobs is not None and n_jobs < 1:
            from dmuon.errors import InputError

            raise InputError(f"--jobs must be >= 1, got {n_jobs}")
        t0 = time.perf_counter()
        update, prog = _progress_bar(f"{exp.name}")
        with prog:
            summary = run_sweep(
                exp, out_dir, jobs=n_jobs, resume=resume, progress=update, executor=executor, address=address
            )
        con.print(
            f"{exp.name}: {summary.total} rows ({summary.ran} run, {summary.skipped} already done"
            + (
                f"; {summary.stale} stored rows were from other or unknown code: run again"
                if summary.stale
                else ""
            )
            + (f", {summary.dropped} stored rows not in this sweep dropped" if summary.dropped else "")
            + f") in {summary.wall_s:.1f} s -> {out_dir / 'results.csv'}"
        )
        con.print(
            f"wall times, commit, host: {out_dir / VOLATILE_DIR} (not tracked by git)", highlight=False
        )
        print_summary(exp.name, summary.rows)
        if figures:
            render_figures(exp, out_dir, fig_dir, results_root, con.print)
        con.print(f"total {time.perf_counter() - t0:.1f} s")

    @app.command("figures")
    def figures_cmd(
        experiment: str = typer.Argument(
            "all",
            help="paper | ablation | scaling | balancers | kernels | moe | moe_ep | "
            "validation | sensitivity | published | all (every experiment with stored results).",
        ),
        results: str = typer.Option(str(DEFAULT_RESULTS), help="Folder holding <experiment>/results.csv."),
        out: str = typer.Option(str(DEFAULT_FIGURES), help="Figure folder (index.md and comparison.md too)."),
    ):
        """Redraw figures (PNG + PDF), index.md and comparison.md from stored results."""
        from dmuon.errors import InputError, choice_error

        from .experiment import experiment_names, load_experiment
        from .figures import FIGURES, render_experiment
        from .figures.comparison import write_comparison

        root, fig_dir = Path(results), Path(out)
        known = list(dict.fromkeys(f.experiment for f in FIGURES.values()))
        if experiment == "all":
            todo = [
                e
                for e in known
                if (
                    root / e / FIGURES[next(n for n, f in FIGURES.items() if f.experiment == e)].data
                ).is_file()
            ]
            if not todo:
                raise InputError(
                    f"no results under {root}/ yet; run `harness run` (and `harness validate`) first"
                )
        elif experiment in known or experiment in experiment_names():
            todo = [experiment]
        else:
            raise choice_error("experiment", experiment, (*known, "all"))
        for e in todo:
            names = None
            if e != VALIDATION and e in experiment_names():
                names = load_experiment(e).figures or None
            for entry in render_experiment(e, root, fig_dir, names):
                print(f"figure {entry['number']}: {fig_dir / entry['files'][0]}  (data {entry['data']})")
        path = write_comparison(fig_dir / "comparison.md", root)
        print(f"index: {fig_dir / 'index.md'}   comparison: {path}")

    @app.command("validate")
    def validate_cmd(
        measure: bool = typer.Option(
            True,
            "--measure/--no-measure",
            help="Run real CPU bench-step runs for the "
            "closed loop (default), or use the stored rows (results/validation/"
            "bench_rows.csv, else results/bench/*.csv).",
        ),
        ranks: str = typer.Option("1,2", help="Rank counts of the closed-loop CPU runs (comma list)."),
        repeats: int = typer.Option(3, help="Launches per closed-loop configuration (the median is "
                                    "compared)."),
        out: str = typer.Option(str(DEFAULT_RESULTS / VALIDATION), help="Where validation.csv goes."),
        paper_results: str = typer.Option(
            str(DEFAULT_RESULTS / "paper" / "results.csv"),
            help="The paper experiment's results (run first if missing).",
        ),
        figure: bool = typer.Option(True, "--figure/--no-figure", help="Redraw figure 7 and comparison.md."),
    ):
        """Simulator vs published (8 x A800 table, NS replay, headline) and vs real CPU runs; exit 1 if a
        bound breaks."""
        import time

        from dmuon.errors import InputError

        from .cmd_plan import _csv_list

        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise InputError(f"--repeats must be an integer >= 1, got {repeats!r}")
        rank_counts = tuple(_csv_list(ranks, "--ranks", int))  # checked before any work starts
        if measure and (not rank_counts or any(n < 1 for n in rank_counts)):
            raise InputError(f"--ranks must be a comma list of positive integers, got {ranks!r}")

        import pandas as pd

        from dmuon.io import atomic_path

        from . import validation as v
        from .experiment import load_experiment
        from .provenance import write_provenance
        from .sweep import run_sweep

        out_dir = Path(out)
        t0 = time.perf_counter()
        from .validation_memory import memory_checks

        rows = (v.published_checks() + v.ns_replay_checks() + v.multinode_checks() + memory_checks()
                + v.megatron_checks())
        paper_csv = Path(paper_results)
        if not paper_csv.is_file():
            print(f"{paper_csv} missing: running the paper experiment first", file=sys.stderr)
            run_sweep(load_experiment("paper"), paper_csv.parent, jobs=os.cpu_count() or 1)
        from .figures.common import read_results

        try:
            rows += v.headline_checks(read_results(paper_csv), f"from {paper_csv}")
        except KeyError as e:
            raise InputError(f"{paper_csv} lacks the column {e.args[0]!r}: it is not the paper experiment's "
                             "results table; give --paper-results results/paper/results.csv (harness run "
                             "paper writes it)") from None
        bench_csv = out_dir / "bench_rows.csv"
        if measure:
            bench = v.measure_bench(
                rank_counts,
                progress=lambda s: print(s, file=sys.stderr, flush=True),
                repeats=repeats,
            )
            with atomic_path(bench_csv) as tmp:
                pd.DataFrame(bench).to_csv(tmp, index=False)
            source = "measured now"
        else:
            # the committed validation rows come before any other bench table, whatever --out says
            # (other tables under results/bench hold other bench set-ups than the closed loop's)
            stored = DEFAULT_RESULTS / VALIDATION / "bench_rows.csv"
            bench, src = v.read_bench_rows(list(dict.fromkeys(
                [bench_csv, stored, *sorted(Path(DEFAULT_RESULTS / "bench").glob("*.csv"))])))
            source = f"stored rows {src}"
        rows += v.closed_loop_checks(bench, source)
        df = pd.DataFrame(rows)
        with atomic_path(out_dir / "validation.csv") as tmp:
            df.to_csv(tmp, index=False)

        class _Exp:  # provenance() only reads name and path
            name, path = VALIDATION, Path("harness validate")

        write_provenance(
            out_dir,
            _Exp,
            rows,
            kind="simulated vs published and measured",
            wall_s=time.perf_counter() - t0,
            jobs=1,
            command="harness validate" if measure else "harness validate --no-measure",
        )
        failed = print_validation(df)
        if figure:
            from .figures import render_experiment
            from .figures.comparison import write_comparison

            default = out_dir.resolve() == (DEFAULT_RESULTS / VALIDATION).resolve()
            fig_dir = DEFAULT_FIGURES if default else out_dir / "figures"
            render_experiment(VALIDATION, out_dir.parent, fig_dir, results_dir=out_dir)
            write_comparison(fig_dir / "comparison.md", out_dir.parent)
        print(f"written: {out_dir / 'validation.csv'}")
        if failed:
            raise typer.Exit(1)


def print_validation(df) -> int:
    """The error table; returns the number of checked rows outside their bound."""
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 150))
    failed = 0
    for check, sub in df.groupby("check", sort=False):
        profiles = ", ".join(sorted(set(sub["profile"].astype(str))))
        t = Table(title=f"{check}: {sub['reference_kind'].iloc[0]} vs simulated ({profiles} profile)")
        for c in ("point", "metric", "reference", "simulated", "error", "bound", "ok"):
            t.add_column(c, justify="left" if c in ("point", "metric") else "right")
        for r in sub.itertuples():
            scale, unit = (1e3, " ms") if r.unit == "s" else (1.0, r.unit)
            bound = "" if r.bound != r.bound or r.bound is None else f"{r.bound:.0%}"
            ok = ("yes" if r.within_bound else "[red]NO[/red]") if r.bounded else "shown"
            failed += bool(r.bounded and not r.within_bound)
            t.add_row(
                r.label,
                str(r.metric),
                f"{r.reference * scale:.4g}{unit}",
                f"{r.simulated * scale:.4g}{unit}",
                f"{r.error:+.1%}",
                bound or ("see note" if r.bounded else ""),
                ok,
            )
        con.print(t)
        for note in dict.fromkeys(n for n in sub["note"].astype(str) if n and n != "nan"):
            con.print(f"  note: {note}", highlight=False)
    n_checked = int(df["bounded"].sum())
    con.print(
        f"[bold]{n_checked - failed} of {n_checked} checked rows within their bounds; {failed} outside."
    )
    return failed
