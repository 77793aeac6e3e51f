"""DMuon with expert parallelism (`DMuon(model, ep=E)`): what one step() costs on gloo ranks, for a MoE of
many small experts (where the expert exchange, not NS, is the step): the step's wall time and the training
thread's CPU time (medians over the timed steps, slowest rank), the collectives that thread issues per
step (the expert exchange; DMuon's own exchange runs on its communication thread), and a hash of every
rank's parameters after the run (equal hashes from two trees = bitwise the same training).

Run from a tree's root (compare two trees by running each with its PYTHONPATH):
      PYTHONPATH=. .venv/bin/python scripts/ep_step.py --ranks 4 --ep 2
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

from scripts.ranks import run_ranks


def _model(args, e_local: int):
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(args.hidden, args.hidden, bias=False)
            self.norm = nn.LayerNorm(args.hidden)
            self.mlp = nn.Module()
            self.mlp.experts = nn.Module()
            self.mlp.experts.w_up = nn.Parameter(torch.randn(e_local, args.inter, args.hidden))
            self.mlp.experts.w_down = nn.Parameter(torch.randn(e_local, args.hidden, args.inter))

    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(64, args.hidden)
    model.layers = nn.ModuleList(Layer() for _ in range(args.layers))
    return model


def _rank(rank: int, args, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import dmuon
    from dmuon.runtime.bytecount import CollectiveBytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    model = _model(args, args.experts // args.ep)
    opt = dmuon.DMuon(model, ep=args.ep, profile="cpu", timeout_s=120.0)
    walls, cpus, colls = [], [], []
    for it in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 * it + rank)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        counter = CollectiveBytes()
        dist.barrier()
        start, cpu0 = time.perf_counter(), time.thread_time()
        with counter.active():
            opt.step()
        opt.synchronize()
        if it >= args.warmup:
            walls.append(time.perf_counter() - start)
            cpus.append(time.thread_time() - cpu0)
            colls.append(sum(r.kind in ("reduce", "broadcast") for r in counter.records))
        opt.zero_grad(set_to_none=True)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    held = sum(p.shape[0] for p in model.parameters() if p.dim() == 3)
    queue.put((rank, statistics.median(walls), statistics.median(cpus), statistics.median(colls), held,
               digest.hexdigest()[:16]))
    opt.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64, help="experts per MoE layer (all EP ranks)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--inter", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    got = run_ranks(_rank, args.ranks, args)
    print(f"ranks {args.ranks}, ep {args.ep}, {args.layers} layers x {args.experts} experts x (w_up "
          f"{args.inter}x{args.hidden}, w_down {args.hidden}x{args.inter}); {got[0][4]} expert matrices per "
          f"rank; load {os.getloadavg()[0]:.2f}")
    print(f"step wall ms (median, slowest rank) {max(g[1] for g in got) * 1e3:.1f}; training-thread CPU ms "
          f"{max(g[2] for g in got) * 1e3:.1f}; reduces + broadcasts per step {max(g[3] for g in got):g}")
    print("parameter hashes:", " ".join(g[5] for g in got))


if __name__ == "__main__":
    main()
