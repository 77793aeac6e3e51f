"""Planner at MoE scale: the fast paths (batching DP, marginal LPT, slot mapping) choose exactly what the
plain scans choose, and the biggest shipped MoE (Kimi-K2-like, ~70k matrices) plans by LPT in seconds."""

from __future__ import annotations

import math
import random
import time

import pytest

from dmuon.plan.balance import ShapeClass, WorkModel, build_work_model, lpt_for_cap, lpt_marginal
from dmuon.plan.build import build_plan, map_slots
from dmuon.plan.cost import CostTable
from dmuon.plan.types import MatrixSpec

A800 = CostTable.load("a800")


def _reference_table(cls: ShapeClass, k: int, max_size=None):
    """The batching DP as first written: entry j keeps its whole descending size tuple (O(k^2))."""
    table = [(0.0, 0, ())]
    sizes = [b for b in cls.sizes if max_size is None or b <= max_size]
    for j in range(1, k + 1):
        cands = [(table[j - b][0] + cls.times_s[b], table[j - b][1] + 1,
                  tuple(sorted((*table[j - b][2], b), reverse=True))) for b in sizes if b <= j]
        table.append(min(cands, key=lambda c: (c[0], c[1], tuple(-x for x in c[2]))))
    return table


def _random_class(rng: random.Random) -> ShapeClass:
    top = rng.randint(1, 8)
    base = rng.choice([1.0, 0.1, 3e-4])
    times = {b: base * b ** rng.uniform(0.3, 1.0) if rng.random() < 0.7
             else base * b * rng.choice([0.5, 0.75, 1]) for b in range(1, top + 1)}  # ties, non-monotone
    times[1] = base
    sizes = tuple(sorted({1} | set(rng.sample(range(1, top + 1), rng.randint(0, top)))))
    count = rng.randint(1, 150)
    return ShapeClass(1, 1, tuple(range(count)), times, {b: "gram" for b in times}, sizes, 8)


def test_batching_dp_matches_the_quadratic_reference():
    rng = random.Random(7)
    for _ in range(150):
        cls = _random_class(rng)
        model = WorkModel((), 4, (cls,))
        for cap in (None, *cls.sizes):
            ref = _reference_table(cls, cls.count, cap)
            assert [model.best_split(0, k, cap) for k in range(cls.count + 1)] == [r[2] for r in ref]
        ref = _reference_table(cls, cls.count)
        for k in range(cls.count + 1):
            # the same float: summed in the same order
            assert model.split_cost_s(0, k) == sum(cls.times_s[b] for b in ref[k][2])
            want = min(range(k, cls.count + 1), key=lambda j: (sum(cls.times_s[b] for b in ref[j][2]), j))
            assert model.cover_count(0, k) == want
    with pytest.raises(ValueError, match="cover_count"):
        model.cover_count(0, cls.count + 1)


def _reference_marginal(model: WorkModel):
    """lpt_marginal as a scan over every rank per matrix."""
    n = model.world_size
    counts = [[0] * len(model.classes) for _ in range(n)]
    load = [0.0] * n
    order = sorted((-c.times_s[1], s) for s, c in enumerate(model.classes) for _ in range(c.count))
    split = [[model.split_cost_s(s, k) for k in range(c.count + 1)] for s, c in enumerate(model.classes)]
    for _, s in order:
        key = min((load[r] + split[s][counts[r][s] + 1] - split[s][counts[r][s]], r) for r in range(n))
        load[key[1]] = key[0]
        counts[key[1]][s] += 1
    return [{s: list(model.best_split(s, k)) for s, k in enumerate(row) if k} for row in counts]


def _reference_slots(model: WorkModel, loads):
    """map_slots without anti-affinity as a scan over every rank per matrix."""
    n = len(loads)
    slots = [[sum(loads[r].get(s, ())) for r in range(n)] for s in range(len(model.classes))]
    assigned = [[0] * n for _ in model.classes]
    seen = [0] * len(model.classes)
    cls_of = {i: s for s, c in enumerate(model.classes) for i in c.members}
    owners = [-1] * len(model.matrices)
    for i in sorted(cls_of, key=lambda i: (model.matrices[i].layer, i)):
        s = cls_of[i]
        seen[s] += 1
        _, r = min((-(slots[s][r] * seen[s] / model.classes[s].count - assigned[s][r]), r)
                   for r in range(n) if assigned[s][r] < slots[s][r])
        owners[i] = r
        assigned[s][r] += 1
    return tuple(owners)


@pytest.mark.parametrize("seed", range(6))
def test_fast_marginal_lpt_and_slot_mapping_match_the_scans(seed):
    rng = random.Random(seed)
    shapes = rng.sample([(256, 1024), (768, 2048), (2048, 2048), (1024, 4096), (512, 512), (3584, 18944)], 3)
    mats = [MatrixSpec(f"l{layer}.m{j}", *rng.choice(shapes), layer)
            for layer in range(rng.randint(2, 12)) for j in range(rng.randint(1, 20))]
    model = build_work_model(mats, rng.randint(2, 24), A800)
    loads = lpt_marginal(model)
    assert loads == _reference_marginal(model)
    assert map_slots(model, loads) == _reference_slots(model, loads)


