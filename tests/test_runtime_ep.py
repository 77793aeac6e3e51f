"""EPMuon (dmuon.runtime.ep) on gloo ranks: a tiny MoE whose experts are 3-D parameters (E_local, out, in)
under expert parallelism gives single-process Muon's update over the dense matrices and every expert
matrix (each expert its own matrix), with the averaged gradients, over several steps."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

E, HID, INTER, LAYERS, STEPS = 8, 16, 24, 2, 3


class Experts(torch.nn.Module):
    def __init__(self, e_local: int):
        super().__init__()
        self.w_up = torch.nn.Parameter(torch.zeros(e_local, INTER, HID))
        self.w_down = torch.nn.Parameter(torch.zeros(e_local, HID, INTER))


class Layer(torch.nn.Module):
    def __init__(self, e_local: int):
        super().__init__()
        self.q = torch.nn.Linear(HID, HID, bias=False)
        self.norm = torch.nn.LayerNorm(HID)
        self.mlp = torch.nn.Module()
        self.mlp.experts = Experts(e_local)


class TinyMoE(torch.nn.Module):
    def __init__(self, e_local: int):
        super().__init__()
        self.embed = torch.nn.Embedding(32, HID)
        self.layers = torch.nn.ModuleList(Layer(e_local) for _ in range(LAYERS))


def _seed(*key) -> int:
    return sum((k + 1) * 1000003 ** j for j, k in enumerate(key)) % (2**31)


def run_ep(rank: int, world: int, ep: int):
    from dmuon.optim import Muon
    from dmuon.plan.cost import CostTable
    from dmuon.runtime.ep import EPMuon

    e_local, k, replica = E // ep, rank % ep, rank // ep
    model = TinyMoE(e_local)
    full = {}  # the full model's values (every expert), identical on every rank
    for idx, (name, p) in enumerate(model.named_parameters()):
        shape = (E, *p.shape[1:]) if p.dim() == 3 else p.shape
        full[name] = torch.randn(*shape, generator=torch.Generator().manual_seed(_seed(idx, 7)))
        with torch.no_grad():
            p.copy_(full[name][k * e_local:(k + 1) * e_local] if p.dim() == 3 else full[name])
    opt = EPMuon(model, ep=ep, lr=0.05, weight_decay=0.01, cost=CostTable.load("a800"))
    # the reference: every dense matrix and every expert as its own 2-D parameter, one process
    ref_muon, ref_adamw, ref_of = [], [], {}
    for name, p in model.named_parameters():
        if p.dim() == 3:
            ref_of[name] = [torch.nn.Parameter(full[name][e].clone()) for e in range(E)]
            ref_muon += [(f"{name}.{e}", t) for e, t in enumerate(ref_of[name])]
        else:
            ref_of[name] = torch.nn.Parameter(full[name].clone())
            (ref_muon if p.dim() == 2 and "embed" not in name else ref_adamw).append((name, ref_of[name]))
    ref = Muon([{"params": ref_muon, "use_muon": True}, {"params": ref_adamw, "use_muon": False}], lr=0.05,
               weight_decay=0.01)
    for step in range(STEPS):
        for idx, (name, p) in enumerate(model.named_parameters()):
            if p.dim() == 3:  # this replica's gradient of every expert; the true one is the replica mean
                per = [torch.randn(*p.shape[1:],
                                   generator=torch.Generator().manual_seed(_seed(step, idx, j, e)))
                       for j in range(world // ep) for e in range(E)]
                per = torch.stack(per).reshape(world // ep, E, *p.shape[1:])
                p.grad = per[replica, k * e_local:(k + 1) * e_local].clone()
                for e in range(E):
                    ref_of[name][e].grad = per[:, e].mean(0)
            else:  # this rank's gradient; the true one is the mean over ranks
                per = torch.stack([torch.randn(*p.shape, generator=torch.Generator().manual_seed(
                    _seed(step, idx, r, 99))) for r in range(world)])
                p.grad = per[rank].clone()
                ref_of[name].grad = per.mean(0)
        opt.step()
        ref.step()
    worst = 0.0
    for name, p in model.named_parameters():
        want = (torch.stack(ref_of[name])[k * e_local:(k + 1) * e_local] if p.dim() == 3 else ref_of[name])
        worst = max(worst, ((p.detach() - want.detach()).norm() / want.detach().norm()).item())
    owned_experts = sum(1 for i, o in enumerate(opt.plan.owners) if o == rank and opt._is_expert(i))
    return worst, owned_experts, opt.plan.ep


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (4, 4)])
def test_ep_muon_equals_single_process_muon(world, ep):
    results = run_distributed(run_ep, world, (ep,), timeout_s=240)
    for worst, _, plan_ep in results:
        assert plan_ep == ep
        assert worst < 1e-5, results
    # every expert matrix of every layer has exactly one owner
    assert sum(r[1] for r in results) == LAYERS * 2 * E
