"""Configuration search: identical ranks aggregated exactly, by column generation (HiGHS) + a MILP.

Identical ranks make a rank's work a *configuration*: k(s) matrices of each shape class s, costing
C(k) = sum_s cover(s, k(s)) when it batches them optimally (`WorkModel.cover_s`). A makespan T is
feasible iff N configurations of cost <= T cover every class. For a trial T:

  bound:  the configuration LP  min sum_p y_p  s.t.  sum_p k_p(s) y_p >= count(s), y >= 0, over every
          configuration with C <= T, solved by column generation (pricing: a knapsack over classes,
          dynamic programming on a grid of G steps of T). Costs are rounded DOWN to the grid, so the LP
          is a relaxation: if it needs more than N ranks, no plan has makespan <= T (a proof). Bisection
          over T gives the largest such T: a lower bound on the optimal makespan, usually far above
          max(work / N, largest call) because it knows that large matrices do not split.
  plan:   at a trial T (first just above the LP bound, then bisecting up towards the start's makespan):
          column generation with costs rounded UP (every configuration truly fits in T), then residual
          rounding ("diving": fix the configurations the LP uses, re-solve for what is left), and if that
          fails the MILP over the generated configurations (pulp + HiGHS): min sum_p y_p C_p s.t. cover,
          sum_p y_p <= N, y integer, exact cost <= T. Once the smallest feasible T is found, the same MILP
          at that makespan minimizes the total work (lexicographic: makespan first, then work).
Split batches (`WorkModel.pieces`): a configuration may also hold one piece p = (s, k, b) (one member's
share of b matrices of s split over k ranks, `splitbal`), costing T_p more. In the LP such a rank covers
b / k matrices of s (a relaxation); in the integer program a piece configuration is chosen in whole
groups of k ranks (g groups use k g ranks and cover b g matrices of s, plus k g times its whole ones),
and each group becomes an aligned block of ranks (`split.place_groups`); the pricing knapsack adds the
best piece on top of the residual's table (one more stage). The bound is then one for plans in which
every rank is in at most one split batch, which is every plan `build_plan` makes.
The size of every model is independent of N (256 ranks cost what 8 do). numpy, highspy and pulp are
imported inside `configuration_search`.

Determinism: every loop is bounded by work, not by the clock: at most CG_MAX_ROUNDS pricing rounds per
LP, bisections until BISECTION_REL_TOL (at most PLAN_MAX_TRIALS plan trials), trial MILPs stop after
TRIAL_MAX_NODES branch-and-bound nodes, the final one after IP_MAX_NODES (HiGHS, one thread, fixed
seed). The wall clock (`Budget`) is only a safety net; when it stops a phase the result says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .balance import WorkModel
from .solver import Budget, new_highs, new_var, stopped_by_clock
from .split import place_groups
from .splitbal import Assignment, Job, loads_s, makespan_s, trim_jobs, trim_surplus

GRID = 2000  # pricing grid steps per trial makespan
BISECTION_REL_TOL = 2e-4
CG_MAX_ROUNDS = 200  # pricing rounds per configuration LP (the project's workloads need <= 40)
PLAN_MAX_TRIALS = 16  # trial makespans of the plan bisection
TRIAL_MAX_NODES = 10  # branch-and-bound nodes of a trial's configuration MILP (does T admit a plan?)
IP_MAX_NODES = 200  # branch-and-bound nodes of the final (least total work) configuration MILP

# A configuration is a tuple: k(s) for every class s, then piece index + 1 (0: no piece).


@dataclass
class ConfigResult:
    assignment: Assignment | None  # None: no integer plan found in time
    bound_s: float  # proven lower bound on the makespan (0 if none proven)
    notes: list[str] = field(default_factory=list)


class _Pool:
    """Generated configurations with their exact costs, and what one group of each covers."""

    def __init__(self, model: WorkModel):
        self.model = model
        self.n_classes = len(model.classes)
        self.configs: dict[tuple[int, ...], float] = {}

    def piece(self, k: tuple[int, ...]):
        return self.model.pieces[k[-1] - 1] if k[-1] else None

    def width(self, k: tuple[int, ...]) -> int:
        p = self.piece(k)
        return p.k if p else 1

    def cost(self, k: tuple[int, ...]) -> float:
        p = self.piece(k)
        return sum(self.model.cover_s(s, ks) for s, ks in enumerate(k[:-1]) if ks) + (p.time_s if p else 0.0)

    def group_cover(self, k: tuple[int, ...]) -> list[int]:
        """Matrices of each class one group (width ranks) of configuration k covers."""
        w, p = self.width(k), self.piece(k)
        out = [w * ks for ks in k[:-1]]
        if p:
            out[p.cls] += p.batch
        return out

    def rank_cover(self, k: tuple[int, ...]) -> list[float]:
        """Per rank (the LP's coefficients): whole matrices + b / k of a piece's class."""
        return [c / self.width(k) for c in self.group_cover(k)]

    def add(self, k: tuple[int, ...]) -> None:
        if any(k) and k not in self.configs:
            self.configs[k] = self.cost(k)


def _cover_table(model: WorkModel) -> list[list[float]]:
    return [
        [model.cover_s(s, k) if k else 0.0 for k in range(c.count + 1)] for s, c in enumerate(model.classes)
    ]


def _grid_cost(cover_s_k: float, unit: float, rounding: str) -> int:
    x = cover_s_k / unit
    return int(math.floor(x + 1e-9)) if rounding == "floor" else int(math.ceil(x - 1e-9))


def _price(
    np, model, cover, duals: list[float], t_s: float, counts: list[int], rounding: str
) -> tuple[float, tuple]:
    """max sum_s duals[s] cover(s) over configurations of grid cost <= GRID (unit T / GRID; costs rounded
    down: a relaxation of C(k) <= T, for bounds; or up: only truly feasible configurations). A knapsack
    over classes, then one stage for the piece (at most one per rank) on top of the residual's table."""
    unit = t_s / GRID
    best = np.zeros(GRID + 1)  # best[c] = max value with grid cost <= c (non-decreasing in c)
    choices = []
    for s, pi in enumerate(duals):
        choice = np.zeros(GRID + 1, dtype=np.int64)
        if pi > 1e-12:
            new = best.copy()
            for k in range(1, counts[s] + 1):
                w = _grid_cost(cover[s][k], unit, rounding)
                if w > GRID:
                    break
                cand = np.full(GRID + 1, -np.inf)
                cand[w:] = best[: GRID + 1 - w] + pi * k
                better = cand > new + 1e-12
                new = np.where(better, cand, new)
                choice = np.where(better, k, choice)
            best = new
        choices.append(choice)
    c, value, piece = GRID, float(best[GRID]), 0
    for i, p in enumerate(model.pieces):
        pi = duals[p.cls]
        w = _grid_cost(p.time_s, unit, rounding)
        if pi > 1e-12 and counts[p.cls] > 0 and w <= GRID:
            v = float(best[GRID - w]) + pi * p.batch / p.k
            if v > value + 1e-12:
                c, value, piece = GRID - w, v, i + 1
    k = [0] * len(duals)
    for s in range(len(duals) - 1, -1, -1):
        ks = int(choices[s][c])
        if ks:
            k[s] = ks
            c -= _grid_cost(cover[s][ks], unit, rounding)
    return value, (*k, piece)


@dataclass
class _LP:
    status: str  # "needs_more" | "fits" | "limit" (CG_MAX_ROUNDS reached) | "timeout" (wall clock)
    value: float = math.inf  # ranks the LP needs
    columns: dict[tuple, float] = field(default_factory=dict)  # configuration -> LP multiplicity (ranks)


def _seed_column(pool: _Pool, cover, s: int, demand: int, unit: float, rounding: str):
    """A column covering class s alone within T: the most whole matrices, else the piece type with the
    least rank-seconds per matrix; None if neither fits (one matrix of s exceeds T)."""
    n = pool.n_classes
    ks = max((j for j in range(1, demand + 1) if _grid_cost(cover[s][j], unit, rounding) <= GRID), default=0)
    if ks:
        return tuple(ks if j == s else 0 for j in range(n)) + (0,)
    fits = [i for i, p in enumerate(pool.model.pieces)
            if p.cls == s and _grid_cost(p.time_s, unit, rounding) <= GRID]
    if not fits:
        return None
    i = min(fits, key=lambda i: (pool.model.pieces[i].k * pool.model.pieces[i].time_s
                                 / pool.model.pieces[i].batch, i))
    return (0,) * n + (i + 1,)


def _column_generation(
    np, highspy, pool: _Pool, cover, demands: list[int], n_ranks: int, t_s: float, budget: Budget, *,
    rounding: str, stop_when_fits: bool,
) -> _LP:
    """Configuration LP  min sum y  s.t. sum_p cover_p y_p >= demands  at makespan T, by column generation
    (y in ranks). status "needs_more": the LP needs more than n_ranks (with floor rounding: a proof that
    T is infeasible); "fits": an LP solution with <= n_ranks (with stop_when_fits, possibly not optimal);
    "limit": CG_MAX_ROUNDS pricing rounds did not settle it; "timeout": the wall-clock safety net."""
    unit = t_s / GRID
    model = pool.model

    def grid_cost(k):
        p = pool.piece(k)
        return (sum(_grid_cost(cover[s][ks], unit, rounding) for s, ks in enumerate(k[:-1]) if ks)
                + (_grid_cost(p.time_s, unit, rounding) if p else 0))

    h = new_highs(highspy)
    h.setOptionValue("threads", 1)
    inf = highspy.kHighsInf
    empty_i, empty_v = np.array([], dtype=np.int32), np.array([], dtype=np.float64)
    for d in demands:
        h.addRow(float(d), inf, 0, empty_i, empty_v)
    cols: list[tuple] = []

    def add_col(k):
        cov = pool.rank_cover(k)
        idx = np.array([s for s in range(len(demands)) if cov[s]], dtype=np.int32)
        h.addCol(1.0, 0.0, inf, len(idx), idx, np.array([float(cov[s]) for s in idx]))
        cols.append(k)

    for k in pool.configs:
        if grid_cost(k) <= GRID and (not pool.piece(k) or demands[pool.piece(k).cls]):
            add_col(k)
    for s in range(len(demands)):  # one single-class column per class with demand keeps the LP feasible
        if not demands[s]:
            continue
        k = _seed_column(pool, cover, s, demands[s], unit, rounding)
        if k is None:
            return _LP("needs_more")  # one matrix of s exceeds T, whole or split
        pool.add(k)
        add_col(k)
    rounds = 0
    while True:
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return _LP("limit")
        lp = h.getInfo().objective_function_value
        sol = h.getSolution()
        if stop_when_fits and lp <= n_ranks + 1e-9:
            return _LP("fits", lp)
        duals = [max(0.0, d) for d in sol.row_dual]
        value, k = _price(np, model, cover, duals, t_s, demands, rounding)
        if value <= 1.0 + 1e-9:  # LP optimal
            if lp > n_ranks + 1e-9:
                return _LP("needs_more", lp)
            return _LP("fits", lp, {c: y for c, y in zip(cols, sol.col_value, strict=True) if y > 1e-9})
        if lp / value > n_ranks + 1e-9:  # Farley: LP optimum >= lp / value
            return _LP("needs_more", lp / value)
        rounds += 1
        if rounds >= CG_MAX_ROUNDS:
            return _LP("limit")
        if budget.expired("column generation"):
            return _LP("timeout")
        pool.add(k)
        add_col(k)


def _dive(np, highspy, model: WorkModel, pool: _Pool, cover, t_s: float, budget: Budget) -> Assignment | None:
    """Residual rounding: solve the LP, fix the columns it uses at least once (piece configurations: in
    whole groups; else its largest one), subtract what they cover, repeat on what is left; None if the
    ranks run out."""
    demands = [c.count for c in model.classes]
    ranks_left = model.world_size
    fixed: list[tuple] = []
    while any(demands):
        lp = _column_generation(np, highspy, pool, cover, demands, ranks_left, t_s, budget, rounding="ceil",
                                stop_when_fits=False)
        if lp.status != "fits" or not lp.columns:
            return None
        take = {k: math.floor(y / pool.width(k) + 1e-6) for k, y in lp.columns.items()
                if y >= pool.width(k) * (1 - 1e-6)}
        if not take:
            fitting = [k for k in lp.columns if pool.width(k) <= ranks_left]
            if not fitting:
                return None
            take = {max(fitting, key=lambda c: (lp.columns[c], c)): 1}
        before = len(fixed)
        for k, copies in sorted(take.items()):
            w, cov = pool.width(k), pool.group_cover(k)
            copies = min(copies, ranks_left // w)
            useful = min(copies, max(-(-demands[s] // cov[s]) for s in range(len(cov)) if cov[s]))
            fixed += [k] * useful
            demands = [max(0, d - useful * c) for d, c in zip(demands, cov, strict=True)]
            ranks_left -= useful * w
        if len(fixed) == before or ranks_left < 0 or (any(demands) and ranks_left == 0):
            return None  # no progress (degenerate LP) or out of ranks
    return _realize(model, pool, fixed)


def _realize(model: WorkModel, pool: _Pool, configs: list[tuple]) -> Assignment | None:
    """One group per entry of `configs` -> per-rank batch sizes and split jobs (aligned blocks first, then
    the plain ranks), surplus dropped."""
    widths = [pool.width(k) for k in configs]
    if sum(widths) > model.world_size:
        return None
    split = [i for i, k in enumerate(configs) if pool.piece(k)]
    blocks = place_groups([widths[i] for i in split])
    ranks_of = dict(zip(split, blocks, strict=True))
    nxt = sum(widths[i] for i in split)
    per_rank: list[tuple | None] = [None] * model.world_size
    jobs = []
    for i, k in enumerate(configs):
        if i in ranks_of:
            jobs.append(Job(k[-1] - 1, ranks_of[i]))
            for r in ranks_of[i]:
                per_rank[r] = k
        else:
            per_rank[nxt] = k
            nxt += 1
    loads = [{s: list(model.best_split(s, model.cover_count(s, ks))) for s, ks in enumerate(k[:-1]) if ks}
             if k else {} for k in per_rank]
    trimmed = trim_jobs(model, jobs)
    if trimmed is None:
        return None
    counts = [c.count for c in model.classes]
    for j in trimmed:
        counts[model.pieces[j.piece].cls] -= model.pieces[j.piece].batch
    bg = [0.0] * model.world_size
    for j in trimmed:
        for r in j.ranks:
            bg[r] += model.pieces[j.piece].time_s
    loads = trim_surplus(model, loads, counts, bg)
    return None if loads is None else (loads, trimmed)


def _integer_plan(pulp, model: WorkModel, pool: _Pool, t_s: float, budget: Budget, solver_cls, *,
                  max_nodes: int) -> Assignment | None:
    """Cheapest (total work) choice of configuration groups (<= N ranks) of exact cost <= T covering every
    class, as far as `max_nodes` branch-and-bound nodes get; None if there is none (or none was found)."""
    cols = sorted(k for k, c in pool.configs.items() if c <= t_s * (1 + 1e-12))
    if not cols or budget.expired("configuration MILP"):
        return None
    n_ranks = model.world_size
    prob = pulp.LpProblem("dmuon_configurations", pulp.LpMinimize)
    y = [new_var(pulp, prob, f"y_{i}", 0, n_ranks // pool.width(k), "Integer") for i, k in enumerate(cols)]
    scale = max(t_s, 1e-30)
    prob += pulp.lpSum(pool.width(k) * pool.configs[k] / scale * v for k, v in zip(cols, y, strict=True))
    prob += pulp.lpSum(pool.width(k) * v for k, v in zip(cols, y, strict=True)) <= n_ranks, "ranks"
    covers = [pool.group_cover(k) for k in cols]
    for s, cls in enumerate(model.classes):
        covered = pulp.lpSum(c[s] * v for c, v in zip(covers, y, strict=True) if c[s])
        prob += covered >= cls.count, f"cover_{s}"
    limits = {"timeLimit": budget.left_s(), "mip_max_nodes": max_nodes}
    prob.solve(solver_cls(None, msg=False, threads=1, gapRel=1e-6, **limits))
    if stopped_by_clock(prob.solverModel):
        budget.expired("configuration MILP", force=True)
    if prob.solverModel.getInfo().primal_solution_status == 0:
        return None
    configs = [k for k, v in zip(cols, y, strict=True) for _ in range(round(v.varValue or 0.0))]
    return _realize(model, pool, configs)


def _start_configs(model: WorkModel, start: Assignment) -> list[tuple]:
    loads, jobs = start
    piece = [0] * model.world_size
    for j in jobs:
        for r in j.ranks:
            piece[r] = j.piece + 1
    return [(*(sum(r.get(s, ())) for s in range(len(model.classes))), piece[i]) for i, r in enumerate(loads)]


def _total(model: WorkModel, a: Assignment) -> float:
    return sum(loads_s(model, a))


def configuration_search(model: WorkModel, start: Assignment, *, budget: Budget, solver_cls,
                         plan_below_s: float | None = None) -> ConfigResult:
    """Lower bound and plan from the configuration model (see the module docstring). plan_below_s: search
    a plan only if the LP bound comes out below it (the bound of a more restricted model)."""
    import highspy
    import numpy as np
    import pulp

    pool = _Pool(model)
    for k in _start_configs(model, start):
        pool.add(k)
    cover = _cover_table(model)
    start_mk = makespan_s(model, start)
    lo, hi = model.lower_bound_s, start_mk  # lo: infeasible or unproven; hi: an LP-feasible makespan
    proven = 0.0
    counts = [c.count for c in model.classes]

    def lp_says(t_s):
        return _column_generation(np, highspy, pool, cover, counts, model.world_size, t_s, budget,
                                  rounding="floor", stop_when_fits=True).status

    # bound: bisection on T for the configuration LP
    verdict = lp_says(lo)
    if verdict == "fits":
        hi = lo
    elif verdict == "needs_more":
        proven = lo
    while hi - lo > BISECTION_REL_TOL * hi and verdict != "timeout":
        mid = 0.5 * (lo + hi)
        verdict = lp_says(mid)
        if verdict in ("timeout", "limit"):
            break
        if verdict == "needs_more":
            lo = proven = mid
        else:
            hi = mid
    notes = [
        f"configurations: LP bound {proven * 1e3:.3f} ms"
        if proven > model.lower_bound_s
        else "configurations: the LP bound is no better than the combinatorial bound"
    ]
    if plan_below_s is not None and proven >= plan_below_s * (1 - 2 * BISECTION_REL_TOL):
        notes.append("configurations: split pieces do not lower the LP bound; no plan search with them")
        return ConfigResult(None, proven, notes)
    # plan: complete column generation with exact-safe (rounded-up) costs at a trial T, then the integer
    # program; bisection between the first trial (just above the LP bound) and the start's makespan
    best: Assignment | None = None
    fail, ok = None, start_mk
    steps = len(model.classes) + (1 if model.pieces else 0)  # floor rounding hid <= 1 step per stage
    trial = min(start_mk, hi * (1 + steps / GRID))
    for _ in range(PLAN_MAX_TRIALS):
        plan = _dive(np, highspy, model, pool, cover, trial, budget)
        if plan is None:
            plan = _integer_plan(pulp, model, pool, trial, budget, solver_cls, max_nodes=TRIAL_MAX_NODES)
        if plan is not None:
            mk = makespan_s(model, plan)
            if best is None or mk < makespan_s(model, best):
                best = plan
            ok = min(ok, mk)
        else:
            fail = trial
        if fail is None or ok - fail <= BISECTION_REL_TOL * ok or budget.timed_out:
            break
        trial = 0.5 * (fail + ok)
    if best is not None:
        mk = makespan_s(model, best)
        # lexicographic second step: least total work among plans with this makespan
        lean = _integer_plan(pulp, model, pool, mk, budget, solver_cls, max_nodes=IP_MAX_NODES)
        if (lean is not None and makespan_s(model, lean) <= mk * (1 + 1e-9)
                and _total(model, lean) < _total(model, best)):
            best = lean
        notes.append(
            f"configurations: integer plan makespan {mk * 1e3:.3f} ms from {len(pool.configs)} configurations"
        )
    else:
        notes.append("configurations: no integer plan below the LPT makespan")
    return ConfigResult(best, proven, notes)
