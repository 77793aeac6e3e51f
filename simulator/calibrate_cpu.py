"""Measure this CPU and write the `cpu` simulator profile: gloo collectives, layer compute, NS costs.

So the simulator can reproduce real CPU runs of `harness bench step` (N gloo processes on this machine,
one thread each, replicated DDP-like layout, fp32, qwen2.5-7b shapes scaled down):

1. gloo collectives with 2..4 processes (one thread each): all_gather, all_reduce, and one broadcast
   from every rank at once (the owners' publication), over several buffer sizes. Latency = the fit of
   base + (n-1) alpha to the smallest buffer; the points go into the profile (busbw derived at load).
2. Compute: forward and backward of one transformer-like block (q/k/v/o projections with causal
   attention, RMSNorm, SiLU-gated MLP) of qwen2.5-7b scaled by each of FIT_SCALES, one thread; the
   FLOPs are simulator.compute's; forward = F / R + c fitted on two scales, checked on the third.
3. Thread scaling: one rank running all `cpu_cores` threads vs one thread, for layer compute (forward +
   backward of `harness bench step`'s default model: qwen2.5-7b x1/16, 4 blocks with embedding and
   head, seq 128 x 2: the small matrices of a whole model scale worse than one large block), NS
   (batched orthogonalization of the bench model's largest stacks) and elementwise passes (AdamW over
   4M elements): the [threads] speedups, so the simulator prices runs with several threads per rank
   from what was measured (small matrices and memory-bound passes scale far from linearly); and the
   same work in `cpu_cores` single-threaded processes at once: the co-run slowdowns.
NS and elementwise costs are not measured here: they come from dmuon's "cpu" cost table (one cost model
for the planner and the simulator).

Writes simulator/profiles/cpu.toml atomically. Run:
    python -m simulator.calibrate_cpu [--quick] [--dry-run]
Takes ~1-3 minutes; measurements are noisy where other work shares the cores (it says how many).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from .hardware import PROFILE_DIR

FIT_SCALES = (1 / 16, 1 / 8, 3 / 16)  # fit on the first and last, check the middle
TOKENS = (256, 1)  # (seq_len, micro_batch) of the compute measurement
COMM_SIZES = (1 << 14, 1 << 18, 1 << 21, 1 << 23)  # bytes (fp32 buffers)
COMM_RANKS = (2, 3, 4)


def _host() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return f"{platform.node() or 'host'} ({cpu}, {os.cpu_count()} cores, " \
           f"torch {torch.__version__})"


# ---- 1. collectives --------------------------------------------------------------------------------
def _comm_worker(rank: int, n: int, init: str, sizes, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=n)
    results = []
    for size in sizes:
        numel = size // 4
        x = torch.ones(numel)
        parts = [torch.empty(numel // n) for _ in range(n)]
        mine = torch.ones(numel // n)
        chunks = [torch.ones(max(1, numel // n)) for _ in range(n)]

        def all_gather(parts=parts, mine=mine):
            dist.all_gather(parts, mine)

        def all_reduce(x=x):
            dist.all_reduce(x)

        def broadcast(chunks=chunks):  # every rank publishes its chunk: one broadcast per root, all at once
            works = [dist.broadcast(chunks[r], src=r, async_op=True) for r in range(n)]
            for w in works:
                w.wait()

        for kind, fn in (("all_gather", all_gather), ("all_reduce", all_reduce), ("broadcast", broadcast)):
            fn()
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.append(t.item())
            if rank == 0:
                results.append((kind, n, size, statistics.median(times)))
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def measure_comm(sizes=COMM_SIZES, ranks=COMM_RANKS, repeats: int = 7) -> list[tuple[str, int, int, float]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for n in ranks:
        with tempfile.TemporaryDirectory() as d:
            init = f"file://{d}/rendezvous"
            q = ctx.Queue()
            procs = [ctx.Process(target=_comm_worker, args=(r, n, init, sizes, repeats, q)) for r in range(n)]
            for p in procs:
                p.start()
            rows += q.get(timeout=600)
            for p in procs:
                p.join(timeout=60)
    return rows


def fit_latency(points, cores: int) -> tuple[float, float]:
    """(base, alpha) seconds from the smallest all-gathers: least squares of t = base + (n-1) alpha, on
    times normalized to an uncontended host (divided by max(1, n / cores), as the profile loader does)."""
    points = [(k, n, s, t / max(1.0, n / cores)) for k, n, s, t in points]
    small = min(p[2] for p in points)
    xs = [p[1] - 1 for p in points if p[0] == "all_gather" and p[2] == small]
    ys = [p[3] for p in points if p[0] == "all_gather" and p[2] == small]
    if len(set(xs)) < 2:
        return min(ys), 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    alpha = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(0.0, alpha)
    base = max(0.0, my - alpha * mx)
    # keep every point above the latency floor the profile loader checks
    floor = min(p[3] / (2 * (p[1] - 1) + 1) for p in points)
    return min(base, 0.5 * floor), min(alpha, 0.5 * floor)


# ---- 2. compute ------------------------------------------------------------------------------------
def _block(scale: float):
    """A qwen2.5-7b block scaled by `scale`: (modules, query width), parameters from the workload's shapes."""
    from torch import nn

    from .workload import load_workload

    w = load_workload("qwen2.5-7b").scaled(scale, blocks=1)
    shapes = {p.matrix: (p.rows, p.cols) for p in w.params if p.block == 0}
    lin = {k: nn.Linear(c, r, bias=False) for k, (r, c) in shapes.items()}
    return lin, shapes["q_proj"][0], shapes["q_proj"][1], w


