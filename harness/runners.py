"""What one sweep row runs: `simulate` (simulator.api), `plan` (dmuon.plan.build_plan) and `measure-kernels`
(orthogonalization variants timed side by side on this machine with harness.cmd_bench_kernels).

A runner has `settings` (accepted keys -> defaults), `kind` (simulated | planned | measured), `parallel`
(measurements run one at a time), `group_key(settings)` (rows with the same key run in one worker, in
order, so they share per-process caches: simulator.costs caches a plan per (workload, gpus, cost, balancer,
method, ...), so adamw / naive / dmuon rows of one point never solve the same MILP twice),
`cost_hint(settings)` (bigger first, for load balance), `lead` (first columns of results.csv), `label(row)`
(progress text) and `run_group(rows, ctx)`: a generator yielding each row with its metrics as it finishes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import fields
from pathlib import Path

from dmuon.errors import choice_error


def _number(v, default: float) -> float:
    """A setting as a float for ordering rows only (bad values are reported when the row runs)."""
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return default


# ---- simulate ------------------------------------------------------------------------------------
_SIM_SKIP = ("plan", "cost")
_SIM_METRICS = (
    "step_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "grad_sync_tail_s",
    "exposed_comm_s",
    "exposed_comm_mean_s",
    "tokens_per_s",
    "comm_bytes_per_rank",
    "muon_comm_bytes_per_rank",
    "muon_comm_volume",
    "ns_makespan_s",
    "ns_busy_max_s",
    "plan_balancer",
    "plan_method",
    "profile",
    "peak_mem_gib",  # simulator.memory: the busiest rank's peak; mem_fits False flags a run that does not fit
    "mem_fits",
)
# settings that cannot change a dmuon plan (rows differing only in these share a worker)
_NOT_PLAN = (
    "strategy",
    "overlap",
    "variant",
    "nic_gbps",
    "overlap_slowdown",
    "hierarchical",
    "seq_len",
    "micro_batch",
    "param_comm_dtype",
    "grad_comm_dtype",
    "naive_ns_method",
    "naive_batching",
    "speed_scale",
    "ns_speed_scale",
    "elementwise_speed_scale",
    "cpu_threads",
    "sp",  # TP / PP settings that leave each stage's plan as it is (simulator.parallel_run)
    "microbatches",
    "recompute",
)


class SimulateRunner:
    name = "simulate"
    kind = "simulated"
    parallel = True
    lead = ("workload", "gpus", "gpu", "strategy", "variant")  # first columns of results.csv

    @property
    def settings(self) -> dict:
        from simulator.api import SimConfig

        return {f.name: f.default for f in fields(SimConfig) if f.name not in _SIM_SKIP}

    def group_key(self, s: dict) -> str:
        return json.dumps({k: v for k, v in sorted(s.items()) if k not in _NOT_PLAN}, default=str)

    def cost_hint(self, s: dict) -> float:
        return _number(s.get("gpus", 8), 8.0) * (4.0 if s.get("strategy") == "naive" else 1.0)

    def label(self, row: dict) -> str:
        return " ".join(
            str(row.get(k)) for k in ("workload", "gpus", "gpu", "strategy", "variant") if row.get(k)
        )

    def run_group(self, group: list[dict], ctx: dict):
        from simulator.api import SimConfig, profile_of, run
        from simulator.costs import load_cost

        names = {f.name for f in fields(SimConfig)} - set(_SIM_SKIP)
        for s in group:
            cfg = SimConfig(**{k: v for k, v in s.items() if k in names})
            traced = _traced(s, ctx.get("traces", ()))
            t0 = time.perf_counter()
            # every rank only where a trace is written; else ranks with identical programs are simulated
            # once (the same result: tests/test_sim_multinode.py; qwen2.5-7b naive, 1024 GPUs: 64 s -> 0.1 s)
            res, built = run(cfg, all_ranks=traced)
            wall = time.perf_counter() - t0
            row = dict(s)
            row.update({k: getattr(res, k) for k in _SIM_METRICS})
            row.update(
                optimizer_published_s=res.optimizer_s - res.grad_sync_tail_s,
                backward_published_s=res.backward_s + res.grad_sync_tail_s,
                nodes=res.settings["nodes"],
                ranks_per_node=res.settings["ranks_per_node"],
                profile_description=res.provenance.get("profile", ""),
                cost_source=load_cost(profile_of(cfg).cost_profiles).name,
                notes="; ".join(dict.fromkeys(res.notes)),
                kind=self.kind,
                sim_wall_s=wall,
            )
            if cfg.model is not None:  # the model's name, so tables and figures group by it
                row["workload"] = res.workload
            if traced:
                row["trace_file"] = _write_trace(built, res, s, Path(ctx["out_dir"]))
            del built  # the programs (~10^7 objects for a MoE at 4096 GPUs) go before the next are built
            yield row


def _traced(s: dict, traces) -> bool:
    return any(all(s.get(k) == v for k, v in t.items()) for t in traces)


def _write_trace(built, res, s: dict, out_dir: Path) -> str:
    """The last simulated step (steady state) as a Chrome trace; returns its path relative to out_dir."""
    from dmuon.io import atomic_write_text as write_text_atomic
    from simulator.trace import trace_events

    tag = "_".join(
        str(s[k]) for k in ("workload", "gpus", "gpu", "strategy", "variant") if s.get(k) is not None
    )
    rel = Path("traces") / f"{tag.replace('/', '-').replace('+', 'p')}.json"
    events = trace_events(built, built.spec.per_node, steps=(built.spec.steps - 1,))
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "workload": res.workload,
            "gpus": res.gpus,
            "strategy": res.strategy,
            "profile": res.profile,
            "step_s": res.step_s,
            "optimizer_s": res.optimizer_s,
            "simulated": True,
            "run_id": s.get("run_id"),
        },
    }
    write_text_atomic(out_dir / rel, json.dumps(doc, separators=(",", ":"), default=str))
    return str(rel)


# ---- plan ----------------------------------------------------------------------------------------
class PlanRunner:
    name = "plan"
    kind = "planned"
    parallel = True
    lead = ("workload", "gpus", "balancer")
    settings = {
        "workload": "qwen2.5-7b",
        "model": None,  # a Hugging Face config.json; replaces workload (simulator.hf_config)
        "gpus": 8,
        "profile": "a800",
        "balancer": "lpt",
        "method": "gram_sym",
        "dtype": "bf16",
        "batching": True,
        "max_batch": 8,
        "bucket_numel": 0,
        "time_limit_s": 10.0,
        "seed": 0,
        "ep": 1,  # expert-parallel degree (dmuon.plan.ep.build_ep_plan; 1 = build_plan)
    }

    def group_key(self, s: dict) -> str:
        return json.dumps({k: v for k, v in sorted(s.items()) if k != "balancer"}, default=str)

    def cost_hint(self, s: dict) -> float:
        return 10.0 if s.get("balancer") == "milp" else _number(s.get("gpus", 8), 8.0) / 256

    def label(self, row: dict) -> str:
        return f"{row.get('workload')} {row.get('gpus')} {row.get('balancer')}"

    def run_group(self, group: list[dict], ctx: dict):
        import warnings

        from dmuon.plan.ep import build_ep_plan
        from simulator.costs import load_cost
        from simulator.workload import resolve_workload

        for s in group:
            cost = load_cost(s["profile"])
            workload = resolve_workload(s["workload"], s.get("model"))
            ep = s.get("ep", 1)  # a bad value: build_ep_plan's one-line error below
            if isinstance(ep, int) and not isinstance(ep, bool) and ep > 1:  # every expert matrix its own
                workload = workload.experts_apart()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                plan = build_ep_plan(
                    workload.muon_matrices,
                    s["gpus"],
                    cost,
                    ep=s.get("ep", 1),
                    balancer=s["balancer"],
                    method=s["method"],
                    dtype=s["dtype"],
                    batching=s["batching"],
                    max_batch=s["max_batch"],
                    bucket_numel=s["bucket_numel"],
                    time_limit_s=s["time_limit_s"],
                    seed=s["seed"],
                )
            loads = plan.loads_s
            row = dict(s)
            row.update(
                makespan_s=plan.makespan_s,
                lower_bound_s=plan.lower_bound_s,
                efficiency=plan.efficiency,
                proven_bound_s=plan.makespan_s * (1 - plan.gap),
                gap=plan.gap,
                solve_time_s=plan.solve_time_s,
                load_mean_s=sum(loads) / len(loads),
                load_min_s=min(loads),
                n_matrices=len(plan.matrices),
                n_batches=len(plan.batches),
                n_buckets=len(plan.buckets),
                loads_s=json.dumps([round(x, 9) for x in loads]),
                cost_source=plan.cost_source,
                profile=s["profile"],
                fallback=any("fell back" in n for n in plan.notes),
                notes="; ".join(plan.notes),
                kind=self.kind,
            )
            if s.get("model") is not None:
                row["workload"] = workload.name
            yield row


# ---- measure-kernels -----------------------------------------------------------------------------
VARIANTS = {  # column -> (method, coefficients)
    "standard_jordan_s": ("standard", "jordan"),
    "gram_jordan_s": ("gram", "jordan"),
    "standard_polar_s": ("standard", "polar_express"),
    "gram_polar_s": ("gram", "polar_express"),
}


class MeasureKernelsRunner:
    name = "measure-kernels"
    kind = "measured"
    parallel = False  # measurements must not share the cores with each other
    lead = ("workload", "matrix")
    settings = {
        "workload": "qwen2.5-7b",
        "matrix": "q_proj",
        "scale": 8,
        "dtype": "fp32",
        "repeats": 3,
        "max_batch": 8,
        "threads": 1,
        "steps": 5,
    }

    def group_key(self, s: dict) -> str:
        return json.dumps(s, sort_keys=True, default=str)

    def cost_hint(self, s: dict) -> float:
        return 1.0

    def label(self, row: dict) -> str:
        return f"{row.get('matrix')} ({row.get('n')}x{row.get('m')})"

    def run_group(self, group: list[dict], ctx: dict):
        for s in group:
            yield measure_kernels(s)


def kernel_shape(workload: str, matrix: str, scale: int) -> tuple[int, int, int]:
    """(n, m, count): the NS shape (min, max) of a Muon matrix of the workload divided by `scale`, and how
    many matrices of that name the workload has."""
    from dmuon.errors import InputError
    from simulator.workload import load_workload

    from .cmd_bench_kernels import _scaled

    ps = [p for p in load_workload(workload).params if p.matrix == matrix and p.optimizer == "muon"]
    if not ps:
        names = sorted({p.matrix for p in load_workload(workload).params if p.optimizer == "muon"})
        raise InputError(f"workload {workload!r} has no Muon matrix {matrix!r}; accepted: {', '.join(names)}")
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise InputError(f"scale must be a positive integer, got {scale!r}")
    p = ps[0]
    return _scaled(min(p.rows, p.cols), scale), _scaled(max(p.rows, p.cols), scale), len(ps)


def measure_kernels(s: dict) -> dict:
    """Every variant of VARIANTS on one matrix, plus a batched call vs a loop (Gram, Jordan), side by side."""
    import torch

    from dmuon import orthogonalize
    from dmuon.errors import InputError
    from dmuon.plan.flops import ns_flops

    from .cmd_bench_kernels import time_side_by_side
    from .provenance import cpu_name

    if s["dtype"] not in ("fp32", "bf16"):
        raise choice_error("dtype (CPU measurement)", s["dtype"], ("fp32", "bf16"))
    for key in ("threads", "repeats", "steps", "max_batch"):
        if isinstance(s[key], bool) or not isinstance(s[key], int) or s[key] < 1:
            raise InputError(f"{key} must be a positive integer, got {s[key]!r}")
    if torch.cuda.is_available():
        device, where = torch.device("cuda"), torch.cuda.get_device_name()
    else:
        device, where = torch.device("cpu"), cpu_name()
        torch.set_num_threads(int(s["threads"]))
    n, m, count = kernel_shape(s["workload"], s["matrix"], s["scale"])
    batch = max(1, min(count, int(s["max_batch"])))
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[s["dtype"]]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((n, m), generator=gen, device=device).to(tdtype)
    stack = torch.randn((batch, n, m), generator=gen, device=device).to(tdtype)
    kw = {"kernels": "torch", "dtype": tdtype, "steps": s["steps"]}
    fns = {
        col: (lambda meth=meth, co=co: orthogonalize(x, method=meth, coefficients=co, **kw))
        for col, (meth, co) in VARIANTS.items()
    }
    fns["loop_s"] = lambda: [orthogonalize(a, method="gram", **kw) for a in stack.unbind(0)]
    fns["batched_s"] = lambda: orthogonalize(stack, method="gram", **kw)
    load0 = os.getloadavg()[0]
    t = time_side_by_side(fns, repeats=s["repeats"], cuda=device.type == "cuda")
    row = dict(s)
    row.update(n=n, m=m, batch=batch, **t)
    row.update(
        gram_speedup_jordan=t["standard_jordan_s"] / t["gram_jordan_s"],
        gram_speedup_polar=t["standard_polar_s"] / t["gram_polar_s"],
        polar_over_jordan_standard=t["standard_polar_s"] / t["standard_jordan_s"],
        batch_speedup=t["loop_s"] / t["batched_s"],
        standard_gflops=ns_flops(n, m, "standard", steps=s["steps"]) / t["standard_jordan_s"] / 1e9,
        gram_gflops=ns_flops(n, m, "gram", steps=s["steps"]) / t["gram_jordan_s"] / 1e9,
        device=f"measured on {where}",
        threads=s["threads"] if device.type == "cpu" else None,
        torch_version=torch.__version__,
        load_1m_before=load0,
        load_1m_after=os.getloadavg()[0],
        profile=f"measured: {where}",
        kind="measured",
    )
    return row


RUNNERS = {r.name: r for r in (SimulateRunner(), PlanRunner(), MeasureKernelsRunner())}


def get_runner(name: str):
    if name not in RUNNERS:
        raise choice_error("runner", name, tuple(RUNNERS))
    return RUNNERS[name]


__all__ = ["RUNNERS", "get_runner", "kernel_shape", "measure_kernels"]