def _reference_lpt_for_cap(model: WorkModel, max_size: int):
    """lpt_for_cap under a memory cap as a scan over every rank per batch."""
    jobs = sorted((-model.classes[s].times_s[b], s, -b) for s, c in enumerate(model.classes)
                  for b in model.best_split(s, c.count, max_size))
    n = model.world_size
    load, used, loads = [0.0] * n, [0] * n, [{} for _ in range(n)]
    for neg_t, s, neg_b in jobs:
        need = model.classes[s].state_bytes * -neg_b
        fits = [r for r in range(n) if used[r] + need <= model.memory_cap_bytes]
        if not fits:
            return None
        best = min(fits, key=lambda r: (load[r], r))
        load[best] -= neg_t
        used[best] += need
        loads[best].setdefault(s, []).append(-neg_b)
    return loads


@pytest.mark.parametrize("seed", range(6))
def test_capped_lpt_matches_the_scan(seed):
    rng = random.Random(100 + seed)
    shapes = rng.sample([(256, 1024), (768, 2048), (2048, 2048), (1024, 4096), (512, 512)], 3)
    mats = [MatrixSpec(f"l{layer}.m{j}", *rng.choice(shapes), layer)
            for layer in range(rng.randint(2, 10)) for j in range(rng.randint(1, 12))]
    n = rng.randint(2, 12)
    total = sum(m.numel for m in mats) * 8
    biggest = max(m.numel for m in mats) * 8
    model = build_work_model(mats, n, A800, memory_cap_bytes=max(biggest, total / n * rng.uniform(1.0, 1.6)))
    for cap in range(1, 9):
        assert lpt_for_cap(model, cap) == _reference_lpt_for_cap(model, cap)


def test_biggest_moe_plans_by_lpt_in_seconds():
    from simulator.models.workload import load_workload

    # every expert matrix its own entry (as expert parallelism plans them): the planner's largest input
    mats = load_workload("experiments/models/kimi-k2-like").experts_apart().muon_matrices
    assert len(mats) > 60_000
    t0 = time.perf_counter()
    plan = build_plan(mats, 1024, A800, balancer="lpt")
    elapsed = time.perf_counter() - t0
    assert sorted(i for b in plan.batches for i in b.members) == list(range(len(mats)))
    assert plan.lower_bound_s <= plan.makespan_s <= plan.lower_bound_s * 1.05
    assert elapsed < 60, f"LPT on {len(mats)} matrices x 1024 ranks took {elapsed:.1f} s (goal 20 s)"


def _reference_lpt(model: WorkModel, initial):
    """balance.lpt's candidate loop over the full-rank lpt_for_cap / lpt_marginal (heaps over every rank)."""
    from dmuon.plan.balance import rank_load_s, rebatch

    base = [0.0] * model.world_size if initial is None else initial
    top = max(max(c.sizes) for c in model.classes)
    cands = [lpt_for_cap(model, cap, None, initial) for cap in range(1, top + 1)]
    cands.append(lpt_marginal(model, None, initial))
    keyed = []
    for idx, loads in enumerate(cands):
        loads = rebatch(model, loads)
        per = [(rank_load_s(model, r) if r else 0) + b for r, b in zip(loads, base, strict=True)]
        keyed.append(((max(per), sum(per), idx), loads))
    return min(keyed, key=lambda t: t[0])[1]


@pytest.mark.parametrize("seed", range(8))
def test_sparse_lpt_matches_the_full_rank_heaps(seed):
    """balance.lpt without a memory cap (dmuon.plan.lpt_sparse: heaps over the ranks that got work and one
    first rank per pool of equal initial loads) returns the loads of the heaps over every rank: many
    ranks, few matrices, initial loads with repeats and exact ties (the EP planner's replica groups)."""
    from dmuon.plan import lpt_sparse
    from dmuon.plan.balance import lpt, rank_load_s, rebatch

    rng = random.Random(300 + seed)
    shapes = rng.sample([(256, 1024), (768, 2048), (2048, 2048), (1024, 4096), (512, 512)], 3)
    mats = [MatrixSpec(f"l{layer}.m{j}", *rng.choice(shapes), layer)
            for layer in range(rng.randint(1, 8)) for j in range(rng.randint(1, 10))]
    n = rng.choice([3, 17, 64, 300])
    model = build_work_model(mats, n, A800)
    t1 = model.classes[0].times_s[1]
    levels = [0.0, t1, 2 * t1, t1 / 3, rng.random() * 1e-3]
    for initial in (None, [rng.choice(levels) for _ in range(n)], [0.0] * (n - 1) + [t1]):
        want = _reference_lpt(model, initial)
        assert lpt(model, initial=initial) == want
        assert lpt_sparse.uncapped_lpt(model, None, initial, rebatch, rank_load_s) == want
        assert [list(d.items()) for d in lpt(model, initial=initial)] == [list(d.items()) for d in want]
    assert not lpt_sparse.usable(model, [0.0] * (n + 1)) and not lpt_sparse.usable(model, [math.nan] * n)
