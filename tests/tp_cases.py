"""Scenarios of tests/test_runtime_tp.py, run inside 4 spawned gloo ranks (one spawn, one process group for
all of them), and their single-process Muon reference. A tiny model whose blocks have every TP case:
column-parallel tall (w1, w3: 32x16, rows = long side), row-parallel wide (w2: 16x32), square (wq, wv,
wo) and matrices cut along their short side (wk: 8x16 column-parallel, wk2: 16x8 row-parallel)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

DIM, FFN, KV, VOCAB, BATCH, SEQ, STEPS = 16, 32, 8, 24, 4, 3, 2
LR, ADAMW_LR = 0.02, 1e-3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wv, self.wo = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False), \
            nn.Linear(DIM, DIM, bias=False)
        self.wk, self.wk2 = nn.Linear(DIM, KV, bias=False), nn.Linear(KV, DIM, bias=False)
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        x = x + self.wo(torch.tanh(self.wq(x)) * torch.sigmoid(self.wv(x)))
        x = x + self.wk2(torch.tanh(self.wk(x)))
        return x + self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.layers:
            x = b(x)
        return self.lm_head(x)


TP_PLAN = {"wq": "col", "wv": "col", "wk": "col", "w1": "col", "w3": "col", "wo": "row", "wk2": "row",
           "w2": "row"}


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model, tokens, target):
    return torch.nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), target.reshape(-1))


def fresh_model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def reference(steps: int = STEPS) -> list[dict]:
    """Single-process Muon on the full batch: the parameters after each step."""
    from dmuon import Muon

    model = fresh_model()
    opt = Muon(model, lr=LR, adamw_lr=ADAMW_LR)
    out = []
    for s in range(steps):
        opt.zero_grad()
        loss_of(model, *data(s)).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def errors() -> dict:
    """The one-line errors for what a TP mesh does not accept (construction only, no step)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import dmuon

    def tiny(rows):
        m = nn.Module()
        m.embed = nn.Embedding(VOCAB, DIM)
        m.layers = nn.ModuleList([nn.Linear(DIM, rows, bias=False), nn.Linear(rows, DIM, bias=False)])
        return m

    out = {}
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    m = tiny(30)  # 30 rows over tp 4
    parallelize_module(m.layers[0], mesh, ColwiseParallel())
    parallelize_module(m.layers[1], mesh, RowwiseParallel())
    try:
        dmuon.DMuon(m)
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["err_divide"] = f"{type(e).__name__}: {e}"
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = tiny(32)
    for lin in m.layers:
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh2, [Shard(1), Shard(0)]))
    try:
        dmuon.DMuon(m)
    except Exception as e:  # noqa: BLE001
        out["err_placement"] = f"{type(e).__name__}: {e}"
    return out


def build(kind: str, rank: int, grid: tuple[int, ...]):
    """A TP model on a mesh: kind 'tp' (1-D), 'fsdp_tp' (dp, tp), 'hsdp_tp' (replicate, shard, tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = {"tp": ("tp",), "fsdp_tp": ("dp", "tp"), "hsdp_tp": ("dp_replicate", "dp_shard", "tp")}[kind]
    mesh = init_device_mesh("cpu", grid, mesh_dim_names=names)
    model = fresh_model()
    for b in model.layers:
        parallelize_module(b, mesh["tp"], {k: ColwiseParallel() if v == "col" else RowwiseParallel()
                                           for k, v in TP_PLAN.items()})
    if kind != "tp":
        dp = mesh["dp"] if kind == "fsdp_tp" else mesh["dp_replicate", "dp_shard"]
        for b in model.layers:
            fully_shard(b, mesh=dp)
        fully_shard(model, mesh=dp)
    return model, mesh


def dp_coords(kind: str, mesh) -> tuple[int, int]:
    """(data-parallel index, data-parallel size) of this rank: its slice of the batch."""
    if kind == "tp":
        return 0, 1
    if kind == "fsdp_tp":
        return mesh.get_local_rank("dp"), mesh.size(0)
    return mesh.get_local_rank("dp_replicate") * mesh.size(1) + mesh.get_local_rank("dp_shard"), \
        mesh.size(0) * mesh.size(1)


def full_params(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def train(kind: str, grid, cls: str, steps: int = STEPS, nan_step: int | None = None, **kw):
    import dmuon

    rank = dist.get_rank()
    model, mesh = build(kind, rank, grid)
    opt = getattr(dmuon, cls)(model, lr=LR, adamw_lr=ADAMW_LR, **kw)
    d, n = dp_coords(kind, mesh)
    for s in range(steps):
        tokens, target = data(s)
        per = BATCH // n
        loss = loss_of(model, tokens[d * per:(d + 1) * per], target[d * per:(d + 1) * per])
        opt.zero_grad()
        loss.backward()
        if nan_step == s and rank == 1:
            g = model.layers[0].w1.weight.grad
            g.to_local().view(-1)[0] = float("nan")
        opt.step()
    opt.synchronize()
    return model, opt


def deviation(model, ref) -> float:
    got = full_params(model)
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


def run_all(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """Every scenario in one process group; returns max deviations and observations."""
    import dmuon
    from dmuon.plan.tp import tp_summary

    one, ref = reference()
    out: dict = {}
    runs = [("tp", (4,), "DMuon", {}), ("tp", (4,), "NaiveMuon", {}),
            ("fsdp_tp", (2, 2), "DMuon", {"tp_mode": "group"}), ("fsdp_tp", (2, 2), "NaiveMuon", {}),
            ("fsdp_tp", (2, 2), "DMuon", {"tp_mode": "gather", "comm_dtype": "bf16"}),
            ("hsdp_tp", (2, 1, 2), "DMuon", {})]
    for kind, grid, cls, kw in runs:
        model, opt = train(kind, grid, cls, **kw)
        key = f"{kind}/{cls}/{kw.get('tp_mode', 'auto')}" + ("/bf16" if "comm_dtype" in kw else "")
        out[key] = deviation(model, ref)
        out[key + "/type"] = type(opt).__name__
        if cls == "DMuon":
            s = tp_summary(opt.plan)
            out[key + "/modes"] = (s["group"]["count"], s["gather"]["count"])
            out[key + "/ns"] = opt.ns_matrices
        opt.close()
    # a NaN gradient on rank 1 at step 1: the step is skipped everywhere
    model, opt = train("fsdp_tp", (2, 2), "DMuon", nan_step=1, nonfinite="skip")
    out["nan_skipped"] = opt.skipped_steps
    out["nan_dev_vs_1_step"] = deviation(model, one)
    # DCP: save at (dp 2, tp 2), load at tp 4: weights and momentum re-sharded, one more step agrees
    dmuon.save_checkpoint(ckpt_dir, model, opt)
    opt.close()
    model2, _ = build("tp", rank, (4,))
    opt2 = dmuon.DMuon(model2, lr=LR, adamw_lr=ADAMW_LR)
    dmuon.load_checkpoint(ckpt_dir, model2, opt2)
    opt2.synchronize()
    out["reshard_weights"] = deviation(model2, one)
    out["reshard_momentum_shape"] = tuple(opt2.state[model2.layers[1].wk2.weight]["momentum_buffer"].shape)
    loss = loss_of(model2, *data(1))  # the step the NaN skipped, now at tp 4: two steps of Muon in all
    opt2.zero_grad()
    loss.backward()
    opt2.step()
    opt2.synchronize()
    out["reshard_then_step"] = deviation(model2, ref)
    opt2.close()
    out.update(errors())
    return out
