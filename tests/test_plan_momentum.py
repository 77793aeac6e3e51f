"""The plan prices the owner's whole per-batch work: its NS call + its momentum pass (owner_momentum)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dmuon.plan.build import build_plan
from dmuon.plan.cost import CostTable
from dmuon.plan.momentum import MOMENTUM_OP, momentum_time
from dmuon.plan.types import Plan
from simulator.api import SimConfig, simulate
from simulator.models.workload import load_workload

A800 = CostTable.load("a800")


@pytest.fixture(scope="module")
def wall_oss():
    return load_workload("wall-oss").muon_matrices


def _true_loads(plan: Plan) -> list[float]:
    """Per rank: NS + the owner's momentum of every batch it runs (priced whatever the plan assumed)."""
    loads = [0.0] * plan.world_size
    for b in plan.batches:
        for r in b.ranks:
            loads[r] += b.ns_s + momentum_time(A800, b.rows * b.cols, b.size)
    return loads


def test_momentum_time_is_the_marginal_pass_cost():
    n = 2048 * 22016
    one = A800.elementwise_time(1, MOMENTUM_OP, "fp32").time_s
    t4 = momentum_time(A800, n, 4)
    assert t4 == pytest.approx(A800.elementwise_time(4 * n, MOMENTUM_OP, "fp32").time_s - one
                               + 4 * A800.per_tensor_time(MOMENTUM_OP, "fp32"))
    assert 0 < momentum_time(A800, n, 1) < t4
    assert momentum_time(object(), n, 4) == 0.0  # a table without elementwise pricing: NS alone


def test_plan_makespan_includes_owner_momentum(wall_oss):
    plan = build_plan(wall_oss, 64, A800, balancer="lpt")
    ns_only = build_plan(wall_oss, 64, A800, balancer="lpt", owner_momentum=False)
    for b in plan.batches:
        ns = A800.ns_time(b.rows, b.cols, b.size, b.method, plan.dtype).time_s
        assert b.momentum_s == pytest.approx(momentum_time(A800, b.rows * b.cols, b.size))
        assert b.time_s == pytest.approx(ns + b.momentum_s) and b.ns_s == pytest.approx(ns)
    assert plan.makespan_s == max(plan.loads_s) and plan.makespan_s > ns_only.makespan_s
    assert all(b.momentum_s == 0.0 and b.ns_s == b.time_s for b in ns_only.batches)
    assert any("momentum" in n for n in plan.notes)
    assert Plan.from_json(plan.to_json()) == plan
    assert "momentum_s" not in ns_only.to_json()  # NS-only plans serialize as before
    with pytest.raises(ValueError, match="owner_momentum must be True or False"):
        build_plan(wall_oss, 8, A800, owner_momentum="yes")


@pytest.mark.parametrize("balancer", ["lpt", "milp"])
def test_momentum_heavy_batch_is_spread(wall_oss, balancer):
    # NS-only balancing stacks four 2048 x 22016 matrices on one rank at 256 ranks (their batched NS fits
    # under the largest call); with their momentum priced, the plan spreads them and its true makespan falls
    ns_only = build_plan(wall_oss, 256, A800, balancer=balancer, owner_momentum=False)
    plan = build_plan(wall_oss, 256, A800, balancer=balancer)
    wide = (2048, 22016)
    assert max(b.size for b in ns_only.batches if (b.rows, b.cols) == wide) > 1
    assert max(b.size for b in plan.batches if (b.rows, b.cols) == wide) < max(
        b.size for b in ns_only.batches if (b.rows, b.cols) == wide)
    assert max(_true_loads(plan)) < 0.8 * max(_true_loads(ns_only))
    assert max(_true_loads(plan)) == pytest.approx(plan.makespan_s)


def test_simulator_prices_momentum_once(wall_oss):
    # the same owners and batches with and without the plan's momentum_s: the simulator's optimizer phase
    # is the same (it prices the momentum itself, once), and its NS makespan is the plan's NS part
    plan = build_plan(wall_oss, 64, A800, balancer="lpt", method="auto")
    stripped = replace(plan, batches=tuple(replace(b, time_s=b.ns_s, momentum_s=0.0) for b in plan.batches))
    a = simulate(SimConfig(workload="wall-oss", gpus=64, strategy="dmuon", plan=plan))
    b = simulate(SimConfig(workload="wall-oss", gpus=64, strategy="dmuon", plan=stripped))
    assert a.optimizer_s == pytest.approx(b.optimizer_s, rel=1e-12)
    assert a.ns_makespan_s == pytest.approx(b.ns_makespan_s, rel=1e-12)
    assert b.ns_makespan_s == pytest.approx(max(stripped.loads_s), rel=1e-12)
