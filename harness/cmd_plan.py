"""`harness plan` (owners, batches, buckets of a workload on N ranks); `harness profile` is cmd_profile's.

  harness plan --workload qwen2.5-7b --ranks 64 --balancer milp [--profile a800] [--json] [--out plan.json]
  harness plan --compare [--workload a,b] [--ranks 8,16] [--json]   round-robin / LPT / MILP side by side
  harness plan ... --max-split 8 [--links dmuon|simulator]   owner groups: a batch split over <= 8 ranks

Heavy imports (pulp/highspy for the MILP) happen inside the commands.
"""

from __future__ import annotations

import json
import sys
from functools import partial

DEFAULT_COMPARE_WORKLOADS = ("qwen2.5-7b", "pi0", "wall-oss", "wall-wm")
DEFAULT_COMPARE_RANKS = (8, 16, 32, 64, 128, 256)


def _csv_list(text: str | None, what: str, convert=str) -> list:
    from dmuon.errors import InputError

    if text is None:
        return []
    if not str(text).replace(",", "").strip():
        raise InputError(f"{what}: {text!r} names nothing; give a comma-separated list (or leave it out)")
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(convert(part))
        except ValueError:
            raise InputError(
                f"{what}: {part!r} is not a valid {convert.__name__}; give a comma-separated list"
            ) from None
    return out


def _fraction(text: str) -> float:
    """'0.0625' or '1/16' (a positive finite number)."""
    from dmuon.errors import InputError

    try:
        if "/" in text:
            num, den = text.split("/", 1)
            value = float(num) / float(den)
        else:
            value = float(text)
    except (ValueError, ZeroDivisionError):
        value = float("nan")
    if not 0 < value < float("inf"):
        raise InputError(f"--scale {text!r} is not a positive number; accepted: e.g. 0.0625 or 1/16")
    return value


def load_matrices(workload: str, scale: float | None = None, blocks: int | None = None,
                  per_head: bool = False):
    from simulator.workload import load_workload

    if per_head:  # a Hugging Face model's attention matrices cut per head (dmuon.params.decide)
        from simulator.hf_config import load_model

        wl = load_model(workload, per_head=True)
    else:
        wl = load_workload(workload)
    if scale is not None or blocks is not None:
        wl = wl.scaled(scale if scale is not None else 1.0, blocks)
    return wl


def plan_summary(plan, workload: str) -> dict:
    """The JSON view of a plan (see `harness plan --json`)."""
    mk = plan.makespan_s
    return {
        "workload": workload,
        "ranks": plan.world_size,
        "balancer": plan.balancer,
        "profile": plan.cost_source,
        "method": plan.method,
        "dtype": plan.dtype,
        "matrices": len(plan.matrices),
        "batches": len(plan.batches),
        "buckets": len(plan.buckets),
        "makespan_s": mk,
        "lower_bound_s": plan.lower_bound_s,
        "proven_bound_s": mk * (1 - plan.gap),
        "efficiency": plan.efficiency,
        "gap": plan.gap,
        "solve_time_s": plan.solve_time_s,
        "loads_s": list(plan.loads_s),
        "assignment": [
            {"matrix": m.name, "owner": o, **({"count": m.count} if m.count > 1 else {})}
            for m, o in zip(plan.matrices, plan.owners, strict=True)
        ],
        "notes": list(plan.notes),
    } | (split_fields(plan) if plan.max_split > 1 else {})


def split_fields(plan) -> dict:
    from .plan_split import summary_fields

    return summary_fields(plan)


def _rank_rows(plan) -> list[tuple]:
    rows = []
    for r, load in enumerate(plan.loads_s):
        bs = plan.batches_of(r)
        sizes = sorted((b.size for b in bs), reverse=True)
        state = sum(plan.matrices[i].numel for i in plan.owned_by(r)) * 8
        rows.append((r, load, len(plan.owned_by(r)), len(bs), sizes, state))
    return rows


def print_plan(plan, workload: str) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    rows = _rank_rows(plan)
    shown = rows if len(rows) <= 32 else sorted(rows, key=lambda x: (-x[1], x[0]))[:16]
    t = Table(
        title=f"{workload}: {len(plan.matrices)} Muon matrices on {plan.world_size} ranks, "
        f"{plan.balancer}, {plan.method} {plan.dtype}, profile {plan.cost_source}"
        + ("" if shown is rows else " (16 most loaded ranks)")
    )
    for col in ("rank", "load ms", "matrices", "batches", "batch sizes", "owned state MB"):
        t.add_column(col, justify="left" if col == "batch sizes" else "right")
    for r, load, nm, nb, sizes, state in shown:
        t.add_row(
            str(r),
            f"{load * 1e3:.3f}",
            str(nm),
            str(nb),
            " ".join(map(str, sizes)) or "-",
            f"{state / 1e6:.1f}",
        )
    con.print(t)
    con.print(
        f"makespan {plan.makespan_s * 1e3:.3f} ms   lower bound {plan.lower_bound_s * 1e3:.3f} ms   "
        f"efficiency {plan.efficiency:.3f}   proven gap {plan.gap:.2%}   solve {plan.solve_time_s:.2f} s   "
        f"buckets {len(plan.buckets)}"
    )
    from .plan_split import print_groups

    print_groups(plan, con)
    for n in plan.notes:
        con.print(f"note: {n}")


