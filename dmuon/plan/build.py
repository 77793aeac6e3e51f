"""build_plan: matrices + rank count + cost table -> the Plan both executors use.

Steps: price every shape class and batch size (`balance.build_work_model`); assign batches to ranks
with the chosen balancer (round_robin | lpt | milp); map each rank's per-class slots to concrete
matrices in layer order; cut communication buckets in layer order.

Mapping slots to matrices (LPT, MILP): the matrices of all classes are visited in forward (layer,
index) order; each goes to a rank with a free slot of its class, preferring (1, only with
anti_affinity) a rank owning the fewest matrices of this layer so far, then (2) the rank furthest behind
its share of the class (stride scheduling), so each owner's matrices are spread over the whole model
and its publications interleave with everyone else's; ties go to the lowest rank. Loads never change.

Batches: a rank's matrices of one class are cut into its batch sizes (largest first) in reverse layer
order, so the first batch holds the highest layers (their gradients arrive first in backward). Plan
batches are sorted by owner, then by readiness (lowest member layer, descending). A batch's rows/cols
are the NS shape (n, m) = (min, max); members of shape (m, n) are transposed by the runtime.

Buckets: bucket_numel = 0 -> one bucket per layer; else consecutive layers are merged until a bucket
holds >= bucket_numel elements (the last may be smaller). Members in forward order.

Split batches (max_split > 1, off by default): LPT and MILP may give a batch a group of k owners
(`splitbal`, priced by `split`); each split batch is one more slot holder next to the ranks when
matrices are mapped to slots (so split matrices are spread over the layers like everyone's), and
becomes one Batch with `group` = its ranks and owner = the group's lead. Round-robin never splits.
"""

from __future__ import annotations

import heapq
import time
import warnings
from collections.abc import Sequence

from ..errors import InputError, choice_error
from .balance import Loads, WorkModel, build_work_model, round_robin
from .splitbal import Job, loads_s, split_lpt
from .types import Batch, Bucket, MatrixSpec, Plan

BALANCERS = ("round_robin", "lpt", "milp")


