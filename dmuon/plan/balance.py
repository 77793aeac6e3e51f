"""The balancing problem and the greedy balancers (round-robin, LPT); the MILP lives in `milp.py`.

Work model. Matrices are grouped into *shape classes* by their NS shape (n, m) = (min, max): a matrix
and its transpose cost the same and may share a batch (the runtime transposes tall ones before
stacking). With `orientation` a class also keeps one orientation (`ShapeClass.tall`, `orientation.py`:
where the runtime's NS iterates tall matrices as they are, a mixed batch would run as two calls). Prices
are the same; the classes are only finer, so the lower bound below and the balancers hold as they are.
For a class s, T(s, b) is the cost-table time of one batched call of b matrices. Batch sizes a class may
use (`sizes`): 1, and every b <= max_batch with T(s, b) < b T(s, 1) (a batch never costs more than its
members run singly) that is not dominated by a split b = b1 + b2 of usable sizes with
T(b1) + T(b2) <= T(b) (the split is never worse on the same rank, so the balancers need not see b).

Lower bound (a theorem for every plan over these batch sizes, memory cap or not):
    unit(s)     = min_b T(s, b) / b        cheapest share of one matrix over every batch size b >= 1
    min_call(s) = min_b T(s, b)            cheapest call that can contain one matrix of s
    LB = max( sum_s count(s) unit(s) / N ,  max_s min_call(s),  pigeonhole terms )
since a batch of b matrices of s costs T(s, b) >= b unit(s) (so total work >= sum count unit, and some
rank carries >= 1/N of it) and every matrix sits in some call of cost >= min_call(s). The pigeonhole
terms (`WorkModel.lower_bound_terms`) say that when there are more large matrices than ranks, some rank
must run two (or more) of them.

An assignment is, per rank and class, the list of batch sizes it runs (`Loads`); which concrete
matrices fill those slots is decided in `build.py` (layer order).

Split batches (max_split > 1; `split.py` prices them). A *piece type* (s, k, b) is one member's share of
a batch of b matrices of class s split over an aligned group of k ranks; it is offered only where it is
faster than the unsplit call of the same b matrices and than every smaller split of them (otherwise
the unsplit batch on one member of the group would be no slower for anyone: splitting cannot pay).
Every rank belongs to at most one split batch. The lower bound then becomes (`lower_bound_terms`):
    largest call   max_s  min(min_call(s), min_p T_p)          over the piece types p of s
    area           the smallest T with sum_s count(s) area_s(T) <= N T  (`split.area_bound`): the
                   cheapest rank-seconds per matrix, k T_p / b or T(s, b) / b, over calls of <= T
    pigeonhole, top-k   as above, over the classes that have no piece type (their matrices stay whole)
which is a theorem for every plan with splits (and with max_split = 1 the same terms as before).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ..errors import InputError, choice_error
from . import batchdp, lpt_sparse
from .flops import METHODS
from .momentum import momentum_time
from .orientation import BOTH, class_groups
from .split import area_bound, check_max_split, links_for, split_levels, split_price
from .types import MatrixSpec

AUTO_METHOD = "auto"
PLAN_METHODS = (*METHODS, AUTO_METHOD)
# Owned state per matrix element on its owner: the fp32 momentum buffer + a full fp32 copy of the
# matrix (the gathered gradient / NS input and output). Parameter shards and optimizer state of other
# params are not counted (they are the same with or without DMuon).
STATE_BYTES_PER_ELEMENT = 8
TOP_K_MAX = 8
MAX_RANKS = 1 << 20  # plans are lists over ranks; a larger count is a typo, not a cluster


@dataclass(frozen=True)
class ShapeClass:
    """All matrices with one NS shape (n, m), with the batch sizes and times they may use; with
    orientation, only those of one orientation (tall: rows > cols; None: both, as without)."""

    n: int
    m: int
    members: tuple[int, ...]  # matrix indices, in (layer, index) order
    times_s: dict[int, float]  # batch size -> T(s, b), every b in 1..max_batch that was priced
    methods: dict[int, str]  # batch size -> method that prices it (differs per size only for "auto")
    sizes: tuple[int, ...]  # usable, non-dominated batch sizes, ascending (see module docstring)
    state_bytes: int  # owned state of one matrix of this class
    momentum_s: dict[int, float] = field(default_factory=dict)  # batch size -> owner momentum in times_s
    tall: bool | None = None  # orientation kept apart: True = rows > cols, False = rows <= cols; None = both
    k: int = 1  # matrices per member (MatrixSpec.count): a batch of b members is one call of b x k matrices

    @property
    def label(self) -> str:
        """The members' own shape (rows x cols): the NS shape n x m unless the class holds tall ones."""
        return f"{self.m}x{self.n}" if self.tall else f"{self.n}x{self.m}"

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def unit_s(self) -> float:
        return min(t / b for b, t in self.times_s.items())

    @property
    def min_call_s(self) -> float:
        return min(self.times_s.values())


