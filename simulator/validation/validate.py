"""Validation of the simulator: the published 8 x A800 table, the paper's headline ranges, the closed
loop against real CPU runs, and the simulator's own speed. Every function returns rows (dicts) so
`harness validate` can print or save them; `python -m simulator.validation.validate` prints them all.

1. `published_rows()`  every (workload, method, metric) of reported.csv table a800_8gpu_llm next to the
   simulation of the same setting (a800 profile, 8 GPUs, bf16, seq 2048, micro-batch 2; FSDP2+* and
   DMuon = fsdp-keep, DDP+Muon = naive on ddp). Published convention: FSDP2's backward() returns after
   its gradient reduce-scatters, so the simulated grad-sync tail moves from optimizer to backward
   (`backward = backward_s + grad_sync_tail_s`, `optimizer = optimizer_s - grad_sync_tail_s`).
   `in_sample` marks numbers the inputs were fitted to: AdamW forward / backward / step of the fit models
   (simulator.calibration.calibrate_a800), and every AdamW optimizer row (the a800 cost table's adamw points are
   those rows).
2. `headline_rows()` DMuon vs naive vs AdamW on the paper's workloads over 8..256 A800s, and
   `headline_summary()` the ranges next to the paper's claims (reported.csv paper_claims).
3. `closed_loop(row)` one measured CPU bench row -> the same run simulated with the cpu profile.
4. `speed_rows()` wall seconds of the simulator itself.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from dmuon.errors import InputError

from .reference import LLM_GPUS, LLM_MICRO_BATCH, LLM_SEQ_LEN, claims, llm_rows

TOLERANCE = 0.25
HEADLINE_WORKLOADS = ("qwen2.5-7b", "pi0", "wall-oss", "wall-wm")
HEADLINE_GPUS = (8, 16, 32, 64, 128, 256)
STRATEGIES = ("adamw", "naive", "dmuon")


def _published_convention(r) -> dict[str, float]:
    return {"forward": r.forward_s, "backward": r.backward_s + r.grad_sync_tail_s,
            "optimizer": r.optimizer_s - r.grad_sync_tail_s, "step": r.step_s}


def published_rows(gpu: str = "a800") -> list[dict]:
    from simulator.api import SimConfig, simulate
    from simulator.calibration.calibrate_a800 import FIT_MODELS

    out = []
    for row in sorted(llm_rows(), key=lambda r: (r.workload, r.method)):
        sim = simulate(SimConfig(workload=row.workload, gpus=LLM_GPUS, gpu=gpu, strategy=row.strategy,
                                 layout=row.layout, seq_len=LLM_SEQ_LEN, micro_batch=LLM_MICRO_BATCH))
        conv = _published_convention(sim)
        for metric in ("forward", "backward", "optimizer", "step"):
            pub = getattr(row, f"{metric}_s")
            in_sample = row.strategy == "adamw" and (
                metric == "optimizer" or row.workload in FIT_MODELS)
            err = conv[metric] / pub - 1
            out.append({"workload": row.workload, "method": row.method, "strategy": row.strategy,
                        "layout": row.layout, "metric": metric, "published_ms": pub * 1e3,
                        "simulated_ms": conv[metric] * 1e3, "error": err,
                        "within_25pct": abs(err) <= TOLERANCE,
                        "in_sample": in_sample, "profile": sim.profile})
    return out


def headline_rows(workloads=HEADLINE_WORKLOADS, gpus=HEADLINE_GPUS, gpu: str = "a800") -> list[dict]:
    from simulator.api import SimConfig, simulate

    out = []
    for w in workloads:
        for n in gpus:
            res = {s: simulate(SimConfig(workload=w, gpus=n, gpu=gpu, strategy=s)) for s in STRATEGIES}
            a, nv, d = res["adamw"], res["naive"], res["dmuon"]
            pa, pn, pd = (_published_convention(x) for x in (a, nv, d))
            out.append({
                "workload": w, "gpus": n, "profile": d.profile,
                "adamw_step_ms": a.step_s * 1e3, "naive_step_ms": nv.step_s * 1e3,
                "dmuon_step_ms": d.step_s * 1e3,
                "naive_optimizer_ms": nv.optimizer_s * 1e3, "dmuon_optimizer_ms": d.optimizer_s * 1e3,
                "optimizer_speedup": nv.optimizer_s / d.optimizer_s,
                "optimizer_speedup_published_convention": pn["optimizer"] / pd["optimizer"],
                "step_speedup": nv.step_s / d.step_s,
                "dmuon_over_adamw": d.step_s / a.step_s - 1,
                "naive_optimizer_over_fwd_bwd": nv.optimizer_s / (nv.forward_s + nv.backward_s),
                "dmuon_ns_makespan_ms": d.ns_makespan_s * 1e3,
                "notes": "; ".join(d.notes),
            })
    return out


def headline_summary(rows: list[dict]) -> list[dict]:
    """Ranges over `rows` next to the paper's claims."""
    c = claims()
    opt = [r["optimizer_speedup"] for r in rows]
    opt_pub = [r["optimizer_speedup_published_convention"] for r in rows]
    step = [r["step_speedup"] for r in rows]
    over = [r["dmuon_over_adamw"] for r in rows]
    naive_ratio = [r["naive_optimizer_over_fwd_bwd"] for r in rows]
    def row(quantity, simulated, paper, published_convention=None):
        return {"quantity": quantity, "simulated": simulated,
                "simulated_published_convention": published_convention, "paper": paper}

    return [
        row("optimizer speedup dmuon/naive, min", min(opt), c.get("optimizer_speedup_min"), min(opt_pub)),
        row("optimizer speedup dmuon/naive, max", max(opt), c.get("optimizer_speedup_max"), max(opt_pub)),
        row("step speedup dmuon/naive, min", min(step), c.get("step_speedup_min")),
        row("step speedup dmuon/naive, max", max(step), c.get("step_speedup_max")),
        row("dmuon step overhead over adamw, mean %", 100 * statistics.mean(over),
            c.get("step_overhead_mean")),
        row("naive optimizer / (fwd + bwd), min", min(naive_ratio), c.get("optimizer_over_fwd_bwd_min")),
    ]


