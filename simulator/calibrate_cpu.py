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

Writes simulator/profiles/cpu.toml atomically. Run:
    python -m simulator.calibrate_cpu [--quick] [--dry-run]
Takes ~1-3 minutes; measurements are noisy where other work shares the cores (it says how many).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from .hardware import PROFILE_DIR

FIT_SCALES = (1 / 16, 1 / 8, 3 / 16)  # fit on the first and last, check the middle
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
def measure_compute(scales=FIT_SCALES, repeats: int = 5, rounds: int = 3) -> list[dict]:
    """Forward and backward seconds of `harness bench step`'s model (qwen2.5-7b, THREAD_MODEL's blocks
    and tokens) at each width scale, one thread: medians of `rounds` alternations over the scales (a
    shared VM drifts), each the median of `repeats` passes. The FLOPs are simulator.compute's, summed
    over the model's layers (embedding, blocks, head)."""
    import torch

    from harness.benchmodel import build_bench_model, synthetic_batch

    from .compute import layer_flops
    from .workload import load_workload

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    _, blocks, seq, mb = THREAD_MODEL
    setups = []
    for scale in scales:
        w = load_workload("qwen2.5-7b").scaled(scale, blocks=blocks)
        model = build_bench_model(w)
        x, y = synthetic_batch(model.vocab, seq, mb, seed=0, step=0, rank=0)
        lf = layer_flops(w, seq, mb)
        fwd, bwd = sum(c.fwd_flops for c in lf), sum(c.bwd_flops for c in lf)
        setups.append((scale, model, x, y, fwd, bwd, len(lf)))
    times: dict[float, tuple[list[float], list[float]]] = {sc[0]: ([], []) for sc in setups}
    try:
        for _ in range(rounds):
            for scale, model, x, y, *_ in setups:
                fwd_t, bwd_t = [], []
                for i in range(repeats + 1):
                    t0 = time.perf_counter()
                    loss = model(x, y)
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                    model.zero_grad(set_to_none=True)
                    if i:
                        fwd_t.append(t1 - t0)
                        bwd_t.append(t2 - t1)
                times[scale][0].append(statistics.median(fwd_t))
                times[scale][1].append(statistics.median(bwd_t))
    finally:
        torch.set_num_threads(before)
    return [{"scale": scale, "fwd_flops": ff, "bwd_flops": bf, "layers": n,
             "fwd_s": statistics.median(times[scale][0]), "bwd_s": statistics.median(times[scale][1])}
            for scale, _m, _x, _y, ff, bf, n in setups]


def fit_compute(rows: list[dict]) -> dict:
    """Rate R and per-layer overhead c (t = F / R + layers x c) for forward and backward from the first
    and last rows; the relative error of the fit on the others."""
    a, b = rows[0], rows[-1]
    out = {}
    for k in ("fwd", "bwd"):
        x = (b[f"{k}_s"] - a[f"{k}_s"]) / (b[f"{k}_flops"] - a[f"{k}_flops"])
        if x <= 0:
            x = b[f"{k}_s"] / b[f"{k}_flops"]
        c = max(0.0, (a[f"{k}_s"] - a[f"{k}_flops"] * x) / a.get("layers", 1))
        out[f"{k}_flops"] = 1 / x
        out[f"{k}_overhead_s"] = c
        out[f"{k}_check"] = {r["scale"]: (r[f"{k}_flops"] * x + r.get("layers", 1) * c) / r[f"{k}_s"] - 1
                             for r in rows[1:-1]}
    return out


THREAD_NS = ((8, 224, 224, "standard"), (8, 224, 1184, "gram"))  # bench model stacks (x1/16)
THREAD_MODEL = (1 / 16, 4, 128, 2)  # harness bench step's default model: width scale, blocks, seq, batch
THREAD_EW_NUMEL = 1 << 22


THREAD_WORK_KINDS = ("compute", "ns", "elementwise")


def _thread_work(kinds=THREAD_WORK_KINDS):
    """(kind, fn) for compute | ns | elementwise (those in `kinds`): the work the [threads] entries time."""
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

    return tuple((k, f) for k, f in (("compute", compute), ("ns", ns), ("elementwise", elementwise))
                 if k in kinds)


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


def _corun_worker(rank: int, repeats: int, rounds: int, start, out) -> None:
    import torch

    torch.set_num_threads(1)
    work = _thread_work()
    for kind, fn in work:
        fn()
        for _ in range(rounds):  # alternate: rank 0 alone (the others wait), then every process at once
            start.wait()
            if rank == 0:
                out.put((kind, "alone", _median_s(fn, repeats)))
            start.wait()
            t = _median_s(fn, repeats)
            out.put((kind, "corun", t))