def compare_rows(
    workloads, ranks_list, profile: str, method: str, dtype: str, time_limit_s: float, progress=None,
    max_split: int = 1, links=None,
) -> list[dict]:
    """Round-robin, LPT and MILP makespans side by side for every (workload, N); with max_split > 1 the
    balancers may split (round-robin never does), the bound is split-aware and the MILP without splits
    is added (`plan_split.nosplit_fields`)."""
    import warnings

    from dmuon.plan.build import build_plan
    from dmuon.plan.cost import CostTable

    cost = CostTable.load(profile)
    if dtype is None:
        dtype = "bf16" if "bf16" in cost.dtypes or not cost.dtypes else cost.dtypes[0]
    rows = []
    for wl in workloads:
        mats = load_matrices(wl).muon_matrices
        for n in ranks_list:
            plans = {}
            for bal in ("round_robin", "lpt", "milp"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    plans[bal] = build_plan(
                        mats, n, cost, balancer=bal, method=method, dtype=dtype, time_limit_s=time_limit_s,
                        max_split=max_split, links=links,
                    )
                    if bal == "milp" and max_split > 1:
                        nosplit = build_plan(mats, n, cost, balancer=bal, method=method, dtype=dtype,
                                             time_limit_s=time_limit_s)
            milp = plans["milp"]
            bound = milp.makespan_s * (1 - milp.gap)
            row = {
                "workload": wl,
                "ranks": n,
                "lower_bound_s": milp.lower_bound_s,
                "proven_bound_s": bound,
                "lb_reachable": "no"
                if bound > milp.lower_bound_s * (1 + 1e-6)
                else ("yes" if milp.gap <= 1e-3 else "unknown"),
            }
            for bal, p in plans.items():
                row[f"{bal}_makespan_s"] = p.makespan_s
                row[f"{bal}_efficiency"] = p.efficiency
                row[f"{bal}_solve_s"] = p.solve_time_s
            row["milp_gap"] = milp.gap
            row["milp_vs_lpt"] = milp.makespan_s / plans["lpt"].makespan_s
            row["fallback"] = any("fell back" in x for x in milp.notes)
            if max_split > 1:
                from .plan_split import nosplit_fields

                row |= nosplit_fields(milp, nosplit)
            rows.append(row)
            if progress:
                progress(row)
    return rows


def print_compare(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = (
        "workload",
        "N",
        "LB ms",
        "proven ms",
        "LB reachable",
        "RR ms",
        "LPT ms",
        "MILP ms",
        "eff RR",
        "eff LPT",
        "eff MILP",
        "MILP gap",
        "MILP/LPT",
        "LPT s",
        "MILP s",
    ) + (("MILP k=1 ms", "splits", "k=1 / split") if "milp_nosplit_makespan_s" in (rows or [{}])[0] else ())
    for c in cols:
        t.add_column(c, justify="left" if c in ("workload", "LB reachable") else "right")
    for r in rows:
        t.add_row(
            r["workload"],
            str(r["ranks"]),
            f"{r['lower_bound_s'] * 1e3:.3f}",
            f"{r['proven_bound_s'] * 1e3:.3f}",
            r["lb_reachable"],
            f"{r['round_robin_makespan_s'] * 1e3:.3f}",
            f"{r['lpt_makespan_s'] * 1e3:.3f}",
            f"{r['milp_makespan_s'] * 1e3:.3f}",
            f"{r['round_robin_efficiency']:.3f}",
            f"{r['lpt_efficiency']:.3f}",
            f"{r['milp_efficiency']:.3f}",
            f"{r['milp_gap']:.2%}",
            f"{r['milp_vs_lpt']:.4f}",
            f"{r['lpt_solve_s']:.2f}",
            f"{r['milp_solve_s']:.2f}",
            *((f"{r['milp_nosplit_makespan_s'] * 1e3:.3f}", str(r["milp_split_batches"]),
               f"{r['split_speedup']:.3f}") if "milp_nosplit_makespan_s" in r else ()),
        )
    Console().print(t)
    print(
        "efficiency = lower bound / makespan, lower bound = max(work/N, largest call, pigeonhole terms; "
        "with splits the split-aware area bound); "
        "proven = the MILP's proven bound on the optimum (configuration LP / solver); 'LB reachable: no' = "
        "the proven bound exceeds the lower bound, so no plan reaches it."
    )


SIM_DEFAULTS = "fsdp-keep, seq 2048 x micro-batch 2"  # simulator.api.SimConfig's defaults, as plan_memory uses


def plan_memory(workload, plan, profile: str, ep: int = 1):
    """simulator.memory of the plan's owners: DMuon, layout fsdp-keep, the SimConfig defaults' sequence
    and micro-batch, on the simulator profile named `profile` (None where there is none)."""
    from simulator.api import SimConfig, memory_of
    from simulator.hardware import PROFILE_DIR

    profile = profile.removesuffix("-roofline")  # a GPU's datasheet roofline: that GPU's simulator profile
    if not (PROFILE_DIR / f"{profile}.toml").is_file():
        return None
    n = plan.world_size
    per_node = None if profile == "cpu" or n <= 8 or n % 8 == 0 else n  # else one node of all ranks
    return memory_of(SimConfig(workload=workload, gpus=n, gpu=profile, strategy="dmuon", ep=ep,
                               gpus_per_node=per_node), plan)


def register(app, bench) -> None:
    import typer

    from dmuon.plan.balance import PLAN_METHODS
    from dmuon.plan.build import BALANCERS

    from .options import option_command

    # the planner calls --ranks world_size, --time-limit time_limit_s, --scale width_scale
    @app.command("plan", cls=option_command(world_size="ranks", time_limit_s="time_limit",
                                             width_scale="scale"))
    def plan_cmd(
        workload: str = typer.Option(None, help="Catalog name or .toml/.csv file (--compare: comma list)."),
        model: str = typer.Option(None, help="A Hugging Face config.json (path, folder or a model in "
                                             "experiments/models/) instead of --workload."),
        per_head: bool = typer.Option(False, "--per-head/--no-per-head",
                                      help="With --model: attention matrices cut per head "
                                           "(DMuon(model, per_head=True))."),
        ranks: str = typer.Option(None, help="Number of ranks N (--compare: comma list)."),
        balancer: str = typer.Option("lpt", help=" | ".join(BALANCERS)),
        profile: str = typer.Option(
            "a800", help="Cost profile: a800 | h200 | cpu | h100 | <gpu>-roofline | path to a profile CSV."
        ),
        method: str = typer.Option(
            "gram_sym", help=" | ".join(PLAN_METHODS) + " (auto = cheapest per batch)."
        ),
        dtype: str = typer.Option(
            None, help="bf16 | fp16 | fp32 (default: bf16, or the profile's only dtype)."
        ),
        no_batching: bool = typer.Option(False, "--no-batching", help="Every matrix is its own NS call."),
        max_batch: int = typer.Option(8, help="Largest batch of same-shape matrices."),
        bucket_numel: int = typer.Option(
            0,
            help="0 = one communication bucket per layer; else merge "
            "consecutive layers up to this many elements.",
        ),
        memory_cap_gb: float = typer.Option(
            None, help="Per-rank cap on owned state (fp32 momentum + fp32 copy = 8 bytes per element), GB."
        ),
        anti_affinity: bool = typer.Option(
            False, "--anti-affinity", help="A layer's matrices go to different owners where possible."
        ),
        time_limit: float = typer.Option(
            10.0, help="MILP wall-clock safety net, seconds (its phases stop at work limits first)."
        ),
        scale: float = typer.Option(None, help="Plan the workload scaled by this width factor (CPU models)."),
        blocks: int = typer.Option(None, help="Keep only this many repeated blocks per component."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
        out: str = typer.Option(None, help="Write the full plan (Plan.to_json) to this file."),
        compare: bool = typer.Option(
            False,
            "--compare",
            help="Round-robin / LPT / MILP side by side for several workloads and rank counts.",
        ),
        max_split: int = typer.Option(
            1, help="Largest owner group of one batch (split NS over 2, 4, ... ranks); 1 = one owner."
        ),
        links: str = typer.Option(
            "dmuon", help="Collectives pricing the splits: dmuon (alpha-beta, collectives.md) | simulator "
            "(the simulator profile's network)."
        ),
        ep: int = typer.Option(
            1, help="Expert-parallel degree: expert matrices owned in their EP rank's replica group "
            "(dmuon.plan.ep); 1 = none."
        ),
        tp: int = typer.Option(1, help="Tensor-parallel degree: plan each stage's TP shards over its DP "
                                       "ranks, --ranks / (tp x pp) (harness.plan_parallel); 1 = none."),
        pp: int = typer.Option(1, help="Pipeline-parallel degree: one plan per distinct stage; 1 = none."),
        vpp: int = typer.Option(1, help="Model chunks per pipeline stage (interleaved); 1 = none."),
    ):
        """Owners, batches and buckets of a workload's Muon matrices on N ranks (per-rank loads)."""
        from dmuon.errors import InputError

        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise InputError(f"--ep must be a positive integer (1 = no expert parallelism), got {ep!r}")
        if compare and ep != 1:
            raise InputError("--compare does not take --ep; accepted: --ep with a single --ranks")
        if compare:
            wls = (_csv_list(workload, "--workload") + _csv_list(model, "--model")
                   or list(DEFAULT_COMPARE_WORKLOADS))
            ns = _csv_list(ranks, "--ranks", int) or list(DEFAULT_COMPARE_RANKS)
            if any(n < 1 for n in ns):
                raise InputError(f"--ranks must be positive integers, got {ns}")

            def progress(r):
                if not json_out:
                    print(
                        f"  {r['workload']} N={r['ranks']}: MILP {r['milp_makespan_s'] * 1e3:.3f} ms "
                        f"({r['milp_solve_s']:.1f} s)",
                        file=sys.stderr,
                    )

            from .plan_split import resolve_links

            rows = compare_rows(wls, ns, profile, method, dtype, time_limit, progress, max_split,
                                resolve_links(links, profile))
            if json_out:
                print(json.dumps(rows, indent=1))
            else:
                print_compare(
                    rows, f"NS makespan per balancer, profile {profile}, {method} {dtype or 'bf16'}"
                )
            return
        if workload is not None and model is not None:
            raise InputError("give --workload or --model, not both")
        if per_head and model is None:
            raise InputError("--per-head cuts a Hugging Face model's attention matrices; accepted: "
                             "--per-head with --model")
        workload = model or workload
        if workload is None or ranks is None:
            raise InputError("harness plan needs --workload (or --model) and --ranks (or --compare)")
        try:
            n = int(ranks)
        except ValueError:
            raise InputError(f"--ranks must be a positive integer, got {ranks!r}") from None
        from dmuon.io import atomic_write_text
        from dmuon.plan.build import build_plan
        from dmuon.plan.cost import CostTable

        from .plan_split import resolve_links

        if memory_cap_gb is not None and not 0 < memory_cap_gb < float("inf"):
            raise InputError(f"--memory-cap-gb must be a positive number of GB (or left out), "
                             f"got {memory_cap_gb!r}")
        wl = load_matrices(workload, scale, blocks, per_head)
        wl_all = wl  # before experts_apart: the memory model applies it itself
        cap = None if memory_cap_gb is None else memory_cap_gb * 1e9
        cost = CostTable.load(profile)
        if dtype is None:
            dtype = "bf16" if "bf16" in cost.dtypes or not cost.dtypes else cost.dtypes[0]
        if ep != 1:
            from dmuon.plan.ep import build_ep_plan

            wl = wl.experts_apart()  # each expert matrix placed on its EP rank (dmuon.plan.ep)

            if max_split != 1 or cap is not None or anti_affinity:
                raise InputError("--ep does not combine with --max-split, --memory-cap-gb or --anti-affinity")
            plan_fn = partial(build_ep_plan, ep=ep)
        else:
            plan_fn = partial(build_plan, memory_cap_bytes=cap, anti_affinity=anti_affinity,
                              max_split=max_split, links=resolve_links(links, profile))
        if (tp, pp, vpp) != (1, 1, 1):  # one plan per distinct pipeline stage (harness.plan_parallel)
            from .plan_parallel import print_stage_plans, stage_plans

            if ep != 1 or out:
                raise InputError("--tp / --pp / --vpp do not combine with --ep or --out; accepted: them alone")
            plans = stage_plans(wl, model, n, tp, pp, vpp, profile, cost, partial(
                plan_fn, balancer=balancer, method=method, dtype=dtype, batching=not no_batching,
                max_batch=max_batch, bucket_numel=bucket_numel, time_limit_s=time_limit))
            print_stage_plans(plans, json_out, tp, pp, plan_summary, print_plan)
            return
        plan = plan_fn(
            wl.muon_matrices,
            n,
            cost,
            balancer=balancer,
            method=method,
            dtype=dtype,
            batching=not no_batching,
            max_batch=max_batch,
            bucket_numel=bucket_numel,
            time_limit_s=time_limit,
        )
        if out:
            atomic_write_text(out, plan.to_json(indent=1))
        mem = plan_memory(wl_all, plan, profile, ep)
        if json_out:
            print(json.dumps({**plan_summary(plan, wl.name), "memory": mem and mem.to_dict()}, indent=1))
        else:
            print_plan(plan, wl.name)
            print(f"simulator.memory of this plan (dmuon, layout {SIM_DEFAULTS}, on {profile}):\n"
                  + mem.table() if mem else f"memory: {profile!r} is no simulator profile (simulator/profiles/); "
                  "the memory model needs one")
            for note in wl.notes:
                print(f"workload note: {note}")
