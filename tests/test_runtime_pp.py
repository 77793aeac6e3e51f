"""DMuon inside pipeline stages (docs/runtime.md, "Pipeline parallelism"): 4 gloo ranks on a (pp=2, dp=2)
DeviceMesh, `torch.distributed.pipelining` with a 1F1B schedule of 2 micro-batches, one optimizer per
rank over its stage's data-parallel group (`process_group=mesh["dp"].get_group()`), the whole model
routed once (`muon_predicate` from the full model). After 2 steps every stage's parameters equal
single-process `dmuon.Muon` on the full model and the full batch within 1e-5 (fp32): replicated dp and
FSDP2 on the dp dimension, DMuon and NaiveMuon. Ranks of one dp group that hand the optimizer different
parameters get a one-line error on each of them (the other stage is not held up)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dist_utils import run_distributed

V, D, T, B, MICRO, STEPS = 16, 16, 4, 8, 2, 2  # vocab, width, tokens, global batch, micro-batches, steps
STAGES = ({"embed", "layers.0", "layers.1"}, {"layers.2", "layers.3", "head"})
KW = dict(lr=0.02, adamw_lr=0.01)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): nn.Linear(D, D) for i in range(4)})
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        return self.head(h) if self.head is not None else h


def stage_module(full: Net, stage: int) -> Net:
    """The full model's copy with only this stage's modules (names kept, torchtitan-style)."""
    m = copy.deepcopy(full)
    keep = STAGES[stage]
    for k in list(m.layers):
        if f"layers.{k}" not in keep:
            del m.layers[k]
    for name in ("embed", "head"):
        if name not in keep:
            setattr(m, name, None)
    return m


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def reference(full: Net, predicate) -> dict[str, torch.Tensor]:
    from dmuon import Muon

    model = copy.deepcopy(full)
    opt = Muon(model, muon_predicate=predicate, **KW)
    for step in range(STEPS):
        x, y = data(step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def pipeline_run(full, predicate, mesh, cls, fsdp: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = stage_module(full, pp)
    if fsdp:
        fully_shard(model, mesh=mesh["dp"])
    opt = cls(model, process_group=mesh["dp"].get_group(), muon_predicate=predicate, **KW)
    mb = B // mesh["dp"].size() // MICRO
    inp = torch.zeros(mb, T, dtype=torch.long) if pp == 0 else torch.zeros(mb, T, D, requires_grad=True)
    out = torch.zeros(mb, T, D) if pp == 0 else torch.zeros(mb, T, V)
    stage = PipelineStage(model, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    for step in range(STEPS):
        x, y = data(step)
        rows = slice(dp * B // 2, (dp + 1) * B // 2)  # this dp rank's half of the global batch
        with opt.no_sync():  # one gradient exchange per step, at step(), of the micro-batches' sum
            if pp == 0:
                schedule.step(x[rows])
            else:
                schedule.step(target=y[rows])
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    got = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
           for n, p in model.named_parameters()}
    opt.close()
    return got


def run_cases(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon import DMuon, NaiveMuon
    from dmuon.errors import InputError
    from dmuon.params import route

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    full = Net()
    muon = {r.name for r in route(full) if r.use_muon}  # routed once, on the full model
    predicate = lambda name, p: name in muon  # noqa: E731
    ref = reference(full, predicate)
    out = {"muon": sorted(muon)}
    for cls in (DMuon, NaiveMuon):
        for fsdp in (False, True):
            got = pipeline_run(full, predicate, mesh, cls, fsdp)
            out[(cls.__name__, fsdp)] = (sorted(got), max((got[n] - ref[n]).abs().max().item() for n in got))
    # stage 0's second dp rank hands the optimizer another stage's module: both ranks of its group refuse
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    wrong = stage_module(full, 1 if (pp, dp) == (0, 1) else pp)
    try:
        DMuon(wrong, process_group=mesh["dp"].get_group(), muon_predicate=predicate, **KW).close()
        out["mismatch"] = None
    except InputError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_cases, 4, timeout_s=60)


def test_the_whole_model_is_routed_once():
    torch.manual_seed(0)
    from dmuon.params import route

    names = sorted(r.name for r in route(Net()) if r.use_muon)
    assert names == [f"layers.{i}.weight" for i in range(4)]  # embed and head go to AdamW


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("cls", ["DMuon", "NaiveMuon"])
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp2"])
def test_stages_match_single_process_muon(results, cls, fsdp):
    for rank, res in enumerate(results):
        names, err = res[(cls, fsdp)]
        stage = rank // 2
        assert {n.rsplit(".", 1)[0] for n in names} == STAGES[stage]  # the stage's own parameters
        assert err < 1e-5, (rank, err)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_ranks_of_a_dp_group_must_hold_the_same_stage(results):
    for rank in (0, 1):  # stage 0's dp group: rank 1 passed stage 1's module
        msg = results[rank]["mismatch"]
        assert msg is not None and "\n" not in msg
        assert "has other parameters than rank" in msg and "mesh['dp'].get_group()" in msg
        assert "layers.0.weight" in msg and "layers.2.weight" in msg, msg
    assert results[2]["mismatch"] is None and results[3]["mismatch"] is None  # stage 1 went on
