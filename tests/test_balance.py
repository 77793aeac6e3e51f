"""Balancers: properties on random small inputs (hypothesis) and targeted cases (bounds, caps, fallback)."""

from __future__ import annotations

import sys
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmuon.errors import InputError
from dmuon.plan.balance import STATE_BYTES_PER_ELEMENT, build_work_model
from dmuon.plan.build import build_plan
from dmuon.plan.cost import CostTable
from dmuon.plan.momentum import momentum_time
from dmuon.plan.types import MatrixSpec, Plan

A800 = CostTable.load("a800")
SHAPES = [(256, 1024), (1024, 256), (1024, 4096), (2048, 2048), (2048, 8192), (3584, 18944), (512, 512)]


@st.composite
def instances(draw):
    kinds = draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4, unique=True))
    layers = draw(st.integers(1, 6))
    per_layer = [draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=4)) for _ in range(layers)]
    mats = [
        MatrixSpec(f"l{layer}.m{j}", r, c, layer)
        for layer, shapes in enumerate(per_layer)
        for j, (r, c) in enumerate(shapes)
    ]
    ranks = draw(st.integers(1, 6))
    max_batch = draw(st.integers(1, 8))
    return mats, ranks, max_batch


def _check_plan(plan: Plan, ranks: int) -> None:
    n = len(plan.matrices)
    assert len(plan.owners) == n and all(0 <= o < ranks for o in plan.owners)
    members = sorted(i for b in plan.batches for i in b.members)
    assert members == list(range(n))  # every matrix in exactly one batch
    for b in plan.batches:
        for i in b.members:
            m = plan.matrices[i]
            assert plan.owners[i] == b.owner and (min(m.shape), max(m.shape)) == (b.rows, b.cols)
        single = (A800.ns_time(b.rows, b.cols, 1, b.method, plan.dtype).time_s
                  + momentum_time(A800, b.rows * b.cols, 1))  # NS + the owner's momentum (default)
        assert b.time_s <= b.size * single * (1 + 1e-12)  # a batch never costs more than its members singly
    assert max(plan.loads_s) == pytest.approx(plan.makespan_s, rel=1e-12)
    assert plan.makespan_s >= plan.lower_bound_s * (1 - 1e-12)  # the lower bound is a theorem
    assert sorted(i for bk in plan.buckets for i in bk.members) == list(range(n))


@given(instances())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_greedy_balancers_properties(inst):
    mats, ranks, max_batch = inst
    for balancer in ("round_robin", "lpt"):
        plan = build_plan(mats, ranks, A800, balancer=balancer, max_batch=max_batch)
        _check_plan(plan, ranks)
        assert Plan.from_json(plan.to_json()) == plan
        again = build_plan(mats, ranks, A800, balancer=balancer, max_batch=max_batch)
        assert again.owners == plan.owners and again.batches == plan.batches  # deterministic
    # Graham's bound for LPT: makespan <= sum of single-matrix times / N + the largest single time
    singles = [A800.ns_time(m.rows, m.cols, 1, "gram_sym", "bf16").time_s + momentum_time(A800, m.numel, 1)
               for m in mats]  # each matrix's NS + its owner's momentum
    lpt = build_plan(mats, ranks, A800, balancer="lpt", max_batch=max_batch)
    assert lpt.makespan_s <= sum(singles) / ranks + max(singles) + 1e-15


@given(instances())
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_milp_is_valid_and_never_worse_than_lpt(inst):
    mats, ranks, max_batch = inst
    lpt = build_plan(mats, ranks, A800, balancer="lpt", max_batch=max_batch)
    milp = build_plan(mats, ranks, A800, balancer="milp", max_batch=max_batch, time_limit_s=2.0)
    _check_plan(milp, ranks)
    assert milp.makespan_s <= lpt.makespan_s * (1 + 1e-9)
    proven = milp.makespan_s * (1 - milp.gap)
    assert milp.lower_bound_s * (1 - 1e-9) <= proven <= milp.makespan_s * (1 + 1e-12)
    assert Plan.from_json(milp.to_json()) == milp


