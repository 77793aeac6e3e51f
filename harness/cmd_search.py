"""`harness search`: the fastest layouts of a model on a cluster for a GPU count and a global batch
(harness.search_space enumerates them, harness.search simulates them cheapest bound first).

  harness search --model experiments/models/llama-3.1-70b/config.json --gpus 1024 --gpu h100
  harness search --model qwen3-30b-a3b --gpus 256 --gpu h100 --ep 1,8,16 --top 3 --out /tmp/q3
  harness search ... --executor ray --address HOST:6379     the simulations as Ray tasks

Prints the best `--top` layouts of each strategy, then the best AdamW, DMuon and naive-Muon layouts side
by side; writes results.csv (simulated rows, as `harness run`), layouts.csv (every layout: simulated,
pruned, no-fit or dropped, with the reason) and pareto.png / .pdf (step time against memory per GPU).
"""

from __future__ import annotations

from pathlib import Path

from dmuon.errors import InputError

from .search_space import STRATEGIES, describe

DEFAULT_OUT = Path("results") / "search"


def int_list(name: str, text: str | None) -> tuple[int, ...] | None:
    """'1,2,8' -> (1, 2, 8); None stays None (every value the rules allow)."""
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise InputError(f"{name} must be comma-separated integers (e.g. 1,2,8), got {text!r}") from None
    if not values:
        raise InputError(f"{name} is empty; give comma-separated integers (e.g. 1,2,8) or leave it out")
    return values


def word_list(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(v.strip() for v in str(text).split(",") if v.strip())


def ranked_table(summary, top: int) -> list[str]:
    """Lines: per strategy its best `top` layouts (step ms, vs the best AdamW, memory, bound)."""
    ref = summary.best("adamw")
    lines = []
    for s in STRATEGIES:
        rows = [r for r in summary.rows if r["strategy"] == s][:top]
        if not rows:
            continue
        lines.append(f"{s}: best {len(rows)} of {sum(1 for x in summary.rows if x['strategy'] == s)} "
                     "simulated")
        lines.append(f"  {'#':>2} {'layout':42s} {'step ms':>9} {'vs adamw':>9} {'tok/s/GPU':>10} "
                     f"{'mem GiB':>8} {'bound ms':>9}")
        for i, r in enumerate(rows, 1):
            lines.append(f"  {i:>2} {describe(r):42s} {r['step_s'] * 1e3:9.1f} {_vs(r, ref):>9} "
                         f"{r['tokens_per_s'] / r['gpus']:10.0f} {_mem(r):>8} {r['bound_s'] * 1e3:9.1f}")
    return lines


def _vs(r, ref) -> str:
    return "" if ref is None else f"{(r['step_s'] / ref['step_s'] - 1) * 100:+.1f}%"


def _mem(r) -> str:
    return "n/a" if r.get("mem_gib") is None else f"{r['mem_gib']:.1f}"


def side_by_side(summary) -> list[str]:
    """The best AdamW, DMuon and naive-Muon layouts in one table."""
    ref = summary.best("adamw")
    lines = [f"  {'strategy':8s} {'best layout':42s} {'step ms':>9} {'vs adamw':>9} {'mem GiB':>8}"]
    for s in STRATEGIES:
        r = summary.best(s)
        if r is not None:
            lines.append(f"  {s:8s} {describe(r):42s} {r['step_s'] * 1e3:9.1f} {_vs(r, ref):>9} {_mem(r):>8}")
    return lines


def pareto_front(rows: list[dict]) -> list[dict]:
    """Rows no other row beats in both step time and memory (rows without memory: by step time only)."""
    pts = sorted(rows, key=lambda r: (r.get("mem_gib") or 0.0, r["step_s"]))
    front, best = [], float("inf")
    for r in pts:
        if r["step_s"] < best:
            front.append(r)
            best = r["step_s"]
    return front


def pareto_figure(summary, title: str, out_dir: Path) -> list[Path]:
    """Step time against memory per GPU, every simulated layout, each strategy's front as a line."""
    from .figures.common import STRATEGY_COLORS, STRATEGY_LABELS, caption, plt, save

    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7.0, 4.2))
    for s in STRATEGIES:
        rows = [r for r in summary.rows if r["strategy"] == s]
        if not rows:
            continue
        xs = [r.get("mem_gib") or 0.0 for r in rows]
        ax.scatter(xs, [r["step_s"] * 1e3 for r in rows], s=14, alpha=0.5, color=STRATEGY_COLORS[s])
        front = pareto_front(rows)
        ax.plot([r.get("mem_gib") or 0.0 for r in front], [r["step_s"] * 1e3 for r in front], "-o", ms=4,
                color=STRATEGY_COLORS[s], label=f"{STRATEGY_LABELS[s]} (front)")
    ax.set_xlabel("peak memory per GPU (GiB)" if summary.memory_modelled else
                  "memory per GPU: not modelled by this simulator (0)")
    ax.set_ylabel("step time (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    caption(fig, f"SIMULATED; {summary.simulated + summary.reused} layouts simulated, {summary.pruned} pruned "
                 "by their bound " + ("(none of them on a front: the fronts are exact)" if summary.front else
                                      "(fronts of the simulated layouts; --front makes them exact)")
                 + ", harness search")
    paths = save(fig, out_dir, "pareto")
    pyplot.close(fig)
    return paths


