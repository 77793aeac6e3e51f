"""What one rank of this CPU takes, for the `cpu` profile (simulator.calibration.calibrate_cpu writes it):

- gloo collectives with 2..4 single-threaded processes (all_gather, all_reduce, one broadcast from every
  rank at once) over several buffer sizes, and the latency fit base + (n-1) alpha;
- forward and backward of `harness bench step`'s model (simulator.models.benchmodel) at FIT_SCALES widths, one
  thread, and the fit t = F / R + layers x c;
- the optimizer's per-step bookkeeping no cost-table row prices (bench step's AdamW optimizer at width
  x OVERHEAD_SCALE, where its kernels take almost nothing).
"""

from __future__ import annotations

import statistics
import tempfile
import time

FIT_SCALES = (1 / 16, 1 / 8, 3 / 16)  # fit on the first and last, check the middle
COMM_SIZES = (1 << 14, 1 << 18, 1 << 21, 1 << 23)  # bytes (fp32 buffers)
COMM_RANKS = (2, 3, 4)
THREAD_MODEL = (1 / 16, 4, 128, 2)  # harness bench step's default model: width scale, blocks, seq, batch


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


def measure_compute(scales=FIT_SCALES, repeats: int = 5, rounds: int = 3) -> list[dict]:
    """Forward and backward seconds of `harness bench step`'s model (qwen2.5-7b, THREAD_MODEL's blocks
    and tokens) at each width scale, one thread: medians of `rounds` alternations over the scales (a
    shared VM drifts), each the median of `repeats` passes. The FLOPs are simulator.models.compute's, summed
    over the model's layers (embedding, blocks, head)."""
    import torch

    from simulator.models.benchmodel import build_bench_model, synthetic_batch
    from simulator.models.compute import layer_flops
    from simulator.models.workload import load_workload

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


OVERHEAD_SCALE = 1 / 128  # the bench model's structure (blocks, tensors, buckets), kernels almost nil


def _optimizer_worker(init: str, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    from dmuon.plan.cost import CostTable

    from simulator.models.benchmodel import bench_optimizer, build_bench_model, synthetic_batch
    from simulator.models.workload import load_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    _, blocks, seq, batch = THREAD_MODEL
    model = build_bench_model(load_workload("qwen2.5-7b").scaled(OVERHEAD_SCALE, blocks=blocks))
    opt = bench_optimizer("adamw", model, overlap=True, exchange="auto")  # bench step's adamw variant
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


__all__ = ["COMM_RANKS", "COMM_SIZES", "FIT_SCALES", "OVERHEAD_SCALE", "THREAD_MODEL", "fit_compute",
           "fit_latency", "measure_comm", "measure_compute", "measure_optimizer_overhead"]
