"""DMuon (or NaiveMuon: `--strategy naive`) with expert parallelism (`DMuon(model, ep=E)`): what one
step() costs on gloo ranks, for a MoE of many small experts (where the expert exchange, not NS, is the
step): per training step a forward and a backward pass (every rank's local experts see every token), then
`step()` and `synchronize()`. Printed: the step's wall time (step() and synchronize()), the iteration's
(backward, step(), synchronize()), the training thread's CPU time over the same spans (medians over the
timed steps, slowest rank), the collectives that thread issues inside step() (reduces, broadcasts,
all-reduces: the expert exchange when it runs there; both optimizers' own exchanges run on their
communication threads), and a hash of every rank's parameters after the run (equal hashes from two trees
= bitwise the same training). `--no-backward` sets random gradients instead of a backward pass (no hook
fires: every exchange runs from step()).

Run from a tree's root (compare two trees by running each with its PYTHONPATH):
      PYTHONPATH=. .venv/bin/python scripts/ep_step.py --ranks 4 --ep 2
NaiveMuon (every expert gradient all-reduced over the replica group, NS of every local expert on every
rank) on the same model, for a side-by-side comparison:
      PYTHONPATH=. .venv/bin/python scripts/ep_step.py --ranks 4 --ep 2 --strategy naive
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

        def forward(self, x):  # every local expert on every token, outputs averaged
            h, ex = self.norm(x), self.mlp.experts
            up = torch.relu(torch.einsum("td,eid->tei", h, ex.w_up)) / args.hidden ** 0.5
            return x + self.q(h) + torch.einsum("tei,edi->td", up, ex.w_down) / (args.inter ** 0.5 * e_local)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, args.hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(args.layers))

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    return Model()


def _rank(rank: int, args, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import dmuon
    from dmuon.runtime.bytecount import CollectiveBytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    model = _model(args, args.experts // args.ep)
    cls = {"dmuon": dmuon.DMuon, "naive": dmuon.NaiveMuon}[args.strategy]
    opt = cls(model, ep=args.ep, profile="cpu", timeout_s=120.0)
    walls, cpus, iters, iter_cpus, colls = [], [], [], [], []
    for it in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 * it + rank)
        if args.no_backward:
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
        else:
            loss = model(torch.randint(0, 64, (args.tokens,), generator=g))
        counter = CollectiveBytes()
        dist.barrier()
        start, cpu0 = time.perf_counter(), time.thread_time()
        if not args.no_backward:
            loss.backward()
        mid, cpu1 = time.perf_counter(), time.thread_time()
        with counter.active():
            opt.step()
        opt.synchronize()
        if it >= args.warmup:
            walls.append(time.perf_counter() - mid)
            cpus.append(time.thread_time() - cpu1)
            iters.append(time.perf_counter() - start)
            iter_cpus.append(time.thread_time() - cpu0)
            colls.append(sum(r.kind in ("reduce", "broadcast", "all_reduce") for r in counter.records))
        opt.zero_grad(set_to_none=True)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    held = sum(p.shape[0] for p in model.parameters() if p.dim() == 3)
    queue.put((rank, statistics.median(walls), statistics.median(cpus), statistics.median(colls), held,
               digest.hexdigest()[:16], statistics.median(iters), statistics.median(iter_cpus)))
    opt.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", choices=("dmuon", "naive"), default="dmuon",
                    help="DMuon (owner-centric) or NaiveMuon (all-reduce, NS on every rank)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64, help="experts per MoE layer (all EP ranks)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--inter", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank and step")
    ap.add_argument("--no-backward", action="store_true", help="random gradients, no forward / backward")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    got = run_ranks(_rank, args.ranks, args)
    print(f"{args.strategy}: ranks {args.ranks}, ep {args.ep}, {args.layers} layers x {args.experts} experts "
          f"x (w_up {args.inter}x{args.hidden}, w_down {args.hidden}x{args.inter}); {got[0][4]} expert "
          f"matrices per rank; load {os.getloadavg()[0]:.2f}")
    print(f"step wall ms (median, slowest rank) {max(g[1] for g in got) * 1e3:.1f}; training-thread CPU ms "
          f"{max(g[2] for g in got) * 1e3:.1f}; expert collectives in step() {max(g[3] for g in got):g}")
    print(f"backward + step wall ms {max(g[6] for g in got) * 1e3:.1f}; training-thread CPU ms "
          f"{max(g[7] for g in got) * 1e3:.1f}")
    print("parameter hashes:", " ".join(g[5] for g in got))


if __name__ == "__main__":
    main()