def register(app, bench) -> None:
    import typer

    from .profile_help import gpu_help

    @app.command("search")
    def search_cmd(
        model: str = typer.Option(None, help="A Hugging Face config.json (path, folder, or a model in "
                                  "experiments/models/)."),
        workload: str = typer.Option(None, help="A catalog workload instead of --model (tp stays 1)."),
        gpus: int = typer.Option(..., help="GPUs in all."),
        gpu: str = typer.Option("a800", help=gpu_help()),
        cluster: str = typer.Option(None, help="A cluster file (experiments/clusters/<name>)."),
        gpus_per_node: int = typer.Option(None, help="GPUs per node (default: the profile's)."),
        global_batch: int = typer.Option(None, help="Sequences per optimizer step (default: one per GPU)."),
        seq_len: int = typer.Option(None, help="Tokens per sequence (default: harness simulate's)."),
        strategy: str = typer.Option(None, help="Strategies, comma-separated (default adamw,dmuon,naive)."),
        layout: str = typer.Option(None, help="Data-parallel layouts, comma-separated (default: all)."),
        tp: str = typer.Option(None, help="Tensor-parallel degrees, e.g. 1,2,4,8 (default: all allowed)."),
        pp: str = typer.Option(None, help="Pipeline degrees (default: all allowed)."),
        vpp: str = typer.Option(None, help="Virtual stages per rank (default: 1,2 where pp > 1)."),
        ep: str = typer.Option(None, help="Expert-parallel degrees (MoE; default: all allowed)."),
        micro_batch: str = typer.Option(None, help="Sequences per micro-batch (default: powers of 2)."),
        recompute: str = typer.Option(None, help="none,selective,full (default: all the simulator has)."),
        top: int = typer.Option(5, help="Layouts per strategy in the table (pruning keeps these exact)."),
        front: bool = typer.Option(False, "--front/--no-front", help="Also keep the step-time / memory "
                                   "Pareto front exact (prunes less: slower)."),
        out: str = typer.Option(None, help=f"Output folder (default: {DEFAULT_OUT}/<model>_<gpus>_<gpu>)."),
        resume: bool = typer.Option(True, "--resume/--no-resume", help="Reuse rows already in --out."),
        executor: str = typer.Option("local", help="local | ray (as harness run)."),
        address: str = typer.Option(None, help="With --executor ray: the Ray cluster's address."),
        jobs: int = typer.Option(1, help="Simulations at once (local processes or Ray tasks)."),
        figure: bool = typer.Option(True, "--figure/--no-figure", help="Draw pareto.png / pareto.pdf."),
    ):
        """Search the layouts (tp, pp, vpp, dp layout, ep, micro-batch, recompute, strategy) of a model on
        GPUS GPUs: the fastest that fit, per strategy, and step time against memory."""
        import shlex
        import sys

        from rich.console import Console

        from simulator.api import SimConfig, node_shape, profile_of

        from .executors import check_executor, import_ray
        from .search import run_search
        from .search_space import Space, model_dims

        check_executor(executor, address)
        if executor == "ray":
            import_ray()
        if (model is None) == (workload is None):
            raise InputError("give one of --model (a config.json) or --workload (a catalog name)")
        if isinstance(gpus, bool) or gpus < 1:
            raise InputError(f"gpus must be an integer >= 1, got {gpus!r}")
        fixed = {"model": model} if model else {"workload": workload}
        fixed.update(gpu=gpu)
        if cluster:
            fixed["cluster"] = cluster
        if gpus_per_node:
            fixed["gpus_per_node"] = gpus_per_node
        cfg = SimConfig(**{k: v for k, v in fixed.items() if k != "model"}, model=model, gpus=gpus)
        per_node = node_shape(gpus, gpus_per_node or profile_of(cfg).gpus_per_node)[1]
        dims = model_dims(model=model) if model else model_dims(workload=workload)
        space = Space(gpus=gpus, global_batch=global_batch or gpus, seq_len=seq_len or SimConfig.seq_len,
                      per_node=per_node, dims=dims, fixed=fixed,
                      strategies=word_list(strategy) or STRATEGIES,
                      layouts=word_list(layout) or Space.layouts, tp=int_list("tp", tp),
                      pp=int_list("pp", pp), vpp=int_list("vpp", vpp), ep=int_list("ep", ep),
                      micro_batch=int_list("micro_batch", micro_batch), recompute=word_list(recompute))
        out_dir = Path(out) if out else DEFAULT_OUT / f"{dims.name}_{gpus}_{Path(str(gpu)).stem}"
        if out_dir.exists() and not out_dir.is_dir():
            raise InputError(f"--out {str(out_dir)!r} is a file; give a folder")
        con = Console(soft_wrap=True)
        from . import provenance

        command = shlex.join(["harness", *(provenance.ARGV or sys.argv[1:])])
        summary = run_search(space, out_dir, top=top, front=front, executor=executor, address=address, jobs=jobs,
                             resume=resume, command=command)
        con.print(f"[bold]harness search[/bold] {dims.name} on {gpus} x {gpu}, global batch "
                  f"{space.global_batch} x {space.seq_len} tokens (SIMULATED)")
        con.print(f"layouts: {summary.enumerated} enumerated, {summary.dropped} dropped by a rule, "
                  f"{summary.unfit} do not fit, {summary.pruned} pruned by their bound, "
                  f"{summary.simulated} simulated, {summary.reused} reused"
                  + (f", {summary.refused} refused by the simulator" if summary.refused else "")
                  + f"; {summary.wall_s:.1f} s")
        for note in summary.notes:
            con.print(f"note: {note}")
        if not summary.rows:
            raise InputError("no layout of this space can run (every one dropped or over memory): see "
                             f"{out_dir / 'layouts.csv'} for each one's reason")
        con.print("best per strategy:")
        for line in side_by_side(summary):
            con.print(line, highlight=False)
        for line in ranked_table(summary, top):
            con.print(line, highlight=False)
        if figure:
            pareto_figure(summary, f"{dims.name}, {gpus} x {gpu}: step time vs memory", out_dir)
        con.print(f"-> {out_dir}/ (results.csv, layouts.csv{', pareto.png' if figure else ''})")


__all__ = ["int_list", "pareto_figure", "pareto_front", "ranked_table", "register", "side_by_side",
           "word_list"]
