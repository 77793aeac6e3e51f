"""Measure this CPU and write the `cpu` simulator profile: gloo collectives, layer compute, NS costs.

So the simulator can reproduce real CPU runs of `harness bench step` (N gloo processes on this machine,
one thread each, replicated DDP-like layout, fp32, qwen2.5-7b shapes scaled down):

1. gloo collectives with 2..4 processes (one thread each): all_gather, all_reduce, and one broadcast
   from every rank at once (the owners' publication), over several buffer sizes. Latency = the fit of
   base + (n-1) alpha to the smallest buffer; the points go into the profile (busbw derived at load).
2. Compute: forward and backward of `harness bench step`'s model (qwen2.5-7b with THREAD_MODEL's
   blocks, embedding, head and tokens) at each of FIT_SCALES widths, one thread, alternating the widths;
   the FLOPs are simulator.compute's; time = F / R + layers x c fitted on two widths, checked on the
   third.
3. Thread scaling: one rank running all `cpu_cores` threads vs one thread, for layer compute (forward +
   backward of `harness bench step`'s default model: qwen2.5-7b x1/16, 4 blocks with embedding and
   head, seq 128 x 2: the small matrices of a whole model scale worse than one large block), NS
   (batched orthogonalization of the bench model's largest stacks) and elementwise passes (AdamW over
   4M elements): the [threads] speedups, so the simulator prices runs with several threads per rank
   from what was measured (small matrices and memory-bound passes scale far from linearly); and the
   same work in `cpu_cores` single-threaded processes at once: the co-run slowdowns.
NS and elementwise costs are not measured here: they come from dmuon's "cpu" cost table (one cost model
for the planner and the simulator).

The measurements live in simulator.cpu_rates (collectives, compute, per-step optimizer bookkeeping) and
simulator.cpu_contention (threads, co-run, compute / communication interference); this module runs
them, prints them and renders the profile.

Writes simulator/profiles/cpu.toml atomically. Run:
    python -m simulator.calibrate_cpu [--quick] [--dry-run]
Takes ~1-3 minutes; measurements are noisy where other work shares the cores (it says how many).
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

from .cpu_contention import (
    OVERLAP_BYTES,
    THREAD_EW_NUMEL,
    THREAD_NS,
    measure_corun,
    measure_overlap,
    measure_threads,
)
from .cpu_rates import (
    FIT_SCALES,
    OVERHEAD_SCALE,
    THREAD_MODEL,
    fit_compute,
    fit_latency,
    measure_comm,
    measure_compute,
    measure_optimizer_overhead,
)
from .hardware import PROFILE_DIR


def _host() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return f"{platform.node() or 'host'} ({cpu}, {os.cpu_count()} cores, " \
           f"torch {torch.__version__})"


def _entry(key: str, value: float, source: str) -> str:
    return f'{key} = {{ value = {value:.6g}, source = "{source}" }}'


def _memory_entry() -> str:
    """memory_gib of the profile: this host's RAM (/proc/meminfo MemTotal), shared by its ranks."""
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return _entry("memory_gib", kb / 2**20, f"measured here: /proc/meminfo MemTotal {kb:,} kB = "
                  f"{kb / 2**20:.2f} GiB of host RAM, shared by the ranks on the host (python -m "
                  "simulator.calibrate_cpu)")


