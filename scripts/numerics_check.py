"""How far DMuon's and NaiveMuon's weights drift from an fp64-faithful Muon trajectory, side by side.

Every rank trains the same model on its own *fixed* gradients: the loss is sum <W, G_rank,step> over the
Muon matrices, so backward hands every matrix exactly G_rank,step and the reduced gradient is exactly
their mean. The reference replays the same rule in fp64 on that mean (momentum, Nesterov, NS with the
same method and coefficients in fp64, lr scaled by dmuon.lr_scale), so what remains is the runtime's
rounding (fp32 or bf16 NS, the wire dtype, the order of the reductions). Printed per strategy: the
relative error of each matrix's total weight change after --steps steps (max and mean over matrices).
The matrices have the bench model's Qwen2.5-7B x1/16 shapes (4 layers, 28 matrices).

Run:  .venv/bin/python scripts/numerics_check.py --ranks 4 --layout fsdp2-sharded --method standard
      (--layout replicated | fsdp2-sharded; --method auto | standard | gram; --ns-dtype fp32 | bf16;
       --comm-dtype bf16; --steps K)
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(224, 224), (32, 224), (32, 224), (224, 224), (1184, 224), (1184, 224), (224, 1184)]
LAYERS, LR, MOMENTUM = 4, 0.02, 0.95


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = torch.nn.ModuleList([torch.nn.Linear(c, r, bias=False) for r, c in SHAPES])

    def forward(self, grads):
        return sum((lin.weight * g).sum() for lin, g in zip(self.lins, grads, strict=True))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block() for _ in range(LAYERS)])

    def forward(self, grads):
        return sum(b(g) for b, g in zip(self.layers, grads, strict=True))


def gradients(step: int, rank: int) -> list[list[torch.Tensor]]:
    """Rank `rank`'s fixed fp64 gradients at `step` (rows scaled unevenly: not a white matrix)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [[torch.randn(r, c, generator=gen, dtype=torch.float64) * (1 + torch.arange(r, dtype=torch.float64)
                                                                     [:, None] / r) for r, c in SHAPES]
            for _ in range(LAYERS)]


def reference(w0: list[torch.Tensor], world: int, steps: int, ns: dict) -> list[torch.Tensor]:
    import dmuon

    ref = [x.double().clone() for x in w0]
    bufs = [torch.zeros_like(x) for x in ref]
    for s in range(steps):
        per = [gradients(s, r) for r in range(world)]
        mean = [sum(per[r][b][k] for r in range(world)) / world
                for b in range(LAYERS) for k in range(len(SHAPES))]
        for x, buf, g in zip(ref, bufs, mean, strict=True):
            buf.mul_(MOMENTUM).add_(g)
            u = dmuon.orthogonalize(g + MOMENTUM * buf, **{**ns, "dtype": torch.float64})
            x.add_(u, alpha=-LR * dmuon.lr_scale(tuple(x.shape)))
    return ref


def worker(rank: int, world: int, port: int, args, strategy: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import dmuon

    torch.manual_seed(0)
    model = Model()
    w0 = [p.detach().clone() for p in model.parameters()]
    if args.layout == "fsdp2-sharded":
        dmuon.shard_model(model, layout="fsdp2-sharded", blocks=list(model.layers))
    ns = {"method": args.method}
    cls = dmuon.DMuon if strategy == "dmuon" else dmuon.NaiveMuon
    opt = cls(model, lr=LR, momentum=MOMENTUM, weight_decay=0.0, warn_no_muon=False,
              ns=dmuon.NSConfig(**ns, dtype=args.ns_dtype), comm_dtype=args.comm_dtype)
    for s in range(args.steps):
        model([[g.float() for g in blk] for blk in gradients(s, rank)]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    weights = [(p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
               for p in model.parameters()]
    if rank == 0:
        ref = reference(w0, world, args.steps, ns)
        errs = [((w.double() - a) - (r - a)).norm().item() / (r - a).norm().item()
                for w, r, a in zip(weights, ref, [x.double() for x in w0], strict=True)]
        queue.put(errs)
    dist.barrier()
    opt.close()
    dist.destroy_process_group()


def run(args, strategy: str) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, strategy, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    errs = queue.get()
    for p in procs:
        p.join(timeout=120)
    return errs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layout", choices=("replicated", "fsdp2-sharded"), default="fsdp2-sharded")
    ap.add_argument("--method", choices=("auto", "standard", "gram"), default="standard")
    ap.add_argument("--ns-dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--comm-dtype", choices=("bf16", "fp16", "fp32"), default=None)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    print(f"{args.ranks} ranks, {args.layout}, NS {args.method} {args.ns_dtype}, wire "
          f"{args.comm_dtype or 'parameter dtype'}, {args.steps} steps: relative error of each matrix's "
          "weight change against fp64 Muon on the mean gradient")
    for strategy in ("naive", "dmuon"):
        errs = run(args, strategy)
        by_shape = {}
        for k, e in enumerate(errs):
            by_shape.setdefault(SHAPES[k % len(SHAPES)], []).append(e)
        shapes = "  ".join(f"{r}x{c} {max(v):.3g}" for (r, c), v in sorted(by_shape.items()))
        print(f"  {strategy:6s} max {max(errs):.3g}  mean {sum(errs) / len(errs):.3g}  "
              f"(max by shape: {shapes})")


if __name__ == "__main__":
    main()