@dataclass(frozen=True)
class BenchRow:
    """One measured CPU run of `harness bench step` (the Runtime's benchmark)."""

    ranks: int
    strategy: str  # adamw | naive | dmuon
    width_scale: float  # load_workload(workload).scaled(width_scale, blocks)
    blocks: int | None
    seq_len: int
    micro_batch: int
    step_s: float  # measured
    optimizer_s: float | None = None  # measured: end of backward -> step() returned (the bench's)
    workload: str = "qwen2.5-7b"
    layout: str = "ddp"
    gpu: str = "cpu"
    threads: int = 1  # torch threads per rank
    probe_s: float | None = None  # the speed probe: the model's forward + backward before the run
    probe_ns_s: float | None = None  # the NS probe: ns_probe_call(workload) timed before the run
    probe_ew_s: float | None = None  # the elementwise probe: one adamw pass over EW_PROBE_NUMEL elements

    def model(self):
        """The run's model as a workload: `workload` scaled to `width_scale` with `blocks` blocks."""
        from simulator.models.workload import load_workload

        return load_workload(self.workload).scaled(self.width_scale, self.blocks)

    @classmethod
    def from_bench(cls, row: dict) -> BenchRow:
        """From one row of `harness bench step --json` (keys ranks, strategy, width_scale, layers, ...)."""
        return cls(ranks=row["ranks"], strategy=row["strategy"], width_scale=row["width_scale"],
                   blocks=row.get("layers"), seq_len=row["seq_len"], micro_batch=row["micro_batch"],
                   step_s=row["step_s"], optimizer_s=row.get("optimizer_s"),
                   workload=row.get("workload", "qwen2.5-7b"), threads=row.get("threads_per_rank", 1),
                   probe_s=row.get("probe_s"), probe_ns_s=row.get("probe_ns_s"),
                   probe_ew_s=row.get("probe_ew_s"))


def speed_scale_of(row: BenchRow, profile) -> tuple[float, str]:
    """(the machine's speed during the run relative to the profile's compute model, how it was found): the
    run's speed probe (`harness bench step --speed-probe`: forward + backward of the run's model on every
    rank at once, before each block, no optimizer and no communication) over what the profile predicts
    for that same work (simulator.models.compute.layer_times at the run's ranks x threads); 1 without a probe."""
    from simulator.models.compute import layer_times

    if _probe_missing(row.probe_s):
        return 1.0, "no speed probe in the run: the profile's speed"
    w = row.model()
    times = layer_times(w, profile, row.seq_len, row.micro_batch, row.ranks, row.threads)
    model = sum(f + b for f, b in times)
    k = row.probe_s / model
    return k, (f"speed probe {row.probe_s * 1e3:.4g} ms vs {model * 1e3:.4g} ms in the profile's compute "
               f"model: x{k:.3f}")


