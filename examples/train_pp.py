"""Pipeline parallelism with DMuon: `torch.distributed.pipelining` stages, each trained by one optimizer per
rank over its stage's data-parallel group.

    torchrun --nproc-per-node 4 examples/train_pp.py --pp 2 --schedule 1f1b --layout fsdp2-sharded

The ranks form a (pp, dp) DeviceMesh (pp x dp = world size). Every rank builds the full model from one
seed, routes it once (which matrices are Muon's: `dmuon.route(full)`), keeps only its stage's modules
(names unchanged, torchtitan-style), optionally shards them with FSDP2 over the dp dimension, and builds
`DMuon(stage_model, process_group=mesh["dp"].get_group(), muon_predicate=...)`: each stage's matrices are
planned and exchanged within that stage's dp group. The pipeline schedule runs inside `opt.no_sync()`
(the micro-batches' gradients accumulate locally; step() exchanges their sum once). Schedules: gpipe,
1f1b (one stage per rank) and zbv (ScheduleZBVZeroBubble: two stages per rank, split backward).
The model: a token embedding, residual MLP blocks (RMSNorm, up, GELU, down) and an output head; it learns
synthetic sequences (each token is the previous one + 1). CPUs (gloo, fp32) or GPUs (nccl).

--optimizer both trains the same steps with DMuon and then NaiveMuon, prints both losses (they must be
equal: the same math) and the time of their optimizer steps (opt.step() + opt.synchronize(), median over
the steps after the first, the slowest rank) and the ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import dmuon

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zbv": "ScheduleZBVZeroBubble"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (dp = world size / pp)")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    p.add_argument("--layout", default="replicated", choices=["replicated", "fsdp2-sharded", "fsdp2-owner"],
                   help="data parallelism inside a stage: DMuon's replicas, or FSDP2 over the dp dimension")
    p.add_argument("--optimizer", default="dmuon", choices=["dmuon", "naive", "both"])
    p.add_argument("--blocks", type=int, default=4, help="residual blocks (split evenly over the stages)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="sequences per dp rank per step")
    p.add_argument("--microbatches", type=int, default=2, help="per stage (zbv: per rank, x 2)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate (AdamW: lr / 10)")
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab, d, blocks):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleDict({str(i): Block(d) for i in range(blocks)})
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab)

    def forward(self, x):  # a stage runs the modules it kept
        h = self.embed(x) if self.embed is not None else x
        for b in self.blocks.values():
            h = b(h)
        return self.head(self.norm(h)) if self.head is not None else h


def stage_parts(n_blocks: int, n_stages: int) -> list[set[str]]:
    """Module names per stage: blocks split evenly, the embedding on the first, norm and head on the last."""
    if n_blocks < n_stages:
        raise SystemExit(f"--blocks {n_blocks} < {n_stages} stages; accepted: at least one block per stage")
    cuts = [round(s * n_blocks / n_stages) for s in range(n_stages + 1)]
    parts = [{f"blocks.{i}" for i in range(cuts[s], cuts[s + 1])} for s in range(n_stages)]
    parts[0].add("embed")
    parts[-1] |= {"norm", "head"}
    return parts


def prune(full: Model, keep: set[str], share: bool = False) -> Model:
    """Only the modules in `keep`, names unchanged: a deep copy, or (share) the given model's own modules."""
    m = copy.copy(full) if share else copy.deepcopy(full)
    if share:
        m._modules = dict(full._modules)
        m.blocks = nn.ModuleDict(dict(full.blocks.items()))
    for k in list(m.blocks):
        if f"blocks.{k}" not in keep:
            del m.blocks[k]
    for name in ("embed", "norm", "head"):
        if name not in keep:
            setattr(m, name, None)
    return m


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def batch(args, step, dp_rank):
    """Synthetic sequences (token + 1 each position), different per dp rank and step, same in every run."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = (torch.randint(0, args.vocab, (args.batch, 1), generator=g) + torch.arange(args.seq_len + 1))
    tokens = tokens % args.vocab
    return tokens[:, :-1], tokens[:, 1:]


def train(args, mesh, full, predicate, cls, device):
    """args.steps steps; returns (losses printed by the last stage, optimizer step times in seconds)."""
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard

    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    n_pp = mesh["pp"].size()
    per_rank = 2 if args.schedule == "zbv" else 1
    parts = stage_parts(args.blocks, n_pp * per_rank)
    mine = (pp,) if per_rank == 1 else (pp, 2 * n_pp - 1 - pp)  # zbv: the V placement
    model = prune(full, set().union(*(parts[s] for s in mine))).to(device)
    modules = [model] if per_rank == 1 else [prune(model, parts[s], share=True) for s in mine]
    if args.layout != "replicated":
        for m in modules:
            ignored = ({p for n, p in m.named_parameters() if predicate(n, p)}
                       if args.layout == "fsdp2-owner" else None)
            fully_shard(m, mesh=mesh["dp"], ignored_params=ignored)
    opt = cls(model, process_group=mesh["dp"].get_group(), muon_predicate=predicate, lr=args.lr,
              adamw_lr=args.lr / 10, layout=args.layout)
    stages = [pipelining.PipelineStage(m, s, len(parts), device, group=mesh["pp"].get_group())
              for m, s in zip(modules, mine, strict=True)]
    schedule = getattr(pipelining, SCHEDULES[args.schedule])(
        stages if per_rank > 1 else stages[0], n_microbatches=args.microbatches * per_rank, loss_fn=loss_fn)
    last = len(parts) - 1 in mine
    losses, times = [], []
    for step in range(args.steps):
        x, y = batch(args, step, dp)
        mb_losses = []
        with opt.no_sync():  # gradients of all micro-batches accumulate; step() exchanges them once
            schedule.step(*([x.to(device)] if 0 in mine else []),
                          **({"target": y.to(device), "losses": mb_losses} if last else {}))
        dist.barrier(group=mesh["dp"].get_group())
        t0 = time.perf_counter()
        opt.step()
        opt.synchronize()
        times.append(time.perf_counter() - t0)
        opt.zero_grad()
        if last:
            loss = torch.stack([v.detach().float() for v in mb_losses]).mean()
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            losses.append(loss.item() / mesh["dp"].size())
    opt.close()
    return losses, times


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    world = dist.get_world_size()
    if args.pp < 2 or world % args.pp:
        raise SystemExit(f"--pp {args.pp} with {world} ranks; accepted: pp >= 2 dividing the world size")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    full = Model(args.vocab, args.hidden, args.blocks)  # the same weights on every rank
    # route once, on the full model: a stage alone cannot tell its head or embedding from a hidden matrix
    muon = {r.name for r in dmuon.route(full) if r.use_muon}

    def predicate(name, p):
        return name in muon

    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    loss_rank = (pp == 0) if args.schedule == "zbv" else (pp == args.pp - 1)  # holds the last stage
    if dist.get_rank() == 0:
        n = sum(p.numel() for p in full.parameters())
        print(f"model: {n / 1e6:.2f}M parameters ({len(muon)} Muon matrices), pp={args.pp} x "
              f"dp={world // args.pp}, schedule {args.schedule}, layout {args.layout}", flush=True)
    names = {"dmuon": ["DMuon"], "naive": ["NaiveMuon"], "both": ["DMuon", "NaiveMuon"]}[args.optimizer]
    medians = {}
    for name in names:
        losses, times = train(args, mesh, full, predicate, getattr(dmuon, name), device)
        for step, loss in enumerate(losses):
            if loss_rank and dp == 0:
                print(f"{name} step {step} loss {loss:.6f}", flush=True)
        slowest = torch.tensor(statistics.median(times[1:] or times), dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        medians[name] = slowest.item()
    if dist.get_rank() == 0:
        line = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in medians.items())
        ratio = (f"; NaiveMuon / DMuon = {medians['NaiveMuon'] / medians['DMuon']:.2f}"
                 if len(medians) == 2 else "")
        print(f"optimizer step (median, slowest rank): {line}{ratio}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