@dataclass(frozen=True)
class PieceType:
    """One member's share of a split batch: b matrices of class `cls` over an aligned group of k ranks."""

    cls: int
    k: int
    batch: int
    compute_s: float
    comm_s: float
    method: str
    momentum_s: float = 0.0  # the lead's momentum pass over the batch, which every member waits for

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s + self.momentum_s


@dataclass
class WorkModel:
    """The balancing input: shape classes, rank count, optional memory cap, split piece types."""

    matrices: tuple[MatrixSpec, ...]
    world_size: int
    classes: tuple[ShapeClass, ...]
    memory_cap_bytes: float | None = None
    pieces: tuple[PieceType, ...] = ()
    max_split: int = 1
    links_source: str = ""
    _split_cache: dict = field(default_factory=dict, repr=False)
    _lb_terms: dict[str, float] | None = field(default=None, repr=False)

    @property
    def lower_bound_s(self) -> float:
        return max(self.lower_bound_terms().values())

    def lower_bound_terms(self) -> dict[str, float]:
        """Every valid lower bound on the makespan, by name (see the module docstring for the first two).

        pigeonhole <class>: count(s) matrices on N ranks -> some rank holds q = ceil(count / N) of them and
            runs batches covering >= q matrices of s: >= cover(s, q) = min_{j >= q} best batching of j.
        top-<k>: of the k N + 1 matrices with the largest min_call, some rank holds k + 1: >= the cheapest
            way to hold k + 1 of them (a small knapsack over classes of cover(s, j)); k <= TOP_K_MAX.
        """
        if self._lb_terms is None:
            n_ranks = self.world_size
            splittable = {p.cls for p in self.pieces}
            whole = [s for s in range(len(self.classes)) if s not in splittable]
            if self.pieces:
                fastest = [min([c.min_call_s] + [p.time_s for p in self.pieces if p.cls == s])
                           for s, c in enumerate(self.classes)]
                options = [(c.count, [(t, 1, b) for b, t in c.times_s.items()]
                            + [(p.time_s, p.k, p.batch) for p in self.pieces if p.cls == s])
                           for s, c in enumerate(self.classes)]
                terms = {"area/N (split-aware)": area_bound(options, n_ranks),
                         "largest call (split-aware)": max(fastest)}
            else:
                work = sum(c.count * c.unit_s for c in self.classes)
                terms = {"work/N": work / n_ranks, "largest call": max(c.min_call_s for c in self.classes)}
            for s in whole:
                c = self.classes[s]
                q = -(-c.count // n_ranks)
                if q > 1:
                    terms[f"pigeonhole {c.label}"] = self.cover_s(s, q)
            order = sorted(whole, key=lambda s: (-self.classes[s].min_call_s, s))
            total = sum(self.classes[s].count for s in whole)
            for k in range(1, TOP_K_MAX + 1):
                if k * n_ranks + 1 > total:
                    break
                left, avail = k * n_ranks + 1, {}
                for s in order:
                    avail[s] = min(left, self.classes[s].count)
                    left -= avail[s]
                    if not left:
                        break
                best = [0.0] + [math.inf] * (k + 1)  # best[j]: cheapest way to hold j of the top set
                for s, a in avail.items():
                    best = [
                        min(best[j - i] + (self.cover_s(s, i) if i else 0.0) for i in range(min(a, j) + 1))
                        for j in range(k + 2)
                    ]
                terms[f"top-{k}"] = best[k + 1]
            self._lb_terms = terms
        return self._lb_terms

    def split_cost_s(self, s: int, k: int) -> float:
        """Time of `best_split(s, k)`, summed largest batch first (memoized over shared prefixes)."""
        done = self._split_cache.setdefault(("cost", s), {})
        if k not in done:
            dp = self._dp(s, None, k)
            pre = self._split_cache.setdefault(("sum", s), {(): 0.0})
            done[k] = batchdp.descending_sum(dp, k, self.classes[s].times_s, pre)
        return done[k]

    def cover_s(self, s: int, k: int) -> float:
        """Cheapest batches of class s that hold at least k of its matrices."""
        return self.split_cost_s(s, self.cover_count(s, k))

    def cover_count(self, s: int, k: int) -> int:
        """The j >= k whose best batching is cheapest (j = k unless the table is not monotone; ties: the
        smallest j), from a suffix arg-min over j = count .. 0 computed once per class."""
        count = self.classes[s].count
        if not 0 <= k <= count:
            raise ValueError(f"cover_count: k must be in 0..{count}, got {k}")
        best = self._split_cache.get(("cover", s))
        if best is None:
            best = batchdp.suffix_argmin([self.split_cost_s(s, j) for j in range(count + 1)])
            self._split_cache[("cover", s)] = best
        return best[k]

    def best_split(self, s: int, k: int, max_size: int | None = None) -> tuple[int, ...]:
        """Batch sizes (descending) covering k matrices of class s at least total time (DP over the usable
        sizes <= max_size; ties: fewer batches, then larger batches first)."""
        key = ("split", s, k, max_size)  # kept: LPT asks per cap and rank (~300,000 calls at 65,536 ranks)
        if key not in self._split_cache:
            self._split_cache[key] = self._dp(s, max_size, k).sizes(k)
        return self._split_cache[key]

    def _dp(self, s: int, max_size: int | None, k: int) -> batchdp.SplitDP:
        cls = self.classes[s]
        desc = tuple(sorted((b for b in cls.sizes if max_size is None or b <= max_size), reverse=True))
        dp = self._split_cache.get(("dp", s, desc))  # caps that leave the same sizes share one table
        if dp is None:
            dp = self._split_cache[("dp", s, desc)] = batchdp.SplitDP.start(desc)
        dp.extend(k, cls.times_s)
        return dp


Loads = list[dict[int, list[int]]]  # per rank: class index -> batch sizes it runs


def build_work_model(
    matrices: Sequence[MatrixSpec],
    world_size: int,
    cost,
    *,
    method: str = "gram_sym",
    dtype: str = "bf16",
    batching: bool = True,
    max_batch: int = 8,
    memory_cap_bytes: float | None = None,
    max_split: int = 1,
    links=None,
    owner_momentum: bool = True,
    orientation: bool | Collection[tuple[int, int]] = False,
) -> WorkModel:
    """Group matrices into shape classes and price every batch size with the cost table; with
    max_split > 1 also the split piece types (groups of 2, 4, ... <= max_split ranks, priced by
    `split.split_price` with `links`, default the cost table device's `split.LINKS` entry).
    owner_momentum: every T(s, b) includes the owner's momentum pass over the b matrices
    (`momentum_time`), as the replicated and fsdp2-owner layouts run it; False for fsdp2-sharded, where
    every rank runs the momentum on its shards (not owner work).
    orientation: True = tall and wide matrices never share a class (nor a batch); a collection of NS shapes
    (n, m), n <= m = only those shapes' classes are kept apart; False (the default) = classes by (n, m)
    alone, as before."""
    if not isinstance(owner_momentum, bool):
        raise InputError(f"owner_momentum must be True or False, got {owner_momentum!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_RANKS:
        raise InputError(f"world_size must be a positive integer (at most {MAX_RANKS}), got {world_size!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise InputError(f"max_batch must be a positive integer, got {max_batch!r}")
    if method not in PLAN_METHODS:
        raise choice_error("method", method, PLAN_METHODS)
    matrices = tuple(matrices)
    if not matrices:
        raise InputError("no matrices to plan: the workload has no Muon-managed matrices")
    names = [mat.name for mat in matrices]
    if len(set(names)) != len(names):
        dup = sorted({x for x in names if names.count(x) > 1})
        raise InputError(f"matrix names must be unique; repeated: {dup[:5]}")
    classes = []
    for (n, m, tall, k), members in sorted(class_groups(matrices, orientation).items()):
        top = min(max_batch, len(members)) if batching else 1
        times, meths, moms = {}, {}, {}
        for b in range(1, top + 1):
            cands = getattr(cost, "runnable_methods", METHODS) if method == AUTO_METHOD else (method,)
            priced = [(cost.ns_time(n, m, b * k, mt, dtype).time_s, METHODS.index(mt), mt) for mt in cands]
            t, _, mt = min(priced)
            moms[b] = momentum_time(cost, n * m, b * k) if owner_momentum else 0.0
            times[b], meths[b] = t + moms[b], mt
        usable = [1] + [b for b in range(2, top + 1) if times[b] < b * times[1]]
        sizes = tuple(
            b
            for b in usable
            if not any(
                b1 in usable and (b - b1) in usable and times[b1] + times[b - b1] <= times[b]
                for b1 in range(1, b // 2 + 1)
            )
        )
        state = n * m * k * STATE_BYTES_PER_ELEMENT
        classes.append(ShapeClass(n, m, tuple(members), times, meths, sizes, state, moms,
                                  None if tall == BOTH else bool(tall), k))
    check_max_split(max_split)
    pieces: tuple[PieceType, ...] = ()
    links_source = ""
    if max_split > 1 and world_size > 1:
        if memory_cap_bytes is not None:
            raise InputError("max_split > 1 with a memory cap is not supported (the per-rank model has no "
                             "split batches); accepted: max_split=1 with memory_cap_bytes, or no cap")
        links = links_for(cost, links)
        links_source = getattr(links, "source", "") or type(links).__name__
        pieces = _price_pieces(tuple(classes), cost, method, dtype, max_split, world_size, links)
    model = WorkModel(matrices, world_size, tuple(classes), memory_cap_bytes, pieces, max_split, links_source)
    _check_memory(model)
    return model


def _price_pieces(classes, cost, method, dtype, max_split, world_size, links) -> tuple[PieceType, ...]:
    """Every useful piece type (see the module docstring), per class, group size and batch size."""
    out = []
    cands = getattr(cost, "runnable_methods", METHODS) if method == AUTO_METHOD else (method,)
    for s, cls in ((s, c) for s, c in enumerate(classes) if c.k == 1):  # one parameter's matrices: unsplit
        for b in cls.times_s:
            beat = cls.times_s[b]  # the unsplit call of the same b matrices
            for k in split_levels(max_split, world_size, cls.m):
                ranks = tuple(range(k))
                priced = []
                for mt in cands:
                    pr = split_price(cost, cls.n, cls.m, b, k, mt, dtype, links, ranks)
                    priced.append((pr.time_s, METHODS.index(mt), mt, pr))
                t, _, mt, pr = min(priced)
                # the runtime's lead runs the whole batch's momentum before scattering the blocks
                # (dmuon.runtime.split_exec), so every member waits for it: the piece pays it in full
                mom = cls.momentum_s.get(b, 0.0)
                if t + mom < beat:
                    out.append(PieceType(s, k, b, pr.compute_s, pr.comm_s, mt, mom))
                    beat = t + mom
    return tuple(out)


def _check_memory(model: WorkModel) -> None:
    cap = model.memory_cap_bytes
    if cap is None:
        return
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise InputError(f"memory_cap_bytes must be a positive number of bytes (or None), got {cap!r}")
    biggest = max(c.state_bytes for c in model.classes)
    if biggest > cap:
        raise InputError(
            f"memory cap {cap:.4g} B per rank is below the owned state of one matrix "
            f"({biggest:.4g} B = numel x {STATE_BYTES_PER_ELEMENT} B: fp32 momentum + fp32 copy)"
        )
    total = sum(c.count * c.state_bytes for c in model.classes)
    if total > cap * model.world_size:
        raise InputError(
            f"memory cap {cap:.4g} B x {model.world_size} ranks cannot hold the owned state "
            f"{total:.4g} B (numel x {STATE_BYTES_PER_ELEMENT} B); raise the cap or add ranks"
        )


def rank_load_s(model: WorkModel, loads: dict[int, list[int]]) -> float:
    return sum(model.classes[s].times_s[b] for s, sizes in loads.items() for b in sizes)


def rank_state_bytes(model: WorkModel, loads: dict[int, list[int]]) -> int:
    return sum(model.classes[s].state_bytes * b for s, sizes in loads.items() for b in sizes)


def rebatch(model: WorkModel, loads: Loads) -> Loads:
    """Per rank and class, the cheapest batching of the matrices it holds (never increases a load)."""
    out: Loads = []
    for rank in loads:
        new = {}
        for s, sizes in rank.items():
            k = sum(sizes)
            if k:
                best = list(model.best_split(s, k))
                cls = model.classes[s]
                new[s] = (
                    best
                    if sum(cls.times_s[b] for b in best) < sum(cls.times_s[b] for b in sizes)
                    else sorted(sizes, reverse=True)
                )
        out.append(new)
    return out


def round_robin(model: WorkModel) -> tuple[Loads, tuple[int, ...]]:
    """Matrix i (in (layer, index) order) -> the next rank with room, cyclically; then each rank batches
    what it holds. Returns the loads and the explicit owner of every matrix."""
    n_ranks = model.world_size
    cls_of = {i: s for s, c in enumerate(model.classes) for i in c.members}
    owners = [-1] * len(model.matrices)
    used = [0] * n_ranks
    cap = model.memory_cap_bytes
    rank = 0
    for i in sorted(cls_of, key=lambda i: (model.matrices[i].layer, i)):
        need = model.classes[cls_of[i]].state_bytes
        for step in range(n_ranks):
            r = (rank + step) % n_ranks
            if cap is None or used[r] + need <= cap:
                break
        else:
            raise InputError(f"memory cap {cap:.4g} B per rank: no rank has room for matrix "
                             f"{model.matrices[i].name!r} under round-robin; raise the cap")
        owners[i] = r
        used[r] += need
        rank = (r + 1) % n_ranks
    counts: list[dict[int, int]] = [{} for _ in range(n_ranks)]
    for i, r in enumerate(owners):
        counts[r][cls_of[i]] = counts[r].get(cls_of[i], 0) + 1
    loads = [{s: list(model.best_split(s, k)) for s, k in sorted(c.items())} for c in counts]
    return loads, tuple(owners)


def _counts(model: WorkModel, counts) -> list[int]:
    return [c.count for c in model.classes] if counts is None else list(counts)


def lpt_for_cap(model: WorkModel, max_size: int, counts=None, initial=None) -> Loads | None:
    """LPT with batches of at most `max_size`: each class split at least work, batches longest first, each
    to the least-loaded rank with memory room (ties: lowest rank). None if the memory cap blocks it.
    counts: matrices per class to place (default: all); initial: per-rank load already there (split
    batches)."""
    jobs = []
    for s, count in enumerate(_counts(model, counts)):
        for b in model.best_split(s, count, max_size) if count else ():
            jobs.append((-model.classes[s].times_s[b], s, -b))
    jobs.sort()
    n_ranks = model.world_size
    load = [0.0] * n_ranks if initial is None else list(initial)
    used = [0] * n_ranks
    loads: Loads = [{} for _ in range(n_ranks)]
    cap = model.memory_cap_bytes
    heap = [(load[r], r) for r in range(n_ranks)]  # (load, rank): least loaded, lowest rank first
    heapq.heapify(heap)
    for neg_t, s, neg_b in jobs:
        b, need = -neg_b, model.classes[s].state_bytes * -neg_b
        # the heap holds (load, rank) of every rank: the first with room is the least loaded one that fits
        full = []
        while heap and cap is not None and used[heap[0][1]] + need > cap:
            full.append(heapq.heappop(heap))
        if not heap:
            return None
        best = heap[0][1]
        load[best] -= neg_t
        used[best] += need
        loads[best].setdefault(s, []).append(b)
        heapq.heapreplace(heap, (load[best], best))  # pop + push; (load, rank) orders the same set alike
        for item in full:
            heapq.heappush(heap, item)
    return loads


def lpt_marginal(model: WorkModel, counts=None, initial=None) -> Loads | None:
    """LPT over single matrices (largest T(s, 1) first), each to the rank whose load grows least, where
    adding a matrix of class s to a rank holding k of them costs cover(k + 1) - cover(k): batching
    economies make small matrices gather on the ranks that already run their class (ties: lowest rank).
    None if the memory cap blocks it.

    The matrices of one class come one after another, and while they are placed only the chosen rank's
    load and count change; so the ranks holding k matrices of the class keep one heap keyed by their
    exact candidate load (load + cover(k + 1) - cover(k), rank), and each matrix looks only at the top of
    every such heap: O(log N + distinct k) per matrix instead of O(N)."""
    n_ranks, todo = model.world_size, _counts(model, counts)
    counts = [[0] * len(model.classes) for _ in range(n_ranks)]
    load, used = [0.0] * n_ranks if initial is None else list(initial), [0] * n_ranks
    cap = model.memory_cap_bytes
    order = sorted((-c.times_s[1], s) for s, c in enumerate(model.classes) if todo[s])
    for _, s in order:
        need = model.classes[s].state_bytes
        costs = [model.split_cost_s(s, k) for k in range(todo[s] + 1)]
        fits = [r for r in range(n_ranks) if cap is None or used[r] + need <= cap]
        heaps: dict[int, list[tuple[float, int]]] = {0: [(load[r] + costs[1] - costs[0], r) for r in fits]}
        heapq.heapify(heaps[0])
        for _ in range(todo[s]):
            tops = [(h[0], k) for k, h in heaps.items() if h]
            if not tops:
                return None
            (new, best), k = min(tops)
            heapq.heappop(heaps[k])
            if not heaps[k]:  # emptied: `tops` scans live heaps, not every k seen (quadratic on few ranks)
                del heaps[k]
            load[best] = new
            counts[best][s] += 1
            used[best] += need
            if k + 1 < todo[s] and (cap is None or used[best] + need <= cap):
                heapq.heappush(heaps.setdefault(k + 1, []), (new + costs[k + 2] - costs[k + 1], best))
    return [{s: list(model.best_split(s, k)) for s, k in enumerate(row) if k} for row in counts]


def lpt(model: WorkModel, counts=None, initial=None) -> Loads:
    """Greedy LPT: over batches with every batch-size cap 1..max usable size, and over single matrices
    with marginal batching costs (`lpt_marginal`); the best makespan wins (ties: less total work, then
    candidate order). Each rank then re-batches what it holds. counts / initial: as `lpt_for_cap`.
    Without a memory cap the same loads come from `lpt_sparse` (visiting only the ranks that get work)."""
    if lpt_sparse.usable(model, initial):
        return lpt_sparse.uncapped_lpt(model, counts, initial, rebatch, rank_load_s)
    top, best_key, best = max(max(c.sizes) for c in model.classes), None, None
    candidates = [lambda cap=cap: lpt_for_cap(model, cap, counts, initial) for cap in range(1, top + 1)]
    candidates.append(lambda: lpt_marginal(model, counts, initial))
    base = [0.0] * model.world_size if initial is None else initial
    for idx, make in enumerate(candidates):
        loads = make()
        if loads is None:
            continue
        loads = rebatch(model, loads)
        per_rank = [(rank_load_s(model, r) if r else 0) + b for r, b in zip(loads, base, strict=True)]
        key = (max(per_rank), sum(per_rank), idx)
        if best_key is None or key < best_key:
            best_key, best = key, loads
    if best is None:
        raise InputError(f"memory cap {model.memory_cap_bytes:.4g} B per rank: LPT found no placement of "
                         "every matrix; raise the cap or add ranks")
    return best
