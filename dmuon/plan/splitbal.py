"""Balancing with split batches: which matrices to split k ways (LPT side), and the assignment's form.

An assignment with splits is `(loads, jobs)`: `loads` as in `balance` (per rank, class -> batch sizes of
its unsplit batches) and `jobs`, one `Job` per split batch (a piece type of `WorkModel.pieces` on an
aligned group of ranks, `split.place_groups`). Every rank is in at most one job, so a rank's load is its
unsplit batches plus the piece time of its job; the makespan is the largest such load, and it is what a
rank runs in any order (the group's members start their split batch together when it comes first).

`split_lpt` (the greedy): for each target makespan T out of the piece times and the classes' smallest
unsplit calls between the lower bound and the unsplit LPT makespan (at most MAX_TARGETS of them, evenly
spaced in sorted order), every matrix whose class cannot run unsplit within T goes into split batches of
the piece type with the least rank-seconds per matrix (k T_p / b) among those of <= T; then `target`
more of the longest whole matrices, one class at a time, as long as that lowers the makespan; the
groups are laid out (`place_groups`) and the whole matrices balanced around them by `balance.lpt`
(starting from the pieces' loads). The plan with the smallest makespan wins; ties go to less total
work, then to fewer split batches, so the unsplit LPT plan is kept wherever splitting does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass

from .balance import Loads, WorkModel, lpt, rank_load_s
from .split import place_groups

MAX_TARGETS = 24


@dataclass(frozen=True)
class Job:
    """One split batch: piece type `piece` (an index into WorkModel.pieces) on the ranks `ranks`."""

    piece: int
    ranks: tuple[int, ...]


Assignment = tuple[Loads, tuple[Job, ...]]


def background(model: WorkModel, jobs) -> list[float]:
    """Per-rank seconds of the split batches in `jobs`."""
    bg = [0.0] * model.world_size
    for j in jobs:
        for r in j.ranks:
            bg[r] += model.pieces[j.piece].time_s
    return bg


def loads_s(model: WorkModel, assignment: Assignment) -> list[float]:
    loads, jobs = assignment
    return [rank_load_s(model, r) + b for r, b in zip(loads, background(model, jobs), strict=True)]


def makespan_s(model: WorkModel, assignment: Assignment) -> float:
    return max(loads_s(model, assignment))


def residual_counts(model: WorkModel, jobs) -> list[int]:
    counts = [c.count for c in model.classes]
    for j in jobs:
        counts[model.pieces[j.piece].cls] -= model.pieces[j.piece].batch
    return counts


def jobs_for(model: WorkModel, pieces: list[int]) -> tuple[Job, ...] | None:
    """Jobs for the piece types `pieces` (one per split batch) laid out on aligned groups; None if they need
    more ranks than there are."""
    widths = [model.pieces[p].k for p in pieces]
    if sum(widths) > model.world_size:
        return None
    return tuple(Job(p, ranks) for p, ranks in zip(pieces, place_groups(widths), strict=True))


def _pieces_for(model: WorkModel, s: int, count: int, t_s: float) -> list[int] | None:
    """Split batches covering `count` matrices of class s, each of <= t_s, with the least rank-seconds per
    matrix (the last one may hold fewer matrices); None if no piece type of s fits in t_s."""
    fits = [i for i, p in enumerate(model.pieces) if p.cls == s and p.time_s <= t_s * (1 + 1e-12)]
    out: list[int] = []
    while count > 0:
        usable = [i for i in fits if model.pieces[i].batch <= count]
        if not usable:
            return None
        best = min(usable, key=lambda i: (model.pieces[i].k * model.pieces[i].time_s / model.pieces[i].batch,
                                          model.pieces[i].k, -model.pieces[i].batch, i))
        out.append(best)
        count -= model.pieces[best].batch
    return out


def _key(model: WorkModel, a: Assignment) -> tuple:
    loads = loads_s(model, a)
    return (max(loads), sum(loads), len(a[1]))


def _assign(model: WorkModel, pieces: list[int]) -> Assignment | None:
    jobs = jobs_for(model, pieces)
    if jobs is None:
        return None
    counts = residual_counts(model, jobs)
    if not any(counts):
        return [{} for _ in range(model.world_size)], jobs
    return lpt(model, counts=counts, initial=background(model, jobs)), jobs


def targets(model: WorkModel, upper_s: float) -> list[float]:
    """Candidate makespans: piece times and smallest unsplit calls in [lower bound, upper_s)."""
    lb = model.lower_bound_s
    values = {p.time_s for p in model.pieces} | {c.min_call_s for c in model.classes} | {lb}
    cands = sorted(t for t in values if lb * (1 - 1e-12) <= t < upper_s)
    if len(cands) > MAX_TARGETS:
        step = (len(cands) - 1) / (MAX_TARGETS - 1)
        cands = [cands[round(i * step)] for i in range(MAX_TARGETS)]
    return cands


def split_lpt(model: WorkModel, start: Loads | None = None) -> Assignment:
    """The greedy balancer with splits (see the module docstring); `start`: the unsplit LPT loads."""
    best: Assignment = (lpt(model) if start is None else start, ())
    if not model.pieces:
        return best
    best_key = _key(model, best)
    for t_s in targets(model, best_key[0]):
        pieces: list[int] = []
        feasible = True
        for s, c in enumerate(model.classes):
            if c.min_call_s > t_s * (1 + 1e-12):  # cannot run unsplit within the target
                got = _pieces_for(model, s, c.count, t_s)
                if got is None:
                    feasible = False
                    break
                pieces += got
        if not feasible:
            continue
        cand = _assign(model, pieces)
        if cand is None:
            continue
        cand_key = _key(model, cand)
        # more splits of the longest whole matrices while that lowers the makespan
        for s in sorted(range(len(model.classes)), key=lambda s: -model.classes[s].min_call_s):
            left = residual_counts(model, cand[1])[s]
            while left > 0:
                more = _pieces_for(model, s, 1, t_s)
                trial = _assign(model, pieces + more) if more else None
                if trial is None or _key(model, trial)[0] >= cand_key[0]:
                    break
                pieces += more
                cand, cand_key = trial, _key(model, trial)
                left -= model.pieces[more[0]].batch
        if cand_key < best_key:
            best, best_key = cand, cand_key
    return best


def trim_surplus(model: WorkModel, loads: Loads, counts=None, initial=None) -> Loads | None:
    """Drop slots beyond each class's count (`counts`, default all matrices: a grouped model or a
    configuration plan covers some twice), from the most loaded ranks first (`initial`: per-rank seconds
    already there), shrinking batches; None if the slots do not cover every matrix."""
    loads = [{s: sorted(v, reverse=True) for s, v in r.items() if v} for r in loads]
    base = [0.0] * len(loads) if initial is None else initial
    for s, cls in enumerate(model.classes):
        need = cls.count if counts is None else counts[s]
        surplus = sum(sum(r.get(s, ())) for r in loads) - need
        if surplus < 0:
            return None
        while surplus > 0:
            r = max(
                (r for r in range(len(loads)) if loads[r].get(s)),
                key=lambda r: (rank_load_s(model, loads[r]) + base[r], -r),
            )
            sizes = loads[r][s]
            b = sizes.pop()  # the smallest batch of this class on that rank
            drop = min(b, surplus)
            if b - drop:
                sizes.extend(model.best_split(s, b - drop))
                sizes.sort(reverse=True)
            surplus -= drop
        for r in loads:
            if s in r and not r[s]:
                del r[s]
    return loads


def trim_jobs(model: WorkModel, jobs) -> tuple[Job, ...] | None:
    """Split batches covering at most each class's count: the longest surplus jobs are dropped or given a
    smaller piece type on the first ranks of their group (still aligned); None if a needed smaller piece
    type does not exist."""
    jobs = list(jobs)
    for s, cls in enumerate(model.classes):
        mine = sorted((i for i, j in enumerate(jobs) if model.pieces[j.piece].cls == s),
                      key=lambda i: (-model.pieces[jobs[i].piece].time_s, i))
        surplus = sum(model.pieces[jobs[i].piece].batch for i in mine) - cls.count
        for i in mine:
            if surplus <= 0:
                break
            p = model.pieces[jobs[i].piece]
            if p.batch <= surplus:
                surplus -= p.batch
                jobs[i] = None
                continue
            want = p.batch - surplus
            smaller = [q for q, t in enumerate(model.pieces) if t.cls == s and t.batch == want and t.k <= p.k]
            if not smaller:
                return None
            q = min(smaller, key=lambda q: (model.pieces[q].time_s, model.pieces[q].k))
            jobs[i] = Job(q, jobs[i].ranks[: model.pieces[q].k])
            surplus = 0
    return tuple(j for j in jobs if j is not None)
