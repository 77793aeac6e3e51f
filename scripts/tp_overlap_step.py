"""TPDMuon's step time with overlap=True (shard-group gathers started in backward, the TP stages
pipelined one matrix apart: runtime/tp_overlap.py) against overlap=False (all at step(), one matrix after
another), on 4 gloo CPU ranks, in one run: two copies of the same FSDP2 x TP model (dp 2 x tp 2; blocks
of a column-parallel wq, w1 and a row-parallel wo, w2), one optimizer each, steps alternated so that both
see the same machine load. Prints the median time of step() and of backward + step() for each, their
ratios, and the largest difference between the two models' weights after the last step (0: same bits).

    python scripts/tp_overlap_step.py [--dim 256] [--layers 4] [--steps 12] [--tp-mode gather|group|auto]
                                      [--no-backward-launch]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 4


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.wq, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.w1, self.w2 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        x = x + self.wo(torch.tanh(self.wq(x)))
        return x + self.w2(torch.nn.functional.silu(self.w1(x)))


def build(dim: int, layers: int, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim) for _ in range(layers)])
    for b in model:
        parallelize_module(b, mesh["tp"], {"wq": ColwiseParallel(), "w1": ColwiseParallel(),
                                           "wo": RowwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def worker(rank: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs = {}
    for overlap in (True, False):
        model = build(args.dim, args.layers, mesh)
        runs[overlap] = (model, dmuon.DMuon(model, tp_mode=args.tp_mode, overlap=overlap), [], [])
        if args.no_backward_launch:  # the step()-time pipeline alone (the hooks do nothing)
            runs[overlap][1]._tp_tracker.enabled = False
    g = torch.Generator().manual_seed(1 + mesh.get_local_rank("dp"))
    for step in range(args.steps):
        x = torch.randn(8, args.dim, generator=g)
        for overlap in ((True, False) if step % 2 else (False, True)):
            model, opt, times, both = runs[overlap]
            opt.zero_grad()
            loss = model(x).square().mean()
            dist.barrier()
            t0 = time.perf_counter()
            loss.backward()  # overlap=True: the shard-group gathers start here
            t1 = time.perf_counter()
            opt.step()
            opt.synchronize()
            t2 = time.perf_counter()
            times.append(t2 - t1)
            both.append(t2 - t0)
    diff = max((a.full_tensor() - b.full_tensor()).abs().max().item()
               for a, b in zip(runs[True][0].parameters(), runs[False][0].parameters(), strict=True))
    if rank == 0:
        med = {(o, k): statistics.median(runs[o][k][2:]) for o in runs for k in (2, 3)}  # 2 warm-ups dropped
        from dmuon.plan.tp import tp_summary

        modes = tp_summary(runs[True][1].plan)
        queue.put((med, diff, {m: modes[m]["count"] for m in ("group", "gather")}))
    for o in runs:
        runs[o][1].close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tp-mode", default="gather", choices=("auto", "group", "gather"))
    ap.add_argument("--no-backward-launch", action="store_true",
                    help="overlap=True without starting the gathers in backward: the step() pipeline alone")
    args = ap.parse_args()
    if args.steps < 4:
        ap.error("--steps must be at least 4 (2 warm-up steps are dropped)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    med, diff, modes = queue.get(timeout=600)
    for p in procs:
        p.join()
    print(("pipeline only (no backward launch); " if args.no_backward_launch else "") +
          f"dp 2 x tp 2, {args.layers} blocks of dim {args.dim}, tp_mode {args.tp_mode} "
          f"({modes['group']} matrices group, {modes['gather']} gather), {args.steps} steps")
    for k, what in ((2, "step()"), (3, "backward + step()")):
        on, off = med[True, k], med[False, k]
        print(f"{what} median: overlap=True {on * 1e3:.1f} ms, overlap=False {off * 1e3:.1f} ms, "
              f"ratio on/off {on / off:.3f}")
    print(f"max |weights(overlap) - weights(no overlap)| = {diff:.3g}")


if __name__ == "__main__":
    main()