def ns_probe_call(workload) -> tuple[int, int, int, str]:
    """(batch, rows, cols, method) of the NS call the bench's speed probe times (`harness bench step
    --speed-probe`, column probe_ns_s): the Muon shape that holds the most elements, stacked min(2, its
    count) deep, in the method NSConfig(method="auto") gives it, i.e. a call the runtime makes."""
    from dmuon.newton_schulz import resolve_method

    totals: dict[tuple[int, int], list[int]] = {}
    for m in workload.muon_matrices:
        totals.setdefault((m.rows, m.cols), []).append(m.numel)
    if not totals:
        raise InputError(f"workload {workload.name} has no Muon matrices: there is no NS call to probe")
    (rows, cols), sizes = max(totals.items(), key=lambda kv: (sum(kv[1]), kv[0]))
    return min(2, len(sizes)), rows, cols, resolve_method(rows, cols, "auto")


def _probe_missing(v) -> bool:
    return v is None or v != v or not v > 0


EW_PROBE_OP, EW_PROBE_NUMEL = "adamw", 1 << 22  # the elementwise probe: a pass the cost table measured


def _table_probe_scale(row: BenchRow, profile, kind: str, probe_s, call: str,
                       price) -> tuple[float | None, str]:
    """(probe_s / (price(cost table at the run's threads) x the profile's `kind` contention at the run's
    ranks x threads), how); None without a probe."""
    from simulator.api import SimConfig
    from simulator.costs import load_cost, thread_cost_for

    if _probe_missing(probe_s):
        return None, f"no {kind} probe in the run: {kind} follows the compute probe"
    w = row.model()
    thread_cost = thread_cost_for(profile, SimConfig(workload=w, gpus=row.ranks, gpu=row.gpu,
                                                     cpu_threads=row.threads))
    table = thread_cost or load_cost(profile.cost_profiles)
    priced = price(table) * profile.contention(row.ranks, row.threads, kind,
                                               threads_measured=thread_cost is not None)
    k = probe_s / priced
    return k, (f"{kind} probe {call}: {probe_s * 1e3:.4g} ms vs {priced * 1e3:.4g} ms in cost table "
               f"{table.name}: x{k:.3f}")


def ns_speed_scale_of(row: BenchRow, profile) -> tuple[float | None, str]:
    """(NS speed during the run relative to the cost table the simulation prices NS from, how it was
    found): the run's NS probe (`ns_probe_call`, timed on every rank at once before each block) over the
    table's time for that call at the run's threads (its `-t<T>` table where one exists), times the
    profile's NS contention at the run's ranks x threads; None without a probe (NS then follows the
    compute probe)."""
    batch, rows, cols, method = ns_probe_call(row.model())
    return _table_probe_scale(row, profile, "ns", row.probe_ns_s, f"({batch}, {rows}, {cols}) {method}",
                              lambda t: t.ns_time(rows, cols, batch, method, profile.dtype).time_s)


def elementwise_speed_scale_of(row: BenchRow, profile) -> tuple[float | None, str]:
    """The same for elementwise passes: the run's probe of one EW_PROBE_OP pass over EW_PROBE_NUMEL
    elements (`dmuon.plan.profile.elementwise_calls`, what the profiler times) against the table's time
    for it. Memory-bound passes drift apart from matmul-bound compute on this VM."""
    return _table_probe_scale(row, profile, "elementwise", row.probe_ew_s,
                              f"{EW_PROBE_OP} over {EW_PROBE_NUMEL:,} elements",
                              lambda t: t.elementwise_time(EW_PROBE_NUMEL, EW_PROBE_OP, "fp32").time_s)