def measure_corun(cores: int, repeats: int = 5, rounds: int = 3) -> dict[str, tuple[float, float]]:
    """kind -> (seconds of one single-threaded process alone, seconds when `cores` such processes run the
    same work at once): what ranks sharing the host's memory system and caches cost each other. The two
    alternate `rounds` times in the same processes (a shared VM drifts); medians."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(cores), ctx.Queue()
    procs = [ctx.Process(target=_corun_worker, args=(r, repeats, rounds, start, out)) for r in range(cores)]
    for p in procs:
        p.start()
    got: dict[tuple[str, str], list[float]] = {}
    kinds = THREAD_WORK_KINDS
    try:
        for _ in range(len(kinds) * rounds * (1 + cores)):
            kind, what, t = out.get(timeout=600)
            got.setdefault((kind, what), []).append(t)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {k: (statistics.median(got[(k, "alone")]), statistics.median(got[(k, "corun")])) for k in kinds}


OVERLAP_BYTES = 1 << 23  # the comm loop's all_reduce buffer (a bench-model bucket is ~1-8 MB)


def _overlap_worker(rank: int, n: int, init: str, repeats: int, out) -> None:
    import threading

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=n)
    side = dist.new_group(list(range(n)))  # the comm thread's own group (as the runtime's CommWorker)
    compute = _thread_work()[0][1]
    buf = torch.ones(OVERLAP_BYTES // 4)
    stop = threading.Event()
    comm_t: list[float] = []

    def comm_loop() -> None:
        while True:
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=side)
            comm_t.append(time.perf_counter() - t0)
            flag = torch.tensor([1.0 if stop.is_set() else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=side)  # every rank stops after the same round
            if flag.item() > 0:
                return

    compute()
    rounds = []
    for _ in range(2):  # alternate: without, with (a shared VM drifts)
        dist.barrier()
        alone = _median_s(compute, repeats)
        dist.barrier()
        for _ in range(3):
            dist.all_reduce(buf, group=side)
        comm_alone = statistics.median(_timed(lambda: dist.all_reduce(buf, group=side), repeats))
        dist.barrier()
        stop.clear()
        comm_t.clear()
        th = threading.Thread(target=comm_loop, daemon=True)
        th.start()
        time.sleep(0.05)  # the loop is running before compute starts
        with_comm = _median_s(compute, repeats)
        stop.set()
        th.join(timeout=120)
        rounds.append((alone, with_comm, comm_alone, statistics.median(comm_t) if comm_t else float("nan")))
    if rank == 0:
        out.put([statistics.median(x) for x in zip(*rounds, strict=True)])
    dist.destroy_process_group()


def _timed(fn, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def measure_overlap(cores: int, repeats: int = 5) -> tuple[float, float, float, float]:
    """On a CPU host, communication is CPU work: gloo's copies and reductions run on the same cores as
    the compute they overlap. `cores` single-threaded gloo processes run the bench model's forward +
    backward without, then with, a thread that all-reduces an OVERLAP_BYTES buffer back to back (the
    runtime's communication thread). Returns (compute alone, compute with the loop, one all_reduce
    alone, one all_reduce during compute), seconds, medians of two alternations."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        q = ctx.Queue()
        procs = [ctx.Process(target=_overlap_worker, args=(r, cores, f"file://{d}/rendezvous", repeats, q))
                 for r in range(cores)]
        for p in procs:
            p.start()
        try:
            got = q.get(timeout=900)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    return tuple(got)


OVERHEAD_SCALE = 1 / 128  # the bench model's structure (blocks, tensors, buckets), kernels almost nil


def _optimizer_worker(init: str, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    from dmuon.plan.cost import CostTable
    from harness.benchmodel import build_bench_model, synthetic_batch
    from harness.cmd_bench_step import StepConfig, make_optimizer

    from .workload import load_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    _, blocks, seq, batch = THREAD_MODEL
    model = build_bench_model(load_workload("qwen2.5-7b").scaled(OVERHEAD_SCALE, blocks=blocks))
    cfg = StepConfig(ranks=1, strategies=("adamw",), device="cpu", width_scale=OVERHEAD_SCALE, layers=blocks,
                     seq_len=seq, micro_batch=batch)
    opt = make_optimizer("adamw", model, cfg, True, "auto")  # harness bench step's adamw variant
    samples = []
    for it in range(3 + repeats):
        x, y = synthetic_batch(model.vocab, seq, batch, seed=0, step=it, rank=0)
        model(x, y).backward()
        t0 = time.perf_counter()
        opt.step()
        if it >= 3:
            samples.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    numel = sum(p.numel() for p in model.parameters())
    table = CostTable.load("cpu")
    priced = sum(table.elementwise_time(numel, op, "fp32").time_s for op in ("adamw", "grad_prep"))
    opt.synchronize()
    dist.destroy_process_group()
    out.put((statistics.median(samples), priced, numel, len(list(model.parameters()))))


def measure_optimizer_overhead(repeats: int = 15) -> tuple[float, float, int, int]:
    """The runtime's per-step bookkeeping that no cost-table row prices: `harness bench step`'s AdamW
    optimizer (dmuon.DMuon over every parameter, one gloo process, one thread) stepping the bench model
    at width x OVERHEAD_SCALE, where its kernels take almost nothing: hooks' buckets, flag exchange,
    per-tensor dispatch, Python. Returns (median step seconds, what the cpu cost table prices for the
    model's adamw + grad_prep passes, parameter elements, parameter tensors); the overhead is the
    difference."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        q = ctx.Queue()
        p = ctx.Process(target=_optimizer_worker, args=(f"file://{d}/rendezvous", repeats, q))
        p.start()
        try:
            got = q.get(timeout=600)
        finally:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return tuple(got)


# ---- writing ---------------------------------------------------------------------------------------
def _entry(key: str, value: float, source: str) -> str:
    return f'{key} = {{ value = {value:.6g}, source = "{source}" }}'


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