def render(comm, base_s: float, alpha_s: float, comp: dict, comp_rows: list[dict], host: str,
           threads: dict[str, tuple[float, float]] | None = None,
           corun: dict[str, tuple[float, float]] | None = None,
           overlap: tuple[float, float, float, float] | None = None,
           opt_overhead: tuple[float, float, int, int] | None = None) -> str:
    measured = f"measured here: {host}"
    checks = "; ".join(f"scale {s:g}: {e:+.1%}" for s, e in comp["fwd_check"].items())
    bchecks = "; ".join(f"scale {s:g}: {e:+.1%}" for s, e in comp["bwd_check"].items())
    fit_src = (f"{measured}: forward / backward of the bench model (qwen2.5-7b, {THREAD_MODEL[1]} blocks, "
               f"seq {THREAD_MODEL[2]} x {THREAD_MODEL[3]}) at widths x{FIT_SCALES[0]:g} and "
               f"x{FIT_SCALES[-1]:g}, 1 thread, t = F / R + layers x c (python -m simulator.calibrate_cpu)")
    lines = [
        "# This machine's CPU as a simulated device: N single-threaded gloo processes on one host.",
        "# Written by `python -m simulator.calibrate_cpu`; every number measured here unless it says",
        "# otherwise.",
        'name = "cpu"',
        f'description = "{host}, one thread per rank, gloo; measured here"',
        'gpu = "cpu"',
        'cost_profile = ["cpu"]',
        'dtype = "fp32"',
        "symmetric_kernels = false  # torch kernels only on the CPU",
        "gpus_per_node = 1024",
        f"cpu_cores = {os.cpu_count() or 1}",
        "",
        "[compute]",
        _entry("peak_bf16_tflops", comp["fwd_flops"] / 1e12,
               "not a GPU: set to the measured fp32 forward rate"),
        _entry("hbm_GBps", 10.0, "not used by the simulator (elementwise passes come from the cost table)"),
        _memory_entry(),
        _entry("fwd_tflops", comp["fwd_flops"] / 1e12, f"{fit_src}; check {checks}"),
        _entry("fwd_layer_overhead_ms", comp["fwd_overhead_s"] * 1e3, f"{fit_src}; check {checks}"),
        _entry("bwd_tflops", comp["bwd_flops"] / 1e12, f"{fit_src}; check {bchecks}"),
        _entry("bwd_layer_overhead_ms", comp["bwd_overhead_s"] * 1e3, f"{fit_src}; check {bchecks}"),
        _optimizer_overhead_entry(opt_overhead, measured),
        _entry("elementwise_scale", 1.0, "none: elementwise passes priced by the cost table as is"),
        _entry("grad_prep_passes", 1.0, "the runtime measured here scales each received gradient sum to a "
                                        "mean and checks it for NaN / inf (cost table op grad_prep)"),
        _overlap_entry(overlap, measured),
        "",
        "[network]",
        _entry("nvlink_GBps", max(p[2] / p[3] for p in comm) / 1e9,
               f"{measured}: largest algbw of the gloo points (informative only)"),
        _entry("base_latency_us", base_s * 1e6, f"{measured}: fit of base + (n-1) alpha to the smallest gloo "
                                                 "all_gather, 2..4 processes, normalized by core contention "
                                                 "(capped at half the fastest point)"),
        _entry("intra_alpha_us", alpha_s * 1e6, f"{measured}: same fit"),
        _entry("inter_alpha_us", alpha_s * 1e6, "assumption: one host; no inter-node hops are ever used"),
        _entry("nic_gbps_per_node", 10.0, "assumption: one host; no inter-node traffic"),
        _entry("inter_efficiency", 1.0, "assumption: one host; no inter-node traffic"),
    ]
    if threads:
        cores = os.cpu_count() or 1
        what = {"compute": f"forward + backward of the bench model (qwen2.5-7b x{THREAD_MODEL[0]:g}, "
                           f"{THREAD_MODEL[1]} blocks, seq {THREAD_MODEL[2]} x {THREAD_MODEL[3]})",
                "ns": "orthogonalize " + " + ".join(f"({b}, {r}, {c}) {m}" for b, r, c, m in THREAD_NS)
                      + ", fp32",
                "elementwise": f"adamw_step_ over {THREAD_EW_NUMEL:,} elements"}
        lines += ["", "[threads]"]
        lines += [_entry(f"{k}_speedup", t1 / tc, f"{measured}: {what[k]}: {t1 * 1e3:.4g} ms on 1 thread, "
                                                  f"{tc * 1e3:.4g} ms on {cores} (medians)")
                  for k, (t1, tc) in threads.items()]
        lines += [_entry(f"{k}_corun_slowdown", tc / t1,
                         f"{measured}: {what[k]}, one thread: {t1 * 1e3:.4g} ms alone, "
                         f"{tc * 1e3:.4g} ms with {cores} processes running it at once (medians)")
                  for k, (t1, tc) in (corun or {}).items()]
    for kind, n, size, t in comm:
        lines += ["", "[[network.points]]", f'kind = "{kind}"', f"ranks = {n}", f"size_bytes = {size}",
                  f"time_ms = {t * 1e3:.6g}",
                  f'source = "{measured}: gloo {kind}, {n} processes, fp32 buffer, median"']
    lines += ["", "# compute measurements (seconds per pass of the bench model):"]
    lines += [f"# scale {r['scale']:g}: forward {r['fwd_s']:.6g} ({r['fwd_flops']:.4g} FLOPs), "
              f"backward {r['bwd_s']:.6g} ({r['bwd_flops']:.4g} FLOPs), {r['layers']} layers"
              for r in comp_rows]
    return "\n".join(lines) + "\n"