@given(st.lists(st.integers(1, 9), min_size=2, max_size=5, unique=True), st.data())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_milp_solves_scheduling_instances_lpt_gets_wrong(sizes, data):
    # no batching gain, integer job times: the textbook P||Cmax instances where greedy is often not optimal
    cost = _UnitCost({(10 * (k + 1), 10 * (k + 1)): float(t) for k, t in enumerate(sizes)})
    counts = [data.draw(st.integers(1, 2)) for _ in sizes]
    mats = [
        MatrixSpec(f"k{k}.{j}", 10 * (k + 1), 10 * (k + 1), j)
        for k in range(len(sizes))
        for j in range(counts[k])
    ]
    ranks = data.draw(st.integers(2, 3))
    lpt = build_plan(mats, ranks, cost, balancer="lpt", batching=False)
    milp = build_plan(mats, ranks, cost, balancer="milp", batching=False, time_limit_s=2)
    assert milp.makespan_s <= lpt.makespan_s + 1e-9
    assert milp.makespan_s >= milp.lower_bound_s - 1e-9
    optimum = _brute_force(mats, cost, ranks)  # <= 10 matrices on <= 3 ranks
    assert milp.makespan_s * (1 - milp.gap) <= optimum + 1e-9  # the proven bound is a true bound
    if milp.gap <= 1e-9:  # proven optimal
        assert milp.makespan_s == pytest.approx(optimum)


def _brute_force(mats, cost, ranks) -> float:
    import itertools

    times = [cost.single[(m.rows, m.cols)] for m in mats]
    best = float("inf")
    for assign in itertools.product(range(ranks), repeat=len(times)):
        if assign[0] != 0:
            continue
        loads = [0.0] * ranks
        for t, r in zip(times, assign, strict=True):
            loads[r] += t
        best = min(best, max(loads))
    return best


def test_milp_finds_the_optimum_where_lpt_does_not():
    # 5 equal matrices on 2 ranks without batching: LPT and the optimum both 3 units; add a 2-unit-ish
    # job set where greedy is known to be suboptimal: sizes {3, 3, 2, 2, 2} on 2 ranks (LPT 7, opt 6).
    cost = _UnitCost({(100, 100): 3.0, (80, 80): 2.0})
    mats = [MatrixSpec(f"a{i}", 100, 100, i) for i in range(2)] + [
        MatrixSpec(f"b{i}", 80, 80, 2 + i) for i in range(3)
    ]
    lpt = build_plan(mats, 2, cost, balancer="lpt", batching=False)
    milp = build_plan(mats, 2, cost, balancer="milp", batching=False, time_limit_s=5)
    assert lpt.makespan_s == pytest.approx(7.0)
    assert milp.makespan_s == pytest.approx(6.0) and milp.gap == pytest.approx(0.0, abs=1e-6)


class _UnitCost:
    """A cost table with fixed per-matrix times and no batching gain: textbook scheduling instances."""

    name = "unit"

    def __init__(self, single: dict[tuple[int, int], float]):
        self.single = single

    def ns_time(self, rows, cols, batch=1, method="gram_sym", dtype="bf16"):
        from dmuon.plan.cost import CostAnswer

        return CostAnswer(batch * self.single[(min(rows, cols), max(rows, cols))], False, "unit")


def test_lower_bound_pigeonhole_term():
    # 3 equal large matrices on 2 ranks: some rank runs two of them, the bound knows it
    mats = [MatrixSpec(f"w{i}", 4096, 14336, i) for i in range(3)]
    model = build_work_model(mats, 2, A800)
    terms = model.lower_bound_terms()
    one = A800.ns_time(4096, 14336, 1).time_s + momentum_time(A800, 4096 * 14336, 1)
    two = min(A800.ns_time(4096, 14336, 2).time_s + momentum_time(A800, 4096 * 14336, 2), 2 * one)
    assert terms["pigeonhole 4096x14336"] == pytest.approx(two)
    plan = build_plan(mats, 2, A800, balancer="lpt")
    assert plan.makespan_s == pytest.approx(plan.lower_bound_s) and plan.efficiency == pytest.approx(1.0)


