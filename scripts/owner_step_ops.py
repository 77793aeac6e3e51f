"""What DMuon's fsdp2-sharded owner step dispatches: ops per step() (torch.profiler events, load-independent
evidence, unlike wall times on a shared machine), the step's time over its NS calls + communication
waits on the slowest rank, the compute thread's CPU time per part of the step (median over the timed
steps; CPU time, not wall: less sensitive to other jobs than wall time, not immune to them), and a hash
of every rank's parameters after the run (equal hashes from two trees = bitwise the same training).

Steps alternate: odd ones are profiled (op counts), even ones are timed without the profiler.
Run from a tree's root (compare two trees by running each):
      PYTHONPATH=. .venv/bin/python scripts/owner_step_ops.py --ranks 2 --ns-dtype bf16
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import statistics
import time

from scripts.ranks import run_ranks

PARTS = ("_local_flags", "_speculate", "_pack", "_adamw_update", "_orthogonalize", "_ns", "_return",
         "_apply_local")


def _cpu_timers(cls, cpu: dict) -> None:
    from torch.profiler import record_function

    """Wrap the step's parts (methods of the optimizer's class) to add their thread CPU time into `cpu`."""
    for name in PARTS:
        f = getattr(cls, name)

        def timed(*a, _f=f, _name=name, **kw):
            start = time.thread_time()
            try:
                with record_function(f"part{_name}"):
                    return _f(*a, **kw)
            finally:
                cpu[_name] += time.thread_time() - start
        setattr(cls, name, timed)


def _rank(rank: int, args, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from dmuon import NSConfig
    from simulator.models.benchmodel import bench_optimizer, build_bench_model, synthetic_batch
    from simulator.models.workload import load_workload

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    cpu = torch.device("cpu")
    workload = load_workload("qwen2.5-7b").scaled(1 / 16, blocks=4)
    model = build_bench_model(workload, seed=0, device=cpu, dtype=torch.float32)
    opt = bench_optimizer("dmuon", model, overlap=True, exchange="auto", layout="fsdp2-sharded",
                          ns=NSConfig(method=args.ns_method, dtype=args.ns_dtype))
    part_cpu: dict = collections.defaultdict(float)
    _cpu_timers(type(opt), part_cpu)
    counts, profiled, timed, parts = collections.Counter(), 0, [], []
    self_us, by_part, part_ops, alloc = (collections.Counter() for _ in range(4))
    for it in range(args.warmup + 2 * args.steps):
        x, y = synthetic_batch(model.vocab, 128, 2, seed=0, step=it, rank=rank, device=cpu)
        model(x, y).backward()
        dist.barrier()
        opt.comm_stats.reset()
        part_cpu.clear()
        prof = None
        if it >= args.warmup and it % 2:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                          profile_memory=True)
            prof.__enter__()
        start, cpu0 = time.perf_counter(), time.thread_time()
        opt.step()
        elapsed, part_cpu["step"] = time.perf_counter() - start, time.thread_time() - cpu0
        if prof is not None:
            prof.__exit__(None, None, None)
            profiled += 1
            for e in prof.key_averages():  # aten ops, plus a few record_function ranges
                counts[e.key] += e.count
                self_us[e.key] += e.self_cpu_time_total
            for e in prof.events():  # self time of each op under the innermost part of the step
                part = e.cpu_parent
                while part is not None and not part.name.startswith("part_"):
                    part = part.cpu_parent
                if not e.name.startswith("part_"):
                    key = (part.name[4:] if part is not None else "(other)", e.name)
                    by_part[key] += e.self_cpu_time_total
                    part_ops[key[0]] += 1
                    alloc[key[0]] += max(0, e.self_cpu_memory_usage)
        elif it >= args.warmup:
            timed.append((elapsed, opt.comm_stats.ns_s, opt.comm_stats.wait_s))
            parts.append(dict(part_cpu))
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    digest = hashlib.sha256()
    for p in model.parameters():
        t = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    parts = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in ("step", *PARTS)}
    queue.put((rank, {k: v / profiled for k, v in counts.items()}, timed, digest.hexdigest()[:16], parts,
               {k: v / profiled for k, v in self_us.items()}, {k: v / profiled for k, v in by_part.items()},
               {k: v / profiled for k, v in part_ops.items()}, {k: v / profiled for k, v in alloc.items()}))
    opt.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ns-dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--ns-method", default="standard", choices=("standard", "gram", "auto"))
    ap.add_argument("--steps", type=int, default=4, help="profiled steps (as many timed ones)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--table", type=int, default=0, help="print the top N ops by self CPU time (rank 0)")
    args = ap.parse_args()
    got = run_ranks(_rank, args.ranks, args)
    counts = got[0][1]
    ratios = []
    for step in zip(*(g[2] for g in got), strict=True):
        opt_s, ns_s, wait_s = max(step)
        ratios.append(opt_s / (ns_s + wait_s))
    print(f"ranks {args.ranks}, {args.ns_method} NS in {args.ns_dtype}, load {os.getloadavg()[0]:.2f}")
    print(f"profiler events per step (rank 0): {sum(counts.values()):.0f}; top: "
          + ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:10]))
    print(f"step / (NS + waits), slowest rank, median of {len(ratios)} steps: "
          f"{statistics.median(ratios):.3f}; rank 0 medians: step "
          + ", NS ".join(f"{statistics.median(t[j] for t in got[0][2]) * 1e3:.1f}" for j in (0, 1))
          + f", waits {statistics.median(t[2] for t in got[0][2]) * 1e3:.1f} ms (wall)")
    cpu = got[0][4]
    ns = cpu.pop("_ns")
    print(f"compute-thread CPU ms per step (rank 0): step {cpu.pop('step') * 1e3:.1f}, NS calls "
          f"{ns * 1e3:.1f}, stack fills {(cpu.pop('_orthogonalize') - ns) * 1e3:.1f}, "
          + ", ".join(f"{k.strip('_')} {v * 1e3:.1f}" for k, v in cpu.items())
          + " (return includes the own rows' apply_local)")
    if args.table:
        self_us = got[0][5]
        print(f"top {args.table} ops by self CPU time per profiled step (rank 0; the profiler's own cost "
              f"inflates small ops): total {sum(self_us.values()) / 1e3:.1f} ms")
        for k, v in sorted(self_us.items(), key=lambda kv: -kv[1])[:args.table]:
            print(f"  {k:40s} {v / 1e3:7.2f} ms  {counts.get(k, 0):6.0f} calls")
        print("self CPU time per part of the step (ms per profiled step, rank 0), ops over 0.05 ms:")
        per = collections.defaultdict(dict)
        for (part, op), v in got[0][6].items():
            per[part][op] = v
        for part, ops in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
            big = ", ".join(f"{op} {v / 1e3:.2f}" for op, v in sorted(ops.items(), key=lambda kv: -kv[1])
                            if v >= 50)
            print(f"  {part:16s} {sum(ops.values()) / 1e3:6.2f} ({got[0][7][part]:.0f} events, "
                  f"{got[0][8].get(part, 0) / 2**20:.1f} MiB allocated): {big}")
    print("parameter hashes:", " ".join(g[3] for g in got))


if __name__ == "__main__":
    main()