def build_plan(
    matrices: Sequence[MatrixSpec],
    world_size: int,
    cost,
    *,
    balancer: str = "lpt",
    method: str = "gram_sym",
    dtype: str = "bf16",
    batching: bool = True,
    max_batch: int = 8,
    bucket_numel: int = 0,
    memory_cap_bytes: float | None = None,
    anti_affinity: bool = False,
    time_limit_s: float = 10.0,
    seed: int = 0,
    max_split: int = 1,
    links=None,
    owner_momentum: bool = True,
    orientation=False,
) -> Plan:
    """Owners, batches and buckets for `matrices` on `world_size` ranks, priced by `cost` (a CostTable).

    method: standard | standard_sym | gram | gram_sym, or auto = per batch the cheapest method the
        device can run (`CostTable.runnable_methods`: the paper's kernel selection; Batch.method says
        which).
    seed: HiGHS's random seed (MILP). Every balancer is deterministic: the MILP's phases are bounded by
        work (pricing rounds, bisection steps, branch-and-bound nodes; one HiGHS thread), so the same
        input gives the same plan.
    time_limit_s: wall-clock safety net of the MILP balancer (all its phases): sized never to decide on
        the project's workloads; if it stops a phase, a note says so (that plan may differ between runs).
    max_split: the largest owner group of one batch (split NS; groups of 2, 4, ... up to it); 1 (the
        default) = one owner per batch, as before. links: the collectives' cost (`split.LinkModel` or an
        object with all_reduce_s / all_gather_s); None = the cost table device's `split.LINKS` entry.
    owner_momentum: price each batch as its NS call + the owner's momentum pass over its matrices
        (`balance.momentum_time`; Batch.momentum_s), as the replicated and fsdp2-owner layouts run it
        (the default, the simulator's default layout fsdp-keep); False for fsdp2-sharded, where every rank
        runs the momentum on its shards: the balancers then see NS seconds alone.
    orientation: tall and wide matrices never share a batch: True = of every shape, or a collection of
        NS shapes (n, m) = of those (`dmuon.plan.orientation`; the runtime asks for it where its NS iterates
        tall matrices as they are); False (the default) = batches by NS shape alone.
    """
    if balancer not in BALANCERS:
        raise choice_error("balancer", balancer, BALANCERS)
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 0:
        raise InputError(
            f"bucket_numel must be a non-negative integer (0 = one bucket per layer), got {bucket_numel!r}"
        )
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise InputError(f"time_limit_s must be positive, got {time_limit_s!r}")
    for name, flag in (("batching", batching), ("anti_affinity", anti_affinity)):
        if not isinstance(flag, bool):
            raise InputError(f"{name} must be True or False, got {flag!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise InputError(f"seed must be an integer in [0, 2**31), got {seed!r}")
    t_start = time.perf_counter()
    model = build_work_model(
        matrices,
        world_size,
        cost,
        method=method,
        dtype=dtype,
        batching=batching,
        max_batch=max_batch,
        memory_cap_bytes=memory_cap_bytes,
        max_split=max_split,
        links=links,
        owner_momentum=owner_momentum,
        orientation=orientation,
    )
    notes: list[str] = []
    gap = 0.0
    owners: tuple[int, ...] | None = None
    jobs: tuple[Job, ...] = ()
    if balancer == "round_robin":
        loads, owners = round_robin(model)
    elif balancer == "lpt":
        loads, jobs = split_lpt(model)
    else:
        from .milp import solve_milp

        result = solve_milp(model, time_limit_s=time_limit_s, seed=seed)
        loads, gap, jobs = result.loads, result.gap, result.jobs
        notes += result.notes
        if result.fallback:
            warnings.warn(result.notes[-1], RuntimeWarning, stacklevel=2)
    holders = list(loads) + [{model.pieces[j.piece].cls: [model.pieces[j.piece].batch]} for j in jobs]
    if owners is None:
        holder_of = map_slots(model, holders, anti_affinity=anti_affinity)
    else:
        holder_of = owners
    batches = make_batches(model, holders, holder_of, jobs)
    owners = tuple(h if h < model.world_size else jobs[h - model.world_size].ranks[0] for h in holder_of)
    solve_time_s = time.perf_counter() - t_start
    per_rank = loads_s(model, (loads, jobs))
    makespan = max(per_rank)
    lb = model.lower_bound_s
    terms = model.lower_bound_terms()
    binding = min((k for k, v in terms.items() if v == lb), key=list(terms).index)
    notes.insert(0, f"lower bound {lb * 1e3:.3f} ms = {binding}")
    if balancer != "milp":
        gap = (makespan - lb) / makespan if makespan > 0 else 0.0
    if not batching:
        notes.append("batching off: every matrix is its own NS call")
    kept = [f"{c.label} apart from {c.n}x{c.m}" for c in model.classes
            if c.tall and any(d.tall is False and (d.n, d.m) == (c.n, c.m) for d in model.classes)]
    if kept:
        notes.append(f"orientation: tall and wide matrices in batches of their own ({', '.join(kept)})")
    mom = sum(b.momentum_s for b in batches)
    if mom:
        notes.append(f"batch times include the owner's momentum pass ({mom * 1e3:.3f} ms over all batches; "
                     "the pass's fixed intercept is paid once per owner, not per batch)")
    if model.max_split > 1:
        ks = sorted({model.pieces[j.piece].k for j in jobs})
        notes.append(
            f"splits: {len(jobs)} split batches ({sum(model.pieces[j.piece].batch for j in jobs)} matrices"
            f", groups of {', '.join(map(str, ks))} ranks); {len(model.pieces)} piece types <= {max_split} "
            f"ranks offered; collectives: {model.links_source}"
            if jobs else f"splits: none chosen ({len(model.pieces)} piece types <= {max_split} ranks "
            "offered: splitting would not lower the makespan)"
        )
    return Plan(
        world_size=world_size,
        matrices=model.matrices,
        owners=owners,
        batches=batches,
        buckets=make_buckets(model.matrices, bucket_numel),
        balancer=balancer,
        method=method,
        dtype=dtype,
        cost_source=getattr(cost, "name", type(cost).__name__),
        makespan_s=makespan,
        lower_bound_s=lb,
        solve_time_s=solve_time_s,
        gap=max(0.0, gap),
        notes=tuple(notes),
        max_split=max_split,
    )


def map_slots(model: WorkModel, loads: Loads, *, anti_affinity: bool = False) -> tuple[int, ...]:
    """Concrete holder (a rank, or N + j for split job j) of every matrix from per-holder class slots
    (see the module docstring)."""
    n_ranks, n_classes = len(loads), len(model.classes)
    slots = [[0] * n_ranks for _ in range(n_classes)]  # per class and holder its slots (most hold none)
    for r, load in enumerate(loads):
        for s, sizes in load.items():
            if s in range(n_classes):
                slots[s][r] = sum(sizes)
    for s, cls in enumerate(model.classes):
        if sum(slots[s]) != cls.count:
            raise AssertionError(f"class {cls.label}: {sum(slots[s])} slots for {cls.count} matrices")
    assigned = [[0] * n_ranks for _ in model.classes]
    seen = [0] * len(model.classes)
    cls_of = {i: s for s, c in enumerate(model.classes) for i in c.members}
    owners = [-1] * len(model.matrices)
    order = sorted(cls_of, key=lambda i: (model.matrices[i].layer, i))
    if not anti_affinity:
        return _map_slots_stride(model, loads, slots, cls_of, order, owners)
    in_layer: dict[int, dict[int, int]] = {}
    for i in order:
        s, layer = cls_of[i], model.matrices[i].layer
        seen[s] += 1
        count = model.classes[s].count
        per_layer = in_layer.setdefault(layer, {})
        best_key, best = None, -1
        for r in range(n_ranks):
            if assigned[s][r] >= slots[s][r]:
                continue
            behind = slots[s][r] * seen[s] / count - assigned[s][r]
            key = (per_layer.get(r, 0) if anti_affinity else 0, -behind, r)
            if best_key is None or key < best_key:
                best_key, best = key, r
        owners[i] = best
        assigned[s][best] += 1
        per_layer[best] = per_layer.get(best, 0) + 1
    return tuple(owners)


def _map_slots_stride(model: WorkModel, loads, slots, cls_of, order, owners) -> tuple[int, ...]:
    """`map_slots` without anti-affinity in O(log N + distinct slot counts) per matrix: the key
    (-behind, rank) with behind = slots * seen / count - assigned orders the ranks holding the same number
    of slots of a class by (assigned, rank), so one heap per (class, slot count) holds them and each matrix
    compares only the heaps' tops (the same choice as the scan over every rank)."""
    heaps: list[dict[int, list[tuple[int, int]]]] = [{} for _ in slots]
    for r, load in enumerate(loads):  # ascending ranks: each list is a heap as built
        for s in load:
            if s in range(len(slots)) and slots[s][r]:
                heaps[s].setdefault(slots[s][r], []).append((0, r))
    seen = [0] * len(model.classes)
    for i in order:
        s = cls_of[i]
        seen[s] += 1
        count = model.classes[s].count
        best_key, best_n = None, 0
        for n, h in heaps[s].items():
            if h:
                assigned, r = h[0]
                key = (-(n * seen[s] / count - assigned), r)
                if best_key is None or key < best_key:
                    best_key, best_n = key, n
        assigned, r = heapq.heappop(heaps[s][best_n])
        owners[i] = r
        if assigned + 1 < best_n:
            heapq.heappush(heaps[s][best_n], (assigned + 1, r))
    return tuple(owners)


def make_batches(model: WorkModel, loads: Loads, owners: Sequence[int], jobs=()) -> tuple[Batch, ...]:
    """Cut each holder's matrices of each class into its batch sizes (see the module docstring); holder
    N + j is split job j (one batch on its group)."""
    out = []
    n_ranks = model.world_size
    holding: dict[int, list[int]] = {}  # class -> the ranks whose loads have it (most ranks hold no class)
    for r, load in enumerate(loads):
        for s in load:
            holding.setdefault(s, []).append(r)
    for s, cls in enumerate(model.classes):
        by_holder: dict[int, list[int]] = {}
        for i in cls.members:
            by_holder.setdefault(owners[i], []).append(i)
        # the ranks with slots or matrices of this class (the others have neither: no batch, nothing to check)
        for r in sorted({*holding.get(s, ()), *(h for h in by_holder if 0 <= h < len(loads))}):
            sizes = sorted(loads[r].get(s, ()), reverse=True)
            mine = sorted(by_holder.get(r, ()), key=lambda i: (-model.matrices[i].layer, -i))
            if len(mine) != sum(sizes):
                raise AssertionError(f"rank {r} class {cls.label}: {len(mine)} matrices, slots {sizes}")
            pos = 0
            for b in sizes:
                members = tuple(sorted(mine[pos : pos + b], key=lambda i: (model.matrices[i].layer, i)))
                pos += b
                if r >= n_ranks:
                    job = jobs[r - n_ranks]
                    p = model.pieces[job.piece]
                    out.append(Batch(owner=job.ranks[0], rows=cls.n, cols=cls.m, members=members,
                                     time_s=p.time_s, method=p.method, group=job.ranks, comm_s=p.comm_s,
                                     momentum_s=p.momentum_s))
                    continue
                out.append(
                    Batch(
                        owner=r,
                        rows=cls.n,
                        cols=cls.m,
                        members=members,
                        time_s=cls.times_s[b],
                        method=cls.methods[b],
                        momentum_s=cls.momentum_s.get(b, 0.0),
                    )
                )
    ready = {id(b): min(model.matrices[i].layer for i in b.members) for b in out}
    out.sort(key=lambda b: (b.owner, -ready[id(b)], b.rows, b.cols, b.members))
    return tuple(out)


def make_buckets(matrices: Sequence[MatrixSpec], bucket_numel: int = 0) -> tuple[Bucket, ...]:
    """Communication buckets in forward layer order (see the module docstring)."""
    by_layer: dict[int, list[int]] = {}  # each layer's matrices in index order
    for i, m in enumerate(matrices):
        by_layer.setdefault(m.layer, []).append(i)
    buckets: list[list[int]] = []
    current: list[int] = []
    numel = 0
    for layer in sorted(by_layer):
        current += by_layer[layer]
        numel += sum(matrices[i].numel for i in by_layer[layer])
        if bucket_numel == 0 or numel >= bucket_numel:
            buckets.append(current)
            current, numel = [], 0
    if current:
        buckets.append(current)
    return tuple(Bucket(index=k, members=tuple(m)) for k, m in enumerate(buckets))
