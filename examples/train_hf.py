"""Train a Hugging Face causal LM with DMuon on FSDP2, save a sharded checkpoint and resume from it.

    torchrun --nproc-per-node 2 examples/train_hf.py --config experiments/models/llama-3.1-70b/config.json \
        --layers 2 --hidden 256 --vocab 1024 --steps 5 --ckpt /tmp/train_hf_ckpt

The model is built by transformers from a local config.json (nothing is downloaded), shrunk by --layers /
--hidden / --vocab as `harness bench step --model` shrinks it (harness/hf_model.py says what changes).
It trains on synthetic sequences (labels = input_ids: the model shifts them and returns .loss). Runs on
GPUs (nccl, one per rank, bf16) or on CPUs (gloo, fp32). Needs `pip install transformers`.

What it shows, in order: FSDP2 sharding with `dmuon.shard_model`, `dmuon.DMuon` (Muon for the hidden
matrices, AdamW for embeddings, head, norms: `dmuon.route(model)` lists the decisions), the training
loop, `dmuon.save_checkpoint` (every rank writes its part) and `dmuon.load_checkpoint` into a freshly
built model and optimizer, and a check that the resumed run takes the same steps as the original one.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist

import dmuon
from harness.hf_model import build_model, shrunk_config


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a Hugging Face config.json (or a folder holding one)")
    p.add_argument("--layers", type=int, help="num_hidden_layers (default: the config's)")
    p.add_argument("--hidden", type=int, help="hidden size; intermediate sizes and head_dim scale with it")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the config's)")
    p.add_argument("--steps", type=int, default=5, help="steps before the checkpoint")
    p.add_argument("--resume-steps", type=int, default=2, help="steps compared after resuming")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--layout", default="fsdp2-owner", choices=["fsdp2-owner", "fsdp2-sharded"])
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate (AdamW: lr / 20)")
    p.add_argument("--ckpt", default="train_hf_ckpt", help="checkpoint folder")
    return p.parse_args()


def make_model_and_optimizer(raw, args, device, seed):
    """A fresh model (weights from `seed`), sharded with FSDP2, and its DMuon optimizer."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(raw, seed=seed, device=device, dtype=dtype)
    # fsdp2-owner: FSDP2 shards embeddings, head and norms; the Muon matrices stay whole and DMuon gives
    # each one owner, which orthogonalizes it and publishes the result (docs/fsdp.md)
    dmuon.shard_model(model, args.layout)
    opt = dmuon.DMuon(model, lr=args.lr, adamw_lr=args.lr / 20)
    return model, opt


def batch(vocab, args, step, device):
    """Synthetic sequences with something to learn: each token is the previous one + 1 (mod vocab), from
    a random start; different on every rank and step, the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    start = torch.randint(0, vocab, (args.batch, 1), generator=g)
    return ((start + torch.arange(args.seq_len)) % vocab).to(device)


def train_step(model, opt, tokens) -> float:
    loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach().float()
    dist.all_reduce(loss)  # the mean over ranks, for printing
    return loss.item() / dist.get_world_size()


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rank0 = dist.get_rank() == 0
    _, raw = shrunk_config(args.config, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    vocab = raw["vocab_size"]

    model, opt = make_model_and_optimizer(raw, args, device, seed=0)
    if rank0:
        n = sum(p.numel() for p in model.parameters())
        muon = sum(r.param.numel() for r in dmuon.route(model) if r.use_muon)  # what DMuon runs on Muon
        print(f"{raw['model_type']}: {n / 1e6:.2f}M parameters ({muon / 1e6:.2f}M on Muon), "
              f"{dist.get_world_size()} ranks, {args.layout}", flush=True)
    for step in range(args.steps):
        loss = train_step(model, opt, batch(vocab, args, step, device))
        if rank0:
            print(f"step {step} loss {loss:.4f}", flush=True)

    dmuon.save_checkpoint(args.ckpt, model, opt)  # every rank writes what it holds
    continued = [train_step(model, opt, batch(vocab, args, args.steps + i, device))
                 for i in range(args.resume_steps)]
    opt.synchronize()  # the last step's weight publications are still in flight: wait before closing
    opt.close()
    del model, opt

    # a fresh model (other random weights) and optimizer, loaded from the checkpoint
    model, opt = make_model_and_optimizer(raw, args, device, seed=1)
    dmuon.load_checkpoint(args.ckpt, model, opt)
    resumed = [train_step(model, opt, batch(vocab, args, args.steps + i, device))
               for i in range(args.resume_steps)]
    opt.synchronize()
    opt.close()
    # on CPUs the resumed steps repeat the continued ones bit for bit; GPU kernels (atomic adds, bf16)
    # are not bitwise reproducible, so there the check allows 1%
    tol = 1e-6 if device.type == "cpu" else 1e-2
    same = all(math.isclose(a, b, rel_tol=tol, abs_tol=tol) for a, b in zip(continued, resumed, strict=True))
    if rank0:
        for i, (a, b) in enumerate(zip(continued, resumed, strict=True)):
            print(f"step {args.steps + i} continued {a:.6f} resumed {b:.6f}", flush=True)
        print(f"resume {'matches' if same else 'DIFFERS'}: checkpoint in {args.ckpt}", flush=True)
    dist.destroy_process_group()
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
