"""`harness simulate`: one simulated training step per strategy, side by side (SimPy cost model).

Prints forward / backward / optimizer / step time, exposed communication, tokens/s, bytes on the wire
and the NS makespan for adamw, naive and dmuon (or the one `--strategy` names), then the profile and
which inputs were measured, fitted or modelled. The model is `--workload` (catalog, TOML, CSV) or
`--model` (a Hugging Face config.json: simulator.models.hf_config); the hardware `--gpu` (a profile) or
`--cluster` (a cluster file: simulator.fabric.cluster_file), which --gpu, --gpus-per-node and --nic-gbps
override. `--json` prints the same as JSON (one object per
strategy, a list when several). `--trace FILE` writes a Chrome-trace timeline (Perfetto) per strategy
(FILE itself for one strategy, FILE with the strategy before the suffix for several).
"""

from __future__ import annotations

import json
from pathlib import Path

ALL = "all"
_ROWS = (  # (label, SimResult field, scale, unit)
    ("step", "step_s", 1e3, "ms"),
    ("forward", "forward_s", 1e3, "ms"),
    ("backward", "backward_s", 1e3, "ms"),
    ("optimizer", "optimizer_s", 1e3, "ms"),
    ("  of which grad-sync tail", "grad_sync_tail_s", 1e3, "ms"),
    ("exposed comm (max rank)", "exposed_comm_s", 1e3, "ms"),
    ("tokens/s", "tokens_per_s", 1.0, ""),
    ("comm per rank", "comm_bytes_per_rank", 1e-9, "GB"),
    ("  of which Muon", "muon_comm_bytes_per_rank", 1e-9, "GB"),
    ("Muon volume / P", "muon_comm_volume", 1.0, "x"),
    ("NS makespan", "ns_makespan_s", 1e3, "ms"),
    ("peak memory per rank", "peak_mem_gib", 1.0, "GiB"),
    *((f"  {p.replace('_', ' ')}", f"memory.{p}", 1.0 / 2**30, "GiB") for p in (
        "parameters", "gradients", "optimizer", "param_copies", "activations", "comm_buckets", "ns_workspace")),
)


def strategies_of(strategy: str) -> tuple[str, ...]:
    from dmuon.errors import choice_error
    from simulator.programs.step import STRATEGIES

    if strategy == ALL:
        return STRATEGIES
    if strategy not in STRATEGIES:
        raise choice_error("strategy", strategy, (*STRATEGIES, ALL))
    return (strategy,)


def trace_path(base: Path, strategy: str, several: bool) -> Path:
    if not several:
        return base
    return base.with_name(f"{base.stem}.{strategy}{base.suffix or '.json'}")


def gpu_of(gpu: str | None, cluster: str | None):
    """SimConfig's gpu for --gpu / --cluster: the profile name (default a800); with a cluster file its
    own GPU profile, or the --gpu profile given explicitly (loaded here, so that even --gpu a800, the
    default's name, replaces the file's)."""
    from simulator.api import SimConfig
    from simulator.fabric.hardware import load_profile

    if cluster is None:
        return gpu or SimConfig.gpu
    return SimConfig.gpu if gpu is None else load_profile(gpu)


def run_simulations(configs, trace: str | None):
    from simulator.api import run
    from simulator.engine.trace import write_trace

    results = []
    for cfg in configs:
        result, built = run(cfg, all_ranks=bool(trace))  # every rank only where a trace shows them
        if trace:
            path = trace_path(Path(trace), cfg.strategy, len(configs) > 1)
            write_trace(built, path, ranks_per_node=built.spec.per_node,
                        metadata={"config": result.settings, "workload": result.workload,
                                  "profile": result.profile, "strategy": result.strategy})
        del built  # the programs (~10^7 objects for a MoE at 4096 GPUs) go before the next are built
        results.append(result)
    return results


