"""DMuon inside pipeline stages (docs/runtime.md, "Pipeline parallelism"): 4 gloo ranks on a (pp=2, dp=2)
DeviceMesh, `torch.distributed.pipelining`, one optimizer per rank over its stage's data-parallel group
(`process_group=mesh["dp"].get_group()`), the whole model routed once (`muon_predicate` from the full
model), the schedule inside `opt.no_sync()`; the model and stage split of examples/train_pp.py. After 2
steps every rank's parameters equal single-process `dmuon.Muon` on the full model and the full batch
within 1e-5 (fp32): 1F1B (2 micro-batches) with DMuon and NaiveMuon in the replicated, fsdp2-sharded and
fsdp2-owner layouts, and ScheduleZBVZeroBubble (two stages per rank, FSDP2 on each) with DMuon. Ranks of
one dp group that hand the optimizer different parameters get a one-line error on each of them (the
other stage is not held up)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

V, D, T, B, MICRO, STEPS = 16, 16, 4, 8, 2, 2  # vocab, width, tokens, global batch, micro-batches, steps
LAYOUTS = ("replicated", "fsdp2-sharded", "fsdp2-owner")
KW = dict(lr=0.02, adamw_lr=0.01)


def example():
    """examples/train_pp.py as a module: its model, stage split (`stage_parts`), `prune` and loss."""
    spec = importlib.util.spec_from_file_location(
        "train_pp", Path(__file__).resolve().parents[1] / "examples" / "train_pp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EX = example()
STAGES = EX.stage_parts(4, 2)  # 1F1B: one stage per rank
STAGES4 = EX.stage_parts(4, 4)  # ZBV: stages pp and 3 - pp on rank pp
prune, loss_fn = EX.prune, EX.loss_fn


def net():
    return EX.Model(V, D, 4)


def modules_of(names) -> set[str]:
    from dmuon.runtime.model import layer_key

    return {layer_key(n) for n in names}


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def reference(full, predicate) -> dict[str, torch.Tensor]:
    from dmuon import Muon

    model = copy.deepcopy(full)
    opt = Muon(model, muon_predicate=predicate, **KW)
    for step in range(STEPS):
        x, y = data(step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def pipeline_run(full, predicate, mesh, cls, layout: str, schedule: str = "Schedule1F1B"):
    """STEPS steps of `schedule` on this rank's stages (1F1B: stage pp of STAGES; ZBV: stages pp and
    3 - pp of STAGES4, two stage modules sharing one optimizer), the stage parameters after them."""
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard

    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    parts = STAGES if schedule == "Schedule1F1B" else STAGES4
    mine = (pp,) if schedule == "Schedule1F1B" else (pp, 3 - pp)
    model = prune(full, set().union(*(parts[s] for s in mine)))  # this rank's parameters
    modules = [model] if len(mine) == 1 else [prune(model, parts[s], share=True) for s in mine]
    for m in modules if layout != "replicated" else ():
        ignored = {p for n, p in m.named_parameters() if predicate(n, p)} if layout == "fsdp2-owner" else None
        fully_shard(m, mesh=mesh["dp"], ignored_params=ignored)
    opt = cls(model, process_group=mesh["dp"].get_group(), muon_predicate=predicate, layout=layout, **KW)
    stages = [pipelining.PipelineStage(m, s, len(parts), torch.device("cpu"), group=mesh["pp"].get_group())
              for m, s in zip(modules, mine, strict=True)]
    micro = MICRO * len(mine)
    sched = getattr(pipelining, schedule)(stages if len(stages) > 1 else stages[0], n_microbatches=micro,
                                          loss_fn=loss_fn)
    rows = slice(dp * B // 2, (dp + 1) * B // 2)  # this dp rank's half of the global batch
    for step in range(STEPS):
        x, y = data(step)
        args = (x[rows],) if 0 in mine else ()
        kwargs = {"target": y[rows]} if len(parts) - 1 in mine else {}
        with opt.no_sync():  # one gradient exchange per step, at step(), of the micro-batches' sum
            sched.step(*args, **kwargs)
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
    full = net()
    muon = {r.name for r in route(full) if r.use_muon}  # routed once, on the full model
    predicate = lambda name, p: name in muon  # noqa: E731
    ref = reference(full, predicate)
    out = {"muon": sorted(muon)}
    runs = [(cls, layout, "Schedule1F1B") for cls in (DMuon, NaiveMuon) for layout in LAYOUTS]
    for cls, layout, schedule in runs + [(DMuon, "fsdp2-sharded", "ScheduleZBVZeroBubble")]:
        got = pipeline_run(full, predicate, mesh, cls, layout, schedule)
        out[(cls.__name__, layout, schedule)] = (sorted(got), max((got[n] - ref[n]).abs().max().item()
                                                                  for n in got))
    # stage 0's second dp rank hands the optimizer another stage's module: both ranks of its group refuse
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    wrong = prune(full, STAGES[1 if (pp, dp) == (0, 1) else pp])
    try:
        DMuon(wrong, process_group=mesh["dp"].get_group(), muon_predicate=predicate, **KW).close()
        out["mismatch"] = None
    except InputError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_cases, 4, timeout_s=240)  # a bound on hangs: ~11 s on 2 idle cores


def test_the_whole_model_is_routed_once():
    torch.manual_seed(0)
    from dmuon.params import route

    names = sorted(r.name for r in route(net()) if r.use_muon)
    assert names == [f"blocks.{i}.{w}.weight" for i in range(4) for w in ("down", "up")]  # not embed, head


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cls", ["DMuon", "NaiveMuon"])
def test_1f1b_stages_match_single_process_muon(results, cls, layout):
    for rank, res in enumerate(results):
        names, err = res[(cls, layout, "Schedule1F1B")]
        assert modules_of(names) == STAGES[rank // 2]  # the stage's own parameters
        assert err < 1e-5, (rank, err)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_zero_bubble_with_fsdp2_matches_single_process_muon(results):
    """ScheduleZBVZeroBubble: two stages per rank (split backward: input, then weight gradients), FSDP2
    on each stage module, one DMuon over both."""
    for rank, res in enumerate(results):
        names, err = res[("DMuon", "fsdp2-sharded", "ScheduleZBVZeroBubble")]
        pp = rank // 2
        assert modules_of(names) == STAGES4[pp] | STAGES4[3 - pp]
        assert err < 1e-5, (rank, err)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ranks_of_a_dp_group_must_hold_the_same_stage(results):
    for rank in (0, 1):  # stage 0's dp group: rank 1 passed stage 1's module
        msg = results[rank]["mismatch"]
        assert msg is not None and "\n" not in msg
        assert "has other parameters than rank" in msg and "mesh['dp'].get_group()" in msg
        assert "blocks.0.up.weight" in msg and "blocks.2.up.weight" in msg, msg
    assert results[2]["mismatch"] is None and results[3]["mismatch"] is None  # stage 1 went on