def _optimizer_overhead_entry(opt_overhead, measured: str) -> str:
    if opt_overhead is None:
        return _entry("optimizer_overhead_ms", 0.0, "not measured: no per-step bookkeeping priced")
    step_s, priced_s, numel, tensors = opt_overhead
    _, blocks, _, _ = THREAD_MODEL
    return _entry("optimizer_overhead_ms", max(step_s - priced_s, 0.0) * 1e3,
                  f"{measured}: harness bench step's AdamW optimizer step (dmuon.DMuon, 1 gloo process, 1 "
                  f"thread) on the bench model at width x{OVERHEAD_SCALE:g} ({blocks} blocks, {tensors} "
                  f"tensors, {numel:,} elements): {step_s * 1e3:.4g} ms, less {priced_s * 1e3:.3g} ms the "
                  "cost table prices for its adamw + grad_prep passes (median; per-step bookkeeping: "
                  "hooks, flags, per-tensor dispatch, Python)")


def _overlap_entry(overlap, measured: str) -> str:
    if not overlap:
        return "\n".join(_entry(k, 0.0, "not measured (one core): no slowdown assumed")
                         for k in ("overlap_slowdown", "comm_overlap_slowdown"))
    alone, with_comm, comm_alone, comm_during = overlap
    cores = os.cpu_count() or 1
    what = (f"{measured}: forward + backward of the bench model in {cores} single-threaded gloo processes, "
            f"beside a thread of each that all-reduces {OVERLAP_BYTES >> 20} MB back to back: compute "
            f"{alone * 1e3:.4g} ms alone, {with_comm * 1e3:.4g} ms beside the loop; one all_reduce "
            f"{comm_alone * 1e3:.3g} ms alone, {comm_during * 1e3:.3g} ms beside compute (medians)")
    return "\n".join((_entry("overlap_slowdown", max(0.0, with_comm / alone - 1), what),
                      _entry("comm_overlap_slowdown", max(0.0, comm_during / comm_alone - 1), what)))


def _write_atomic(path: Path, text: str) -> None:
    from dmuon.io import atomic_write_text

    atomic_write_text(path, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    args = ap.parse_args(argv)
    reps = 3 if args.quick else 7
    host = _host()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"host: {host}; load average before measuring: {load:.2f}")
    comp_rows = measure_compute(repeats=reps)
    comp = fit_compute(comp_rows)
    for r in comp_rows:
        print(f"compute x{r['scale']:g}: forward {r['fwd_s'] * 1e3:.2f} ms, "
              f"backward {r['bwd_s'] * 1e3:.2f} ms")
    print(f"forward {comp['fwd_flops'] / 1e9:.2f} GFLOP/s + {comp['fwd_overhead_s'] * 1e3:.3f} ms, check "
          f"{comp['fwd_check']}; backward {comp['bwd_flops'] / 1e9:.2f} GFLOP/s + "
          f"{comp['bwd_overhead_s'] * 1e3:.3f} ms, check {comp['bwd_check']}")
    threads = measure_threads(os.cpu_count() or 1, repeats=reps) if (os.cpu_count() or 1) > 1 else None
    for k, (t1, tc) in (threads or {}).items():
        print(f"threads {k}: {t1 * 1e3:.2f} ms on 1, {tc * 1e3:.2f} ms on {os.cpu_count()}: x{t1 / tc:.2f}")
    corun = measure_corun(os.cpu_count() or 1, repeats=reps) if threads else None
    for k, (t1, tc) in (corun or {}).items():
        print(f"co-run {k}: {t1 * 1e3:.2f} ms alone, {tc * 1e3:.2f} ms with {os.cpu_count()} processes: "
              f"x{tc / t1:.2f}")
    overlap = measure_overlap(os.cpu_count() or 1, repeats=reps) if threads else None
    if overlap:
        print(f"overlap: compute {overlap[0] * 1e3:.2f} ms alone, {overlap[1] * 1e3:.2f} ms beside an "
              "all_reduce "
              f"loop (x{overlap[1] / overlap[0]:.2f}); all_reduce {overlap[2] * 1e3:.2f} ms alone, "
              f"{overlap[3] * 1e3:.2f} ms beside compute")
    opt_overhead = measure_optimizer_overhead(repeats=2 * reps + 1)
    print(f"optimizer step at width x{OVERHEAD_SCALE:g}: {opt_overhead[0] * 1e3:.3f} ms, of which the cost "
          f"table prices {opt_overhead[1] * 1e3:.3f} ms")
    comm = measure_comm(repeats=reps)
    for kind, n, size, t in comm:
        print(f"gloo {kind:10s} n={n} {size:>9d} B: {t * 1e3:.3f} ms")
    base_s, alpha_s = fit_latency(comm, os.cpu_count() or 1)
    print(f"latency: base {base_s * 1e6:.1f} us + {alpha_s * 1e6:.1f} us per step")
    if args.dry_run:
        return 0
    text = render(comm, base_s, alpha_s, comp, comp_rows, host, threads, corun, overlap, opt_overhead)
    _write_atomic(PROFILE_DIR / "cpu.toml", text)
    print(f"written: {PROFILE_DIR / 'cpu.toml'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