def print_table(results, labels=None, comparison=None) -> None:
    """One column per result (`labels`: their headers, default the strategies); `comparison`: a
    simulator.published_compare.SystemComparison whose mechanisms are printed after the table."""
    from rich.console import Console
    from rich.table import Table

    first = results[0]
    title = (f"{first.workload} on {first.gpus} x {first.profile} ({first.settings['nodes']} node(s) of "
             f"{first.settings['ranks_per_node']}), layout {first.layout}, seq {first.settings['seq_len']} x "
             f"micro-batch {first.settings['micro_batch']} — SIMULATED")
    table = Table(title=title)
    table.add_column("")
    for label in labels or [r.strategy for r in results]:
        table.add_column(label, justify="right")
    for label, attr, scale, unit in _ROWS:
        cells = []
        for r in results:
            v = (r.memory.get(attr[7:], 0.0) if attr.startswith("memory.") else getattr(r, attr)) * scale
            fmt = {"": f"{v:,.0f}", "ms": f"{v:,.1f} ms"}
            cells.append(fmt.get(unit, f"{v:,.2f} {unit}"))
        table.add_row(label, *cells)
    console = Console()
    console.print(table)
    for r in results:
        if not r.mem_fits:
            cap = r.memory.get("capacity_bytes", 0.0) / 2**30
            console.print(f"{r.strategy}: DOES NOT FIT: peak {r.peak_mem_gib:.1f} GiB per rank > {cap:.1f} GiB "
                          f"({r.profile} memory_gib; simulator.models.memory)", highlight=False)
    by = {r.strategy: r for r in results}
    if "naive" in by and "dmuon" in by:
        n, d = by["naive"], by["dmuon"]
        console.print(f"dmuon vs naive: optimizer {n.optimizer_s / d.optimizer_s:.2f}x, "
                      f"step {n.step_s / d.step_s:.2f}x faster")
    if comparison is not None:
        print_comparison(console, comparison)
    elif "adamw" in by and "dmuon" in by:
        console.print(f"dmuon vs adamw: step {by['dmuon'].step_s / by['adamw'].step_s - 1:+.1%}")
    console.print("[bold]inputs[/bold]")
    seen = set()
    for r in results:
        for k, v in r.provenance.items():
            if (k, v) not in seen:
                seen.add((k, v))
                console.print(f"  {k}: {v}", highlight=False, soft_wrap=True)
    for note in dict.fromkeys(n for r in results for n in r.notes):
        console.print(f"  note: {note}", highlight=False, soft_wrap=True)


def print_comparison(console, c) -> None:
    """DMuon over AdamW under both schedules, then what each published mechanism costs at this layout."""
    from rich.table import Table

    ours, pub = c.overhead_pct("ours"), c.overhead_pct("published")
    console.print(f"dmuon vs adamw: ours {ours:+.2f}%, published {pub:+.2f}% (published - ours: "
                  f"{pub - ours:+.2f} points)")
    table = Table(title="what each published mechanism costs: the published step less it with that one off "
                        "(positive: the public code pays it, our schedule saves it; what each models: "
                        "simulator.programs.step_published, docs/simulator.md)")
    for col in ("mechanism", "ms", "points of the AdamW step"):
        table.add_column(col, justify="left" if col == "mechanism" else "right")
    points = c.points()
    for m, sec in c.mechanism_s.items():
        table.add_row(m, f"{sec * 1e3:+,.1f}", f"{points[m]:+.2f}")
    console.print(table)
    parts = sum(points.values())
    console.print(f"sum of the parts {parts:+.2f} points; interaction (published - ours - sum) "
                  f"{pub - ours - parts:+.2f}", highlight=False)


