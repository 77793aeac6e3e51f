"""The public partition (simulator.programs.published_partition, switch `owner_cost`): its cost units and
owners on a hand-worked example of X-Square-Robot/dmuon's `compute_balanced_assignment`, its invariants on a
catalog model, and the published plan the step programs time."""

from collections import Counter

import pytest

from dmuon.errors import InputError
from dmuon.plan.types import MatrixSpec
from simulator.api import SimConfig, simulate
from simulator.costs import load_cost
from simulator.models.workload import load_workload
from simulator.programs.published_partition import allocation_units, cost_units, owner_slots, published_plan

# layer 0: A big, B and C small (merged); layer 1: D big, E big, F small
A, B, C = MatrixSpec("m.0.a", 4096, 4096, 0), MatrixSpec("m.0.b", 1024, 4096, 0), MatrixSpec("m.0.c", 1024, 4096, 0)
D, E, F = MatrixSpec("m.1.d", 4096, 4096, 1), MatrixSpec("m.1.e", 4096, 11008, 1), MatrixSpec("m.1.f", 512, 512, 1)
MATS = (A, B, C, D, E, F)


def test_cost_units_by_hand():
    # 5 * small * (rows*cols + 2*big*small) // 1e9 + max(1, numel // 4e6)
    assert cost_units(A) == 15 * 4096**3 // 10**9 + 4 == 1034
    assert cost_units(B) == 64 + 1 == 65
    assert cost_units(E) == 2770 + 11 == 2781
    assert cost_units(F) == 2 + 1 == 3  # both terms at least 1
    order = [tuple(MATS[i].name[-1] for i in u.members) for u in allocation_units(MATS)]
    # by cost, then (A and D tie in cost and size) by layer name
    assert order == [("e",), ("a",), ("d",), ("b", "c"), ("f",)]


def test_fsdp_owners_by_hand():
    # 3 slots: E->0; A->1 (tie with 2: first); D->2 (0 is layer 1's); BC->2 (1 is layer 0's, 2 < 0 by
    # cost); F->1, the only slot layer 1 has not used
    assert owner_slots(MATS, 3) == (1, 2, 2, 2, 0, 1)
    # unmerged: B->2 (slot 1 is layer 0's), C->0 (the only one layer 0 has not used)
    assert owner_slots(MATS, 3, merge_small=False) == (1, 2, 0, 2, 0, 1)


def test_hsdp_owners_by_hand():
    # slots (s, r) = (0,0) (0,1) (1,0) (1,1) are ranks 0, 2, 1, 3; the column cost decides first:
    # E->(0,0); A->(1,0) (the empty column); D->(1,1) (column 1 the cheaper, (1,1) the cheaper slot in it);
    # BC->(1,1) (column 1 still the cheaper, (1,0) is layer 0's); F->(1,0) (unused by layer 1, cheaper column)
    assert owner_slots(MATS, 2, 2) == (1, 3, 3, 3, 0, 1)


def test_invariants_on_a_catalog_model():
    mats = load_workload("qwen2.5-7b").muon_matrices
    for shard, rep in ((128, 1), (8, 16), (16, 1)):
        owners = owner_slots(mats, shard, rep)
        assert len(owners) == len(mats) and all(0 <= o < shard * rep for o in owners)
        units = allocation_units(mats)
        assert sorted(i for u in units for i in u.members) == list(range(len(mats)))  # each matrix once
        per_layer = Counter(u.layer for u in units)
        for layer, n in per_layer.items():  # same-layer spreading while there are slots
            got = {owners[i] for u in units if u.layer == layer for i in u.members}
            assert len(got) == min(n, shard * rep)
        for u in units:  # a unit has one owner; merged units hold only matrices under 5 M elements
            assert len({owners[i] for i in u.members}) == 1
            assert len(u.members) == 1 or all(mats[i].numel < 5_000_000 for i in u.members)


def test_published_plan_is_a_plan_of_the_partition():
    mats = load_workload("qwen2.5-1.5b").muon_matrices
    cost = load_cost("a800")
    plan = published_plan(mats, 8, 2, cost, method="gram_sym", dtype="bf16", max_batch=1, bucket_numel=0)
    assert plan.owners == owner_slots(mats, 8, 2)
    assert sorted(i for b in plan.batches for i in b.members) == list(range(len(mats)))
    assert all(b.size == 1 and plan.owners[b.members[0]] == b.owner for b in plan.batches)
    assert plan.makespan_s == pytest.approx(max(plan.loads_s))
    batched = published_plan(mats, 8, 2, cost, method="gram_sym", dtype="bf16", max_batch=8, bucket_numel=0)
    assert batched.owners == plan.owners and len(batched.batches) < len(plan.batches)


def test_simulator_uses_it_only_under_owner_cost():
    base = dict(workload="qwen2.5-1.5b", gpus=16, strategy="dmuon", seq_len=512, micro_batch=1)
    assert simulate(SimConfig(**base, system="published", layout="hsdp-free")).plan_balancer == "published-lpt"
    assert simulate(SimConfig(**base, system="published", layout="hsdp-free",
                              published_off=("owner_cost",))).plan_balancer == "lpt"
    with pytest.raises(InputError, match="accepted: max_split=1, or published_off=\\('owner_cost',\\)"):
        simulate(SimConfig(**base, system="published", max_split=2))
