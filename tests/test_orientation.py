"""Plans with `orientation` (dmuon.plan.orientation): tall and wide matrices never share a batch, the plan
stays valid (lower bound, JSON), off changes nothing, and the runtime turns it on exactly where its NS
iterates tall matrices as they are, so every plan batch is one NS call of the runtime."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dist_utils import run_distributed
from hypothesis import HealthCheck, given, settings
from test_balance import A800, _check_plan, instances

from dmuon.errors import InputError
from dmuon.newton_schulz import NSConfig
from dmuon.plan.build import build_plan
from dmuon.plan.types import MatrixSpec, Plan
from dmuon.runtime.planning import ConfigCost, FlopCost, tall_as_is_shapes
from simulator.models.workload import load_workload

BENCH = ("qwen2.5-7b", 1 / 16, 4)  # the bench model of `harness bench step` (workload, width scale, blocks)


def _tall(plan: Plan, i: int) -> bool:
    return plan.matrices[i].rows > plan.matrices[i].cols


def _timeless(plan: Plan) -> Plan:
    return replace(plan, solve_time_s=0.0)


def _mixed(plan: Plan) -> list:
    return [b for b in plan.batches if len({_tall(plan, i) for i in b.members}) > 1]


@given(instances())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_orientation_keeps_tall_and_wide_apart_and_the_plan_valid(inst):
    mats, ranks, max_batch = inst
    for balancer in ("lpt", "round_robin"):
        plan = build_plan(mats, ranks, A800, balancer=balancer, max_batch=max_batch, orientation=True)
        _check_plan(plan, ranks)  # every matrix once, prices, lower bound <= makespan
        assert not _mixed(plan)
        assert Plan.from_json(plan.to_json()) == plan
        # finer classes: on one rank (where no balancer can place the members differently) never a batch
        # more than the members' orientations make necessary; on more ranks the balancer may place a
        # class's members on other owners than without orientation, at no worse makespan, so the
        # count is not comparable there (e.g. lpt, 2 ranks, max_batch 3: 3 tall + 1 wide 256 x 1024
        # went 3 + 1 on one owner without it, 2 + 1 and 1 with it)
        off = build_plan(mats, 1, A800, balancer=balancer, max_batch=max_batch)
        one = build_plan(mats, 1, A800, balancer=balancer, max_batch=max_batch, orientation=True)
        assert len(one.batches) <= len(off.batches) + len(_mixed(off))


def test_orientation_splits_mixed_batches_and_off_changes_nothing():
    mats = load_workload("qwen2.5-7b").scaled(1 / 16, blocks=4).muon_matrices
    off = build_plan(mats, 1, A800, balancer="lpt")
    assert _mixed(off)  # gate / up (tall) batched with down (wide): the case orientation is for
    for same in (False, ()):
        assert _timeless(build_plan(mats, 1, A800, balancer="lpt", orientation=same)) == _timeless(off)
    on = build_plan(mats, 1, A800, balancer="milp", orientation=True)
    assert not _mixed(on) and on.makespan_s >= on.lower_bound_s
    assert any(n.startswith("orientation: tall and wide") and "1184x224 apart from 224x1184" in n
               for n in on.notes)
    back = Plan.from_json(on.to_json())
    assert back == on and back.to_json() == on.to_json()
    # only the shapes named are kept apart
    some = build_plan(mats, 1, A800, balancer="lpt", orientation=[(224, 1184)])
    assert not _mixed(some)


def test_orientation_of_one_shape_only_leaves_other_batches_alone():
    mats = [MatrixSpec(f"l{k}.{n}", r, c, k) for k in range(3)
            for n, (r, c) in enumerate([(64, 256), (256, 64), (128, 512), (512, 128)])]
    plan = build_plan(mats, 1, A800, balancer="lpt", orientation=[(64, 256)])
    kinds = {(b.rows, b.cols): set() for b in plan.batches}
    for b in plan.batches:
        kinds[(b.rows, b.cols)].add(frozenset(_tall(plan, i) for i in b.members))
    assert kinds[(64, 256)] <= {frozenset({True}), frozenset({False})}
    assert frozenset({True, False}) in kinds[(128, 512)]


@pytest.mark.parametrize("bad", [[(5, 3)], [(0, 4)], [(4,)], "yes", 3, [(2.0, 4)]])
def test_orientation_rejects_bad_input(bad):
    mats = [MatrixSpec("a", 4, 8), MatrixSpec("b", 8, 4)]
    with pytest.raises(InputError, match=r"orientation must be True, False or a collection of NS shapes"):
        build_plan(mats, 1, A800, orientation=bad)


def test_the_runtime_asks_for_orientation_where_its_ns_runs_tall_matrices_as_they_are():
    specs = load_workload(BENCH[0]).scaled(BENCH[1], blocks=BENCH[2]).muon_matrices
    cpu = torch.device("cpu")

    def shapes(**ns):
        cfg = NSConfig(**ns)
        return tall_as_is_shapes(specs, ConfigCost(FlopCost(), cfg, cpu), cfg, cpu)

    everything = {(min(s.shape), max(s.shape)) for s in specs}
    assert shapes(method="standard", kernels="torch") == everything
    assert shapes(method="standard", dtype="bf16") == everything
    assert shapes(method="gram") == everything  # Gram NS with torch ops: R = X^T X, result X Q
    assert shapes(method="auto") == everything
    # the Triton kernels take the wide orientation: tall matrices are transposed, one stack either way
    assert shapes(method="gram", kernels="triton") == frozenset()
    assert shapes(method="standard", kernels="triton") == frozenset()


def _count_calls(rank, world_size, cases):
    """Per case: NS calls of each step (orthogonalize patched to count) and this rank's plan batches."""
    import dmuon.runtime.base as base
    from simulator.models.benchmodel import bench_optimizer, build_bench_model, synthetic_batch

    calls = [0]
    real = base.orthogonalize

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    base.orthogonalize = counted
    out = {}
    workload = load_workload(BENCH[0]).scaled(BENCH[1], blocks=BENCH[2])
    for layout, method, dtype in cases:
        model = build_bench_model(workload, seed=0, device=torch.device("cpu"), dtype=torch.float32)
        opt = bench_optimizer("dmuon", model, overlap=True, exchange="auto", layout=layout,
                              ns=NSConfig(method=method, dtype=dtype))
        per_step = []
        for it in range(2):
            x, y = synthetic_batch(model.vocab, 16, 1, seed=0, step=it, rank=rank, device=torch.device("cpu"))
            model(x, y).backward()
            calls[0] = 0
            opt.step()
            opt.zero_grad()
            per_step.append(calls[0])
        plan = opt.plan
        out[(layout, method, dtype)] = dict(calls=per_step, batches=len(plan.batches_of(rank)),
                                            mixed=len([b for b in _mixed(plan) if b.owner == rank]))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size,layout", [(1, "ddp"), (2, "fsdp2-sharded")])
def test_plan_batches_are_the_runtime_ns_calls_on_the_bench_model(world_size, layout):
    cases = [(layout, "standard", "bf16"), (layout, "standard", "fp32"), (layout, "auto", None)]
    for rank, res in enumerate(run_distributed(_count_calls, world_size, (cases,), timeout_s=200)):
        for case, r in res.items():
            assert r["calls"] == [r["batches"]] * 2, f"rank {rank} {case}: {r}"
            if case[1] == "standard":
                assert r["mixed"] == 0, f"rank {rank} {case}: {r}"