def register(app, bench) -> None:
    import typer

    from .profile_help import gpu_help

    @app.command("simulate")
    def simulate_cmd(
        workload: str = typer.Option(None, help="Catalog workload or a .toml / .csv file (default "
                                                "qwen2.5-7b)."),
        model: str = typer.Option(None, help="A Hugging Face config.json (a path, a folder holding one, or "
                                             "a model in experiments/models/) instead of --workload."),
        per_head: bool = typer.Option(False, "--per-head/--no-per-head",
                                      help="With --model: q / k / v / o cut into one matrix per attention "
                                           "head, as DMuon(model, per_head=True) runs them."),
        cluster: str = typer.Option(None, help="Cluster file: experiments/clusters/<name> or a .toml path "
                                               "(GPU profile, GPUs per node, NVLink, NICs, rails); --gpu, "
                                               "--gpus-per-node, --nic-gbps override it."),
        gpus: int = typer.Option(8, help="Data-parallel ranks (GPUs)."),
        gpus_per_node: int = typer.Option(None, help="Ranks per node (default: the profile's, 8 for GPUs)."),
        gpu: str = typer.Option(None, help=gpu_help()[:-1] + " (default a800, or the --cluster file's)."),
        strategy: str = typer.Option(ALL, help="adamw | naive | dmuon | all (side by side)."),
        layout: str = typer.Option("fsdp-keep", help="fsdp-keep | fsdp-free | hsdp-keep | hsdp-free | ddp | "
                                                     "sharded; several comma separated: one table each."),
        seq_len: int = typer.Option(2048, help="Tokens per sequence."),
        micro_batch: int = typer.Option(2, help="Sequences per GPU per step."),
        gram: bool = typer.Option(True, "--gram/--no-gram", help="dmuon: Gram Newton-Schulz."),
        symmetric_kernels: bool = typer.Option(None, "--symmetric-kernels/--no-symmetric-kernels",
                                               help="dmuon: symmetric (SYRK-style) products (default: "
                                                    "where the device has them: GPUs yes, CPU no)."),
        batching: bool = typer.Option(True, "--batching/--no-batching", help="dmuon: batch same-shape NS."),
        balancer: str = typer.Option("lpt", help="dmuon owner balancer: round_robin | lpt | milp."),
        overlap: bool = typer.Option(True, "--overlap/--no-overlap",
                                     help="dmuon: overlap publication with the next forward."),
        hierarchical: bool = typer.Option(True, "--hierarchical/--no-hierarchical",
                                          help="dmuon: two-level owner exchange across nodes (the "
                                               "runtime's node_size; else flat). FSDP's collectives "
                                               "run as NCCL picks either way."),
        nic_gbps: float = typer.Option(None, help="Inter-node NIC bandwidth per node, Gbit/s (default: "
                                                  "profile; a800: 800 = 4 x 200 Gb/s HDR)."),
        overlap_slowdown: float = typer.Option(None, help="Compute slowdown while communication overlaps it "
                                                          "(e.g. 0.1; default: profile)."),
        bucket_numel: int = typer.Option(0, help="dmuon: elements per bucket (0: one bucket per layer)."),
        max_split: int = typer.Option(1, help="dmuon: largest owner group of one batch (split NS over 2, 4, "
                                              "... ranks where the plan finds it pays; 1 = one owner)."),
        split_exchange: str = typer.Option("lead", help="dmuon, split batches: lead (as the runtime: the "
                                                        "lead scatters / gathers the NS stack) | blocks "
                                                        "(every member holds its column block)."),
        ep: int = typer.Option(1, help="Expert parallelism degree: experts / ep per rank, expert gradients "
                                       "over their gpus / ep replica group, token all-to-alls over ep "
                                       "consecutive ranks (MoE models; 1 = none)."),
        # tensor / sequence / pipeline parallelism (simulator.programs.parallel_run)
        tp: int = typer.Option(1, help="Tensor-parallel degree (inside a node, NVLink; 1 = none)."),
        pp: int = typer.Option(1, help="Pipeline-parallel degree (1F1B; 1 = none)."),
        vpp: int = typer.Option(1, help="Model chunks per pipeline stage (interleaved schedule; 1 = none)."),
        sp: bool = typer.Option(False, "--sp/--no-sp", help="Sequence parallelism (with --tp > 1)."),
        microbatches: int = typer.Option(None, help="Micro-batches per step (default: 1, or 4 x pp)."),
        naive_batching: bool = typer.Option(False, "--naive-batching/--no-naive-batching",
                                            help="naive: one batched NS call per shape (as dmuon.NaiveMuon) "
                                                 "instead of one per matrix."),
        cpu_threads: int = typer.Option(1, help="cpu profile: torch threads per rank."),
        recompute: str = typer.Option("none", help="Activation recomputation (memory model): none | "
                                                   "selective | full."),
        param_dtype: str = typer.Option("fp32", help="Master weights / gradients dtype (memory model): "
                                                     "bf16 | fp16 | fp32."),
        jitter: float = typer.Option(0.0, help="Stragglers: coefficient of variation of every compute op "
                                               "(e.g. 0.03); the step is then the median of 8 sampled steps "
                                               "(p90 printed too)."),
        system: str = typer.Option("ours", help="dmuon's schedule: ours | published (the public "
                                                "implementation's, simulator.programs.step_published) | "
                                                "ours,published (both side by side, with what each "
                                                "published mechanism costs)."),
        published_off: str = typer.Option("", help="--system published: its mechanisms to turn off, comma "
                                                   "separated (simulator.programs.step_published.MECHANISMS)."),
        published_on: str = typer.Option("", help="--system published: opt-in public modes, comma separated "
                                                  "(sync_publish, prefetch_wait)."),
        bands: bool = typer.Option(False, "--bands/--no-bands",
                                   help="Error band of the step time over the profile's uncertain inputs "
                                        "(NIC, efficiency, SM share, overlap penalty, compute fit)."),
        trace: str = typer.Option(None, help="Write a Chrome-trace JSON (open in Perfetto) to this file."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ):
        """Simulate one training step (steady state) of WORKLOAD on GPUS ranks; all strategies by default."""
        from dmuon.errors import InputError
        from simulator.api import SimConfig

        if trace and not Path(trace).parent.is_dir():
            raise InputError(f"trace directory {str(Path(trace).parent)!r} does not exist")
        if workload is not None and model is not None:
            raise InputError("give --workload or --model, not both")
        workload = workload or SimConfig.workload
        hardware = gpu_of(gpu, cluster)
        layouts, systems = split_list(layout, "layout"), split_list(system, "system")
        compare = len(systems) > 1
        if compare and sorted(systems) != ["ours", "published"]:
            raise InputError(f"--system: {system!r}; accepted: ours, published, or ours,published (both side "
                             "by side)")
        if trace and (compare or len(layouts) > 1):
            raise InputError("--trace writes one layout of one system; accepted: one --layout and one "
                             "--system")
        strategies = strategies_of(strategy)
        if compare and "dmuon" not in strategies:
            raise InputError("--system ours,published compares dmuon's two schedules; accepted: --strategy "
                             "dmuon or all")
        def system_of(s: str) -> str:  # ours,published: dmuon runs published here, ours in compare_systems
            return ("published" if s == "dmuon" else "ours") if compare else systems[0]

        off = tuple(x for x in published_off.split(",") if x)
        on = tuple(x for x in published_on.split(",") if x)
        outputs = []
        for lay in layouts:
            configs = [
                SimConfig(workload=workload, model=model, per_head=per_head, cluster=cluster, gpus=gpus,
                          gpus_per_node=gpus_per_node, gpu=hardware, strategy=s,
                          layout=lay, seq_len=seq_len, micro_batch=micro_batch, gram=gram,
                          symmetric_kernels=symmetric_kernels, batching=batching, balancer=balancer,
                          overlap=overlap, hierarchical=hierarchical, nic_gbps=nic_gbps,
                          overlap_slowdown=overlap_slowdown, naive_batching=naive_batching,
                          cpu_threads=cpu_threads, bucket_numel=bucket_numel, max_split=max_split,
                          split_exchange=split_exchange, ep=ep, tp=tp, pp=pp, vpp=vpp, sp=sp,
                          microbatches=microbatches, recompute=recompute, param_dtype=param_dtype,
                          jitter=jitter, system=system_of(s),
                          published_off=off if system_of(s) == "published" else (),
                          published_on=on if system_of(s) == "published" else ())
                for s in strategies
            ]
            outputs.append(_simulate_layout(configs, trace, compare, bands))
        if json_out:
            out = [o["json"] for o in outputs]
            if not compare:
                out = [r for o in out for r in o]
            print(json.dumps(out[0] if len(out) == 1 else out, indent=1, default=str))
            return
        for o in outputs:
            print_table(o["results"], o["labels"], o["comparison"])
            for label, r in zip(o["labels"], o["results"], strict=True):
                if jitter > 0:
                    print(f"{label}: step p50 {r.step_s * 1e3:.1f} ms, p90 {r.step_p90_s * 1e3:.1f} ms "
                          f"(jitter {jitter:g})")
                if o["band"]:
                    b = o["band"][label]
                    print(f"{label}: step {b['base'] * 1e3:.1f} ms, band {b['low'] * 1e3:.1f} .. "
                          f"{b['high'] * 1e3:.1f} ms over {', '.join(b['inputs'])} (simulator.calibration.bands)")


def split_list(value: str, what: str) -> list[str]:
    """A comma-separated option's items, in order; an empty item or a repeat is an error."""
    from dmuon.errors import InputError

    items = [x.strip() for x in value.split(",")]
    if any(not x for x in items) or len(set(items)) != len(items):
        raise InputError(f"--{what}: {value!r} is not a comma-separated list of distinct names")
    return items


def _simulate_layout(configs, trace, compare: bool, bands: bool) -> dict:
    """One layout's results: every strategy under the first system or, with `compare`, dmuon under both
    schedules (simulator.published_compare) beside the others. Returns the results, their column
    labels, the comparison, the error bands by label and the JSON to print."""
    from dataclasses import replace

    comparison, band = None, {}
    if not compare:
        results = run_simulations(configs, trace)
        labels = [r.strategy for r in results]
        band_cfgs = configs
    else:
        from simulator.published_compare import compare_systems

        others = [c for c in configs if c.strategy != "dmuon"]
        results = run_simulations(others, None)
        adamw = next((r for r in results if r.strategy == "adamw"), None)
        dmuon = next(c for c in configs if c.strategy == "dmuon")
        comparison = compare_systems(dmuon, adamw)
        results += [comparison.ours, comparison.published]
        labels = [r.strategy for r in results[:-2]] + ["dmuon ours", "dmuon published"]
        band_cfgs = others + [replace(dmuon, system="ours", published_off=(), published_on=()), dmuon]
    if bands:
        from simulator.calibration.bands import bands as band_of

        band = {label: band_of(c) for label, c in zip(labels, band_cfgs, strict=True)}
    rows = [{**r.to_dict(), **({"label": label} if compare else {}),
             **({"step_band_s": [band[label]["low"], band[label]["high"]]} if band else {})}
            for label, r in zip(labels, results, strict=True)]
    out = rows
    if compare:
        out = {"layout": configs[0].layout, "results": rows,
               "overhead_pct": {s: comparison.overhead_pct(s) for s in ("ours", "published")},
               "mechanism_s": comparison.mechanism_s, "mechanism_points": comparison.points()}
    return {"results": results, "labels": labels, "comparison": comparison, "band": band, "json": out}