def test_round_robin_follows_layer_order():
    mats = [MatrixSpec(f"m{i}", 64, 256, layer=i // 2) for i in range(10)]
    plan = build_plan(mats, 3, A800, balancer="round_robin")
    assert plan.owners == tuple(i % 3 for i in range(10))


def test_batching_off_and_batch_readiness_order():
    mats = [MatrixSpec(f"m{i}", 256, 1024, layer=i) for i in range(12)]
    plan = build_plan(mats, 2, A800, balancer="lpt")
    assert max(b.size for b in plan.batches) > 1  # small matrices are batched
    for r in range(2):  # a rank's batches in the order their gradients complete in backward
        firsts = [min(mats[i].layer for i in b.members) for b in plan.batches_of(r)]
        assert firsts == sorted(firsts, reverse=True)
    off = build_plan(mats, 2, A800, balancer="lpt", batching=False)
    assert all(b.size == 1 for b in off.batches) and off.makespan_s > plan.makespan_s


@pytest.mark.parametrize("balancer", ["round_robin", "lpt", "milp"])
def test_memory_cap_holds(balancer):
    mats = [MatrixSpec(f"big{i}", 2048, 8192, i) for i in range(4)] + [
        MatrixSpec(f"small{i}", 512, 2048, i) for i in range(12)
    ]
    per_big = 2048 * 8192 * STATE_BYTES_PER_ELEMENT
    cap = per_big * 1.2  # one big matrix per rank at most
    plan = build_plan(mats, 4, A800, balancer=balancer, memory_cap_bytes=cap, time_limit_s=3)
    for r in range(4):
        owned = sum(plan.matrices[i].numel for i in plan.owned_by(r)) * STATE_BYTES_PER_ELEMENT
        assert owned <= cap
    with pytest.raises(InputError, match="below the owned state of one matrix"):
        build_plan(mats, 4, A800, memory_cap_bytes=per_big / 2)
    with pytest.raises(InputError, match="cannot hold the owned state"):
        build_plan(mats, 2, A800, memory_cap_bytes=cap)


def test_grouped_milp_with_memory_cap_is_valid():
    from dmuon.plan.balance import rank_load_s, rank_state_bytes
    from dmuon.plan.milp import solve_milp

    # 2 x 3 units + 3 x 2 units on 2 ranks: LPT gives 7, the bound 6, so the solver runs
    cost = _UnitCost({(100, 100): 3.0, (80, 80): 2.0})
    mats = [MatrixSpec(f"a{i}", 100, 100, i) for i in range(2)] + [
        MatrixSpec(f"b{i}", 80, 80, 2 + i) for i in range(3)
    ]
    cap = 100 * 100 * STATE_BYTES_PER_ELEMENT * 3
    model = build_work_model(mats, 2, cost, batching=False, memory_cap_bytes=cap)
    res = solve_milp(model, time_limit_s=3, max_exact_vars=2)  # forces rank groups
    assert any("aggregated into" in n for n in res.notes)
    counts = [sum(sum(r.get(s, ())) for r in res.loads) for s in range(len(model.classes))]
    assert counts == [c.count for c in model.classes]
    assert all(rank_state_bytes(model, r) <= cap for r in res.loads)
    assert 6.0 <= max(rank_load_s(model, r) for r in res.loads) <= 7.0


def test_anti_affinity_spreads_a_layer_over_owners_without_changing_loads():
    mats = [MatrixSpec(f"l{layer}.{j}", 1024, 4096, layer) for layer in range(4) for j in range(3)]
    plain = build_plan(mats, 3, A800, balancer="lpt")
    spread = build_plan(mats, 3, A800, balancer="lpt", anti_affinity=True)
    assert sorted(spread.loads_s) == pytest.approx(sorted(plain.loads_s))
    for layer in range(4):
        assert len({spread.owners[i] for i, m in enumerate(mats) if m.layer == layer}) == 3


def test_milp_falls_back_to_lpt_loudly_without_a_solver(monkeypatch):
    monkeypatch.setitem(sys.modules, "pulp", None)  # import pulp -> ImportError
    mats = [MatrixSpec(f"m{i}", 1024, 4096, i) for i in range(7)]
    with pytest.warns(RuntimeWarning, match="fell back to LPT"):
        plan = build_plan(mats, 3, A800, balancer="milp")
    assert any("pulp is not installed" in n for n in plan.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan.owners == build_plan(mats, 3, A800, balancer="lpt").owners


def test_milp_at_128_ranks_is_valid():
    from simulator.models.workload import load_workload

    mats = load_workload("wall-wm").muon_matrices
    plan = build_plan(mats, 128, A800, balancer="milp", time_limit_s=3)
    _check_plan(plan, 128)
    assert plan.makespan_s <= build_plan(mats, 128, A800, balancer="lpt").makespan_s * (1 + 1e-9)


def test_bad_arguments_say_what_is_accepted():
    mats = [MatrixSpec("a", 64, 64)]
    with pytest.raises(InputError, match="unknown balancer 'greedy'; accepted: round_robin, lpt, milp"):
        build_plan(mats, 2, A800, balancer="greedy")
    with pytest.raises(InputError, match="world_size must be a positive integer"):
        build_plan(mats, 0, A800)
    with pytest.raises(
        InputError, match="unknown method 'x'; accepted: standard, standard_sym, gram, gram_sym, auto"
    ):
        build_plan(mats, 2, A800, method="x")
    with pytest.raises(InputError, match="no matrices to plan"):
        build_plan([], 2, A800)
    with pytest.raises(InputError, match="matrix names must be unique"):
        build_plan([MatrixSpec("a", 64, 64), MatrixSpec("a", 32, 64)], 2, A800)


# ---- split batches (owner groups) ------------------------------------------------------------------
SPLIT_SHAPES = [(4096, 16384), (3584, 18944), (2048, 8192), (1024, 4096), (256, 1024), (5120, 5120)]


@st.composite
def split_instances(draw):
    kinds = draw(st.lists(st.sampled_from(SPLIT_SHAPES), min_size=1, max_size=3, unique=True))
    counts = [draw(st.integers(1, 5)) for _ in kinds]
    mats = [MatrixSpec(f"k{k}.{j}", r, c, j) for k, (r, c) in enumerate(kinds) for j in range(counts[k])]
    return mats, draw(st.integers(1, 12)), draw(st.sampled_from([2, 4, 8, 16])), draw(st.integers(1, 4))


def _check_groups(plan: Plan, ranks: int) -> None:
    _check_plan(plan, ranks)
    in_split = [0] * ranks
    for b in plan.split_batches:
        k, lead = len(b.group), b.group[0]
        assert 2 <= k <= min(ranks, plan.max_split) and k & (k - 1) == 0  # a power of two
        assert b.group == tuple(range(lead, lead + k)) and lead % k == 0  # an aligned block
        assert b.owner == lead and 0 < b.comm_s < b.time_s
        for r in b.group:
            in_split[r] += 1
        unsplit = (A800.ns_time(b.rows, b.cols, b.size, b.method, plan.dtype).time_s
                   + momentum_time(A800, b.rows * b.cols, b.size))  # both with the lead's momentum
        assert b.time_s < unsplit  # a split is only ever offered where it is faster than not splitting
    assert max(in_split) <= 1  # every rank in at most one split batch
    groups = plan.groups
    assert len(groups) == len(plan.matrices)
    for g, o in zip(groups, plan.owners, strict=True):
        assert g and g[0] == o and all(0 <= r < ranks for r in g)
    loads = [0.0] * ranks
    for b in plan.batches:
        for r in b.ranks:
            loads[r] += b.time_s
            assert b in plan.batches_of(r)
    assert tuple(loads) == pytest.approx(plan.loads_s)
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.groups == groups


@given(split_instances())
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_split_plans_properties(inst):
    mats, ranks, max_split, max_batch = inst
    plain = build_plan(mats, ranks, A800, balancer="lpt", max_batch=max_batch)
    lpt = build_plan(mats, ranks, A800, balancer="lpt", max_batch=max_batch, max_split=max_split)
    milp = build_plan(mats, ranks, A800, balancer="milp", max_batch=max_batch, max_split=max_split,
                      time_limit_s=2.0)
    for plan in (lpt, milp):
        _check_groups(plan, ranks)
    assert lpt.makespan_s <= plain.makespan_s * (1 + 1e-12)  # splitting is taken only where it pays
    assert milp.makespan_s <= lpt.makespan_s * (1 + 1e-9)
    whole = build_plan(mats, ranks, A800, balancer="milp", max_batch=max_batch, time_limit_s=2.0)
    assert milp.makespan_s <= whole.makespan_s * (1 + 1e-9)  # allowing splits never makes the MILP worse
    proven = milp.makespan_s * (1 - milp.gap)
    assert milp.lower_bound_s * (1 - 1e-9) <= proven <= milp.makespan_s * (1 + 1e-12)
    if not lpt.split_batches:
        assert lpt.owners == plain.owners and lpt.batches == plain.batches


def test_no_split_where_it_does_not_pay():
    small = [MatrixSpec(f"s{i}", 256, 1024, i) for i in range(24)]
    for ranks in (2, 4, 8):
        for bal in ("lpt", "milp"):
            plan = build_plan(small, ranks, A800, balancer=bal, max_split=8, time_limit_s=2)
            assert not plan.split_batches and any("splits: none chosen" in n for n in plan.notes)
            assert plan.owners == build_plan(small, ranks, A800, balancer=bal, time_limit_s=2).owners
    two = [MatrixSpec(f"b{i}", 4096, 16384, i) for i in range(2)]  # one big matrix per rank: nothing to gain
    assert not build_plan(two, 2, A800, balancer="milp", max_split=2).split_batches
    tiny = [MatrixSpec("t", 64, 256)]  # a split call would cost more than the whole NS: never offered
    assert not build_work_model(tiny, 4, A800, max_split=4).pieces


def test_split_pays_for_one_dominant_matrix():
    mats = [MatrixSpec("big", 4096, 16384, 0)] + [MatrixSpec(f"s{i}", 512, 2048, i + 1) for i in range(14)]
    plain = build_plan(mats, 8, A800, balancer="milp")
    split = build_plan(mats, 8, A800, balancer="milp", max_split=8)
    _check_groups(split, 8)
    assert split.makespan_s < 0.8 * plain.makespan_s and len(split.groups[0]) > 1
    assert split.lower_bound_s < plain.lower_bound_s  # the split-aware bound is below the one-owner wall
    lpt = build_plan(mats, 8, A800, balancer="lpt", max_split=8)
    assert split.makespan_s <= lpt.makespan_s * (1 + 1e-9) and lpt.split_batches
    again = build_plan(mats, 8, A800, balancer="milp", max_split=8, seed=5)
    assert again.batches == split.batches and again.owners == split.owners  # deterministic


def test_split_lower_bound_terms():
    from dmuon.plan.split import area_bound

    # two classes: a (t=4 whole, or 2 ranks x 3), b (t=1): 3 ranks
    opts = [(2, [(4.0, 1, 1), (3.0, 2, 1)]), (3, [(1.0, 1, 1)])]
    assert area_bound(opts, 3) == pytest.approx(max(4.0, (2 * 4 + 3) / 3))  # T >= 4: area 11 / 3 < 4
    assert area_bound(opts, 8) == pytest.approx(3.0)  # T = 3 needs 2 x 6 + 3 = 15 rank-seconds <= 24
    mats = [MatrixSpec("big", 4096, 16384, 0)]
    terms = build_work_model(mats, 8, A800, max_split=8).lower_bound_terms()
    fastest = min(p.time_s for p in build_work_model(mats, 8, A800, max_split=8).pieces)
    assert terms["largest call (split-aware)"] == pytest.approx(fastest)


def test_split_bad_arguments():
    mats = [MatrixSpec("a", 1024, 4096)]
    with pytest.raises(InputError, match="max_split must be a positive integer"):
        build_plan(mats, 2, A800, max_split=0)
    with pytest.raises(InputError, match="max_split > 1 with a memory cap is not supported"):
        build_plan(mats, 2, A800, max_split=2, memory_cap_bytes=1e12)
    with pytest.raises(InputError, match="links must be a dmuon.plan.split.LinkModel"):
        build_plan(mats, 2, A800, max_split=2, links=object())
    with pytest.raises(InputError, match="no link model for device 'unit'"):
        build_plan(mats, 2, _UnitCost({(1024, 4096): 1.0}), max_split=2)