def closed_loop(row: BenchRow) -> dict:
    """Simulate the measured run with the CPU profile; return both and the relative errors. The
    simulation runs at the machine's speed during the run (`speed_scale_of`: its speed probe against
    the profile's; NS and elementwise passes at their own probes' speed, `ns_speed_scale_of` and
    `elementwise_speed_scale_of`, where the run has them); `raw_*` are the same run simulated at the
    profile's speed."""
    from simulator.api import SimConfig, simulate
    from simulator.fabric.hardware import load_profile

    w = row.model()
    profile = load_profile(row.gpu)
    k, how = speed_scale_of(row, profile)
    k_ns, how_ns = ns_speed_scale_of(row, profile)
    k_ew, how_ew = elementwise_speed_scale_of(row, profile)
    # the runtime's NSConfig(method="auto") picks the cheaper method per shape, for DMuon and NaiveMuon alike;
    # NaiveMuon orthogonalizes with one batched call per shape
    cfg = SimConfig(workload=w, gpus=row.ranks, gpu=row.gpu, strategy=row.strategy, layout=row.layout,
                    seq_len=row.seq_len, micro_batch=row.micro_batch, cpu_threads=row.threads,
                    ns_method="auto", naive_ns_method="auto", naive_batching=True)
    raw = simulate(cfg)
    scaled = replace(cfg, speed_scale=k, ns_speed_scale=k_ns, elementwise_speed_scale=k_ew)
    sim = simulate(scaled) if scaled != cfg else raw
    out = {"workload": w.name, "ranks": row.ranks, "strategy": row.strategy, "layout": row.layout,
           "profile": sim.profile, "speed_scale": k, "ns_speed_scale": k_ns, "elementwise_speed_scale": k_ew,
           "speed": f"{how}; {how_ns}; {how_ew}"}
    for metric, measured in (("step", row.step_s), ("optimizer", row.optimizer_s)):
        if measured is None:
            continue
        # optimizer: same definition as the bench, end of backward compute -> step() done
        s, r = getattr(sim, f"{metric}_s"), getattr(raw, f"{metric}_s")
        out.update({f"measured_{metric}_s": measured, f"simulated_{metric}_s": s,
                    f"{metric}_error": s / measured - 1, f"raw_simulated_{metric}_s": r,
                    f"raw_{metric}_error": r / measured - 1})
    return out


def speed_rows(gpus=(256, 1024), workload: str = "qwen2.5-7b") -> list[dict]:
    """Wall seconds to simulate one dmuon configuration (plan building excluded: a warm-up run builds it)."""
    from simulator.api import SimConfig, simulate

    out = []
    for n in gpus:
        cfg = SimConfig(workload=workload, gpus=n, strategy="dmuon")
        row = {"workload": workload, "gpus": n, "strategy": "dmuon"}
        for label in ("first_run", "cached_plan"):  # the first run also builds the plan
            t0, c0 = time.perf_counter(), time.process_time()
            simulate(cfg)
            row[f"{label}_wall_s"] = time.perf_counter() - t0
            row[f"{label}_cpu_s"] = time.process_time() - c0  # what other load on the machine cannot inflate
        out.append(row)
    return out


def markdown(title: str, rows: list[dict]) -> str:
    """One markdown table (floats to 4 significant digits)."""
    out = [f"### {title}", ""]
    if rows:
        keys = list(rows[0])
        out += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        def cell(k, v):
            if v is None:
                return ""
            if isinstance(v, float):
                return f"{v:+.1%}" if ("error" in k or "over_adamw" in k) else f"{v:.4g}"
            return str(v)

        for r in rows:
            out.append("| " + " | ".join(cell(k, r[k]) for k in keys) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description="Validate the simulator against published numbers.")
    ap.add_argument("--quick", action="store_true", help="headline on 8, 64, 256 GPUs only; no speed check")
    ap.add_argument("--markdown", help="also write the tables to this markdown file (atomically)")
    args = ap.parse_args(argv)
    pub = published_rows()
    bad = [r for r in pub if not r["within_25pct"] and r["metric"] in ("optimizer", "step")]
    head = headline_rows(gpus=(8, 64, 256) if args.quick else HEADLINE_GPUS)
    parts = [
        markdown("8 x A800: reported.csv a800_8gpu_llm vs simulated (a800 profile; published convention: "
                 "the grad-sync tail counted in backward)", [{k: v for k, v in r.items() if k != "profile"}
                                                             for r in pub]),
        f"optimizer/step rows outside 25%: {len(bad)} of "
        f"{sum(r['metric'] in ('optimizer', 'step') for r in pub)}\n",
        markdown("Headline: adamw / naive / dmuon on A800, simulated (fsdp-keep, seq 2048, micro-batch 2)",
                 [{k: v for k, v in r.items() if k not in ("notes", "profile")} for r in head]),
        markdown("Headline ranges vs the paper's claims (reported.csv paper_claims)", headline_summary(head)),
    ]
    if not args.quick:
        parts.append(markdown("Simulator wall time (this machine)", speed_rows()))
    notes = sorted({n for r in head for n in r["notes"].split("; ") if n.startswith("ASSUMPTION")})
    parts.append("Notes: " + "; ".join(notes) + "\n" if notes else "")
    text = "\n".join(parts)
    print(text)
    if args.markdown:
        from dmuon.io import atomic_write_text

        head = ("# Simulator validation\n\nGenerated by `python -m simulator.validation.validate"
                + (" --quick" if args.quick else "") + f" --markdown {args.markdown}`; every number "
                "not in a published_ms or paper column is simulated.\n\n")
        atomic_write_text(Path(args.markdown), head + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