def _block_forward(lin, x, d_q: int):
    import torch.nn.functional as F

    h = F.rms_norm(x, (x.shape[-1],))
    q, k, v = lin["q_proj"](h), lin["k_proj"](h), lin["v_proj"](h)
    hd = math.gcd(d_q, k.shape[-1], 64)  # head dim; grouped k/v heads are repeated (GQA)
    heads, kv_heads = d_q // hd, k.shape[-1] // hd
    b, t = x.shape[0], x.shape[1]
    q = q.view(b, t, heads, hd).transpose(1, 2)
    k = k.view(b, t, kv_heads, hd).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    v = v.view(b, t, kv_heads, hd).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d_q)
    x = x + lin["o_proj"](a)
    h = F.rms_norm(x, (x.shape[-1],))
    return x + lin["down_proj"](F.silu(lin["gate_proj"](h)) * lin["up_proj"](h))


def measure_compute(scales=FIT_SCALES, repeats: int = 5) -> list[dict]:
    import torch

    from .compute import layer_flops

    torch.set_num_threads(1)
    seq, mb = TOKENS
    rows = []
    for scale in scales:
        lin, d_q, d_model, w = _block(scale)
        x = torch.randn(mb, seq, d_model, requires_grad=True)
        params = [p for m in lin.values() for p in m.parameters()]
        fwd_t, bwd_t = [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            y = _block_forward(lin, x, d_q)
            t1 = time.perf_counter()
            y.sum().backward()
            t2 = time.perf_counter()
            for p in params:
                p.grad = None
            x.grad = None
            if i:
                fwd_t.append(t1 - t0)
                bwd_t.append(t2 - t1)
        block_layer = next(lf for lf in layer_flops(w, seq, mb) if lf.layer == 1)
        rows.append({"scale": scale, "fwd_flops": block_layer.fwd_flops, "bwd_flops": block_layer.bwd_flops,
                     "fwd_s": statistics.median(fwd_t), "bwd_s": statistics.median(bwd_t)})
    return rows


def fit_compute(rows: list[dict]) -> dict:
    """R and c for forward and backward from the first and last rows; relative error on the others."""
    a, b = rows[0], rows[-1]
    out = {}
    for k in ("fwd", "bwd"):
        x = (b[f"{k}_s"] - a[f"{k}_s"]) / (b[f"{k}_flops"] - a[f"{k}_flops"])
        if x <= 0:
            x = b[f"{k}_s"] / b[f"{k}_flops"]
        c = max(0.0, a[f"{k}_s"] - a[f"{k}_flops"] * x)
        out[f"{k}_flops"] = 1 / x
        out[f"{k}_overhead_s"] = c
        out[f"{k}_check"] = {r["scale"]: (r[f"{k}_flops"] * x + c) / r[f"{k}_s"] - 1 for r in rows[1:-1]}
    return out


THREAD_NS = ((8, 224, 224, "standard"), (8, 224, 1184, "gram"))  # bench model stacks (x1/16)
THREAD_MODEL = (1 / 16, 4, 128, 2)  # harness bench step's default model: width scale, blocks, seq, batch
THREAD_EW_NUMEL = 1 << 22


def _thread_work():
    """(kind, fn) for compute | ns | elementwise: the work the [threads] and [corun] entries time."""
    import torch

    from dmuon.newton_schulz import orthogonalize
    from dmuon.optim import adamw_step_
    from harness.benchmodel import build_bench_model, synthetic_batch

    from .workload import load_workload

    model = build_bench_model(load_workload("qwen2.5-7b").scaled(THREAD_MODEL[0], blocks=THREAD_MODEL[1]))
    x, y = synthetic_batch(model.vocab, THREAD_MODEL[2], THREAD_MODEL[3], seed=0, step=0, rank=0)

    def compute():
        model(x, y).backward()
        model.zero_grad(set_to_none=True)

    gen = torch.Generator().manual_seed(0)
    stacks = [(torch.randn(b, r, c, generator=gen), m) for b, r, c, m in THREAD_NS]

    def ns():
        for g, m in stacks:
            orthogonalize(g, method=m, dtype=torch.float32)

    ew = [torch.randn(THREAD_EW_NUMEL, generator=gen) for _ in range(4)]
    ew[3].abs_()

    def elementwise():
        adamw_step_([ew[0]], [ew[1]], [ew[2]], [ew[3]], [1], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                    weight_decay=0.01)

    return (("compute", compute), ("ns", ns), ("elementwise", elementwise))


def _median_s(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_threads(cores: int, repeats: int = 5, rounds: int = 3) -> dict[str, tuple[float, float]]:
    """kind -> (seconds with one thread, seconds with `cores` threads) for compute | ns | elementwise:
    medians over `rounds` alternations of the two (a shared VM drifts; alternating cancels most of it)."""
    import torch

    before = torch.get_num_threads()
    out = {}
    try:
        for kind, fn in _thread_work():
            times = {1: [], cores: []}
            for _ in range(rounds):
                for t in (1, cores):
                    torch.set_num_threads(t)
                    times[t].append(_median_s(fn, repeats))
            out[kind] = (statistics.median(times[1]), statistics.median(times[cores]))
    finally:
        torch.set_num_threads(before)
    return out


def _corun_worker(rank: int, repeats: int, start, out) -> None:
    import torch

    torch.set_num_threads(1)
    work = _thread_work()
    for kind, fn in work:
        fn()
        start.wait()  # every process starts each kind together
        out.put((rank, kind, _median_s(fn, repeats)))


def measure_corun(cores: int, repeats: int = 5) -> dict[str, tuple[float, float]]:
    """kind -> (seconds of one single-threaded process alone, median seconds when `cores` such processes
    run the same work at once): what ranks sharing the host's memory system and caches cost each other."""
    import multiprocessing as mp

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = {kind: _median_s(fn, repeats) for kind, fn in _thread_work()}
    finally:
        torch.set_num_threads(before)
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(cores), ctx.Queue()
    procs = [ctx.Process(target=_corun_worker, args=(r, repeats, start, out)) for r in range(cores)]
    for p in procs:
        p.start()
    got: dict[str, list[float]] = {}
    try:
        for _ in range(cores * len(alone)):
            _, kind, t = out.get(timeout=600)
            got.setdefault(kind, []).append(t)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {kind: (alone[kind], statistics.median(got[kind])) for kind in alone}


# ---- writing ---------------------------------------------------------------------------------------
def _entry(key: str, value: float, source: str) -> str:
    return f'{key} = {{ value = {value:.6g}, source = "{source}" }}'


def render(comm, base_s: float, alpha_s: float, comp: dict, comp_rows: list[dict], host: str,
           threads: dict[str, tuple[float, float]] | None = None,
           corun: dict[str, tuple[float, float]] | None = None) -> str:
    measured = f"measured here: {host}"
    checks = "; ".join(f"scale {s:g}: {e:+.1%}" for s, e in comp["fwd_check"].items())
    bchecks = "; ".join(f"scale {s:g}: {e:+.1%}" for s, e in comp["bwd_check"].items())
    fit_src = (f"{measured}: one qwen2.5-7b block scaled x{FIT_SCALES[0]:g} and x{FIT_SCALES[-1]:g}, seq "
               f"{TOKENS[0]} x {TOKENS[1]}, 1 thread, F / R + c fit (python -m simulator.calibrate_cpu)")
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
        _entry("fwd_tflops", comp["fwd_flops"] / 1e12, f"{fit_src}; check {checks}"),
        _entry("fwd_layer_overhead_ms", comp["fwd_overhead_s"] * 1e3, f"{fit_src}; check {checks}"),
        _entry("bwd_tflops", comp["bwd_flops"] / 1e12, f"{fit_src}; check {bchecks}"),
        _entry("bwd_layer_overhead_ms", comp["bwd_overhead_s"] * 1e3, f"{fit_src}; check {bchecks}"),
        _entry("optimizer_overhead_ms", 0.0, "none added: the cost table's elementwise rows are per call"),
        _entry("elementwise_scale", 1.0, "none: elementwise passes priced by the cost table as is"),
        _entry("grad_prep_passes", 1.0, "the runtime measured here scales each received gradient sum to a "
                                        "mean and checks it for NaN / inf (cost table op grad_prep)"),
        _entry("overlap_slowdown", 0.0, "assumption: not modelled (ranks sharing cores: see cpu_cores)"),
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
    lines += ["", "# compute measurements (seconds per block):"]
    lines += [f"# scale {r['scale']:g}: forward {r['fwd_s']:.6g} ({r['fwd_flops']:.4g} FLOPs), "
              f"backward {r['bwd_s']:.6g} ({r['bwd_flops']:.4g} FLOPs)" for r in comp_rows]
    return "\n".join(lines) + "\n"


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
    comm = measure_comm(repeats=reps)
    for kind, n, size, t in comm:
        print(f"gloo {kind:10s} n={n} {size:>9d} B: {t * 1e3:.3f} ms")
    base_s, alpha_s = fit_latency(comm, os.cpu_count() or 1)
    print(f"latency: base {base_s * 1e6:.1f} us + {alpha_s * 1e6:.1f} us per step")
    if args.dry_run:
        return 0
    text = render(comm, base_s, alpha_s, comp, comp_rows, host, threads, corun)
    _write_atomic(PROFILE_DIR / "cpu.toml", text)
    print(f"written: {PROFILE_DIR / 'cpu.toml'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
