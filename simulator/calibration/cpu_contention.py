"""What ranks and threads sharing this CPU cost each other, for the `cpu` profile's [threads] and
overlap entries (simulator.calibration.calibrate_cpu writes them):

- thread scaling: one rank running all `cores` threads vs one thread, for layer compute (forward +
  backward of bench step's default model, THREAD_MODEL), NS (batched orthogonalization of the bench
  model's largest stacks, THREAD_NS) and elementwise passes (AdamW over THREAD_EW_NUMEL elements);
- co-run slowdowns: the same work in `cores` single-threaded processes at once vs one alone;
- compute / communication interference: the bench model's forward + backward beside a thread that
  all-reduces OVERLAP_BYTES back to back, and that all-reduce beside compute (gloo's copies and
  reductions run on the same cores).
Every pair is measured in alternation in the same processes (a shared VM drifts); medians.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from .cpu_rates import THREAD_MODEL

THREAD_NS = ((8, 224, 224, "standard"), (8, 224, 1184, "gram"))  # bench model stacks (x1/16)
THREAD_EW_NUMEL = 1 << 22
THREAD_WORK_KINDS = ("compute", "ns", "elementwise")


def _thread_work(kinds=THREAD_WORK_KINDS):
    """(kind, fn) for compute | ns | elementwise (those in `kinds`): the work the [threads] entries time."""
    import torch

    from dmuon.newton_schulz import orthogonalize
    from dmuon.optim import adamw_step_

    from simulator.models.benchmodel import build_bench_model, synthetic_batch
    from simulator.models.workload import load_workload

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


__all__ = ["OVERLAP_BYTES", "THREAD_EW_NUMEL", "THREAD_NS", "THREAD_WORK_KINDS", "measure_corun",
           "measure_overlap", "measure_threads"]
