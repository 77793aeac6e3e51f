"""`balance.lpt` without a memory cap, visiting only the ranks that receive work.

LPT over N ranks keeps every rank in a heap keyed by (load, rank) and gives each job to the heap's
top. Expert parallelism plans the dense matrices over every rank (Kimi-K2-like: ~490 matrices over up to
65,536 ranks), so building that heap, the per-rank loads and their re-batching for each of LPT's
candidates cost O(N) each while only a few hundred ranks ever receive a job.

The ranks that hold nothing yet are kept in *pools*, one per distinct initial load v (without initial
loads: one pool, every rank at 0.0), each in ascending rank order. Among the untouched ranks of one pool
every key is (v, rank) (by batches) or (v + c1 - c0, rank) (by matrices: the same float for all of
them), so the pool's least key is its first untouched rank's: the heaps hold the ranks that received
work plus each pool's first untouched rank (a 3-tuple entry naming its pool; ranks are unique, so the
third element never decides a comparison), and when that rank is taken the pool's next one takes its
place. Every choice is the one the heap over all N ranks makes: the same (load, rank) minimum, the same
float sums, the same candidate keys (the per-rank loads summed over the whole rank list in rank order),
so the loads are equal to `lpt_for_cap` / `lpt_marginal`'s (tests/test_plan_scale.py checks both).
`balance.lpt` falls back to those where a memory cap applies, the initial loads are not one per rank,
or one is NaN (no total order).
"""

from __future__ import annotations

import heapq


def usable(model, initial) -> bool:
    """Whether `uncapped_lpt` applies: no memory cap; initial loads (if any) one per rank, none NaN."""
    if model.memory_cap_bytes is not None:
        return False
    return initial is None or (len(initial) == model.world_size and all(v == v for v in initial))


def uncapped_lpt(model, counts, initial, rebatch, rank_load_s) -> list[dict[int, list[int]]]:
    """`balance.lpt`'s loads (its candidates: batch-size caps 1..max, then single matrices by marginal
    cost; the least (makespan, total, candidate index) wins, re-batched per rank) where `usable`."""
    n = model.world_size
    todo = [c.count for c in model.classes] if counts is None else list(counts)
    base = [0.0] * n if initial is None else list(initial)
    if initial is None:
        pools = [(0.0, range(n))]
    else:
        groups: dict[float, list[int]] = {}
        for r, v in enumerate(base):
            groups.setdefault(v, []).append(r)
        pools = list(groups.items())
    top = max(max(c.sizes) for c in model.classes)
    best_key = best = None
    for idx in range(top + 1):
        held = _by_batches(model, todo, idx + 1, pools) if idx < top else _by_matrices(model, todo, pools)
        held = dict(zip(held, rebatch(model, list(held.values())), strict=True))
        per = list(base)  # an untouched rank's load is its initial one, as `0 + b` in balance.lpt
        for r, d in held.items():
            per[r] = (rank_load_s(model, d) if d else 0) + base[r]
        key = (max(per), sum(per), idx)
        if best_key is None or key < best_key:
            best_key, best = key, held
    out: list[dict[int, list[int]]] = [{} for _ in range(n)]
    for r, d in best.items():
        out[r] = d
    return out


def _head(pools, nxt, p, shift=None) -> list[tuple]:
    """Pool p's first untouched rank as a heap entry (key, rank, p), [] once the pool is used up;
    shift (c1, c0): the key is v + c1 - c0 (by matrices), else v."""
    v, ranks = pools[p]
    if nxt[p] >= len(ranks):
        return []
    return [(v if shift is None else v + shift[0] - shift[1], ranks[nxt[p]], p)]


def _by_batches(model, todo, max_size, pools) -> dict[int, dict[int, list[int]]]:
    """`balance.lpt_for_cap(model, max_size, counts, initial)` without a cap: rank -> its class slots,
    for the ranks that received a batch."""
    jobs = []
    for s, count in enumerate(todo):
        for b in model.best_split(s, count, max_size) if count else ():
            jobs.append((-model.classes[s].times_s[b], s, -b))
    jobs.sort()
    nxt = [0] * len(pools)
    heap = [e for p in range(len(pools)) for e in _head(pools, nxt, p)]
    heapq.heapify(heap)
    held: dict[int, dict[int, list[int]]] = {}
    for neg_t, s, neg_b in jobs:
        first = heap[0]
        r = first[1]
        held.setdefault(r, {}).setdefault(s, []).append(-neg_b)
        heapq.heapreplace(heap, (first[0] - neg_t, r))
        if len(first) == 3:  # a pool's first untouched rank: its next one stands for the pool now
            nxt[first[2]] += 1
            for entry in _head(pools, nxt, first[2]):
                heapq.heappush(heap, entry)
    return held


def _by_matrices(model, todo, pools) -> dict[int, dict[int, list[int]]]:
    """`balance.lpt_marginal(model, counts, initial)` without a cap: rank -> its class slots, for the
    ranks that received a matrix (classes in ascending order, as there)."""
    load: dict[int, float] = {}
    counts: dict[int, dict[int, int]] = {}
    nxt = [0] * len(pools)
    for _, s in sorted((-c.times_s[1], s) for s, c in enumerate(model.classes) if todo[s]):
        costs = [model.split_cost_s(s, k) for k in range(todo[s] + 1)]
        # no rank holds class s yet: the k = 0 heap holds every rank (the touched ones and the pools' heads)
        zero = [(v + costs[1] - costs[0], r) for r, v in load.items()]
        zero += [e for p in range(len(pools)) for e in _head(pools, nxt, p, (costs[1], costs[0]))]
        heapq.heapify(zero)
        heaps = {0: zero}
        for _ in range(todo[s]):
            first, k = min((h[0], k) for k, h in heaps.items() if h)
            new, best = first[0], first[1]
            heapq.heappop(heaps[k])
            if len(first) == 3:  # a pool's first untouched rank: its next one joins the k = 0 heap
                nxt[first[2]] += 1
                for entry in _head(pools, nxt, first[2], (costs[1], costs[0])):
                    heapq.heappush(heaps.setdefault(0, []), entry)
            if not heaps[k]:
                del heaps[k]
            load[best] = new
            row = counts.setdefault(best, {})
            row[s] = row.get(s, 0) + 1
            if k + 1 < todo[s]:
                heapq.heappush(heaps.setdefault(k + 1, []), (new + costs[k + 2] - costs[k + 1], best))
    return {r: {s: list(model.best_split(s, k)) for s, k in sorted(row.items())} for r, row in counts.items()}
