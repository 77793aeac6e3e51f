"""DMuon / NaiveMuon on tensor parallelism, the way a user writes it: a tiny Hugging Face Llama built from
its config class (never downloaded), TP alone and the torchtitan FSDP2 x TP recipe on 4 gloo ranks, each
compared with single-process `dmuon.Muon` on the same model and batch. Prints the max deviation per run.

    python scripts/tp_check.py                       # spawns 4 CPU ranks (mp.spawn)
    torchrun --nproc-per-node 4 scripts/tp_check.py  # the same under torchrun
Options: --steps N (3), --dtype fp32|bf16 wire (fp32: the comm_dtype of DMuon's gathers), --tp-mode
auto|group|gather (DMuon's mode per TP matrix; group where the shard cuts the long side).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist

WORLD = 4


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).float()


def batch(step: int, rows: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 128, (rows, seq), generator=g)


def loss_fn(model, ids):
    return model(input_ids=ids, labels=ids).loss


def tp_recipe(model, mesh):
    """torchtitan's Llama TP plan, one decoder layer at a time."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def run(kind: str, cls: str, steps: int, wire, tp_mode: str = "auto") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import dmuon

    model = llama()
    if kind == "tp":
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        tp_recipe(model, mesh["tp"])
        dp_rank, dp = 0, 1
    else:  # FSDP2 x TP: TP inside, then fully_shard over "dp"
        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
        tp_recipe(model, mesh["tp"])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_rank, dp = mesh.get_local_rank("dp"), 2
    kw = {"comm_dtype": wire} if wire else {}
    if cls == "DMuon":
        kw["tp_mode"] = tp_mode
    opt = getattr(dmuon, cls)(model, lr=0.02, adamw_lr=1e-3, **kw)
    for s in range(steps):
        ids = batch(s)
        per = ids.shape[0] // dp
        opt.zero_grad()
        loss_fn(model, ids[dp_rank * per:(dp_rank + 1) * per]).backward()
        opt.step()
    opt.synchronize()
    out = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
           for n, p in model.named_parameters()}
    opt.close()
    return out, type(opt).__name__


def reference(steps: int) -> dict:
    import dmuon

    model = llama()
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    for s in range(steps):
        opt.zero_grad()
        loss_fn(model, batch(s)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main(rank: int, args, port: int | None) -> None:
    if port is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=300))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    if dist.get_world_size() != WORLD:
        raise SystemExit(f"tp_check runs on {WORLD} ranks, got {dist.get_world_size()}")
    ref = reference(args.steps)
    wire = None if args.dtype == "fp32" else args.dtype
    for kind in ("tp", "fsdp_tp"):
        for cls in ("DMuon", "NaiveMuon"):
            got, name = run(kind, cls, args.steps, wire, args.tp_mode)
            dev = max((got[k] - ref[k]).abs().max().item() for k in ref)
            moved = max((ref[k] - llama_init[k]).abs().max().item() for k in ref)
            if dist.get_rank() == 0:
                print(f"{kind:8s} {cls:10s} ({name}): max |param - Muon| = {dev:.3g} "
                      f"(params moved up to {moved:.3g})", flush=True)
    dist.destroy_process_group()


llama_init = {}


def _entry(rank: int, args, port: int) -> None:
    llama_init.update({n: p.detach().clone() for n, p in llama().named_parameters()})
    main(rank, args, port)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--tp-mode", choices=("auto", "group", "gather"), default="auto")
    a = ap.parse_args()
    if "RANK" in os.environ:  # torchrun
        _entry(int(os.environ["RANK"]), a, None)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        torch.multiprocessing.spawn(_entry, args=(a, free), nprocs=WORLD)
