"""The MILP balancer: batching and owner assignment as integer programs (pulp + HiGHS).

Pipeline (`solve_milp`), never worse than its LPT start:
  1. start = LPT (`balance.lpt`; with split piece types `splitbal.split_lpt`, which keeps the unsplit LPT
     plan unless splitting lowers its makespan); if it meets the combinatorial lower bound it is
     optimal: done.
  2. without a memory cap: the configuration model (`colgen`): identical ranks aggregated exactly; gives
     a proven lower bound (configuration LP) and a plan (column generation + diving + MILP over
     configurations). Its size does not grow with N. With split piece types: first the model without
     them (the plan max_split = 1 would give), then the model with them (a configuration may hold one
     piece: it decides which matrices are split k ways and which ranks run what), started from the
     better plan; its plan search runs only where the pieces lower the configuration LP bound below
     the one without (elsewhere the LP says splitting gains nothing), so splits never make the MILP's
     plan worse than without them and cost little where they cannot pay.
  3. with a memory cap (the configuration model has no memory dimension): the per-rank model (below),
     warm-started from LPT; its HiGHS dual bound is a proven bound. With more ranks than
     MAX_EXACT_VARS allows, the ranks are aggregated into groups instead (see "Scale").
The reported gap is (makespan - best proven bound) / makespan.

Per-rank model. Variables x[s, b, r] = number of batches of b matrices of shape class s that rank r
runs (b over the class's usable sizes, see `balance`), and the makespan M:
    sum_{b, r} b x[s, b, r] = count(s)                       every matrix in exactly one batch
    load(r) = sum_{s, b} T(s, b) x[s, b, r] <= M
    load(r) >= load(r + 1)                                   identical ranks: symmetry broken by load order
    sum_{s, b} b state(s) x[s, b, r] <= memory cap
    M >= lower bound                                         (a valid cut: the bound is a theorem)
Phase 1 minimizes M; phase 2 fixes M <= M* and minimizes the total work sum_r load(r) (lexicographic:
the makespan is never traded for work). Both phases are warm-started and stop after PER_RANK_MAX_NODES
branch-and-bound nodes. Times are scaled by the lower bound (M ~ 1).

Scale: when N x (variables per rank) exceeds MAX_EXACT_VARS, identical ranks are aggregated into G
groups of (nearly) equal size; every rank of a group runs the same batches, the cover constraint becomes
sum_g size(g) sum_b b x[s, b, g] >= count(s) and surplus slots are dropped afterwards (dropping only
lowers loads). That is a restriction of the exact model: its solver bound is not a bound for the real
problem, so the gap then uses the combinatorial bound.

Determinism: every phase is limited by work (pricing rounds, bisection steps, branch-and-bound nodes;
HiGHS on one thread with a fixed random seed), so the same input gives the same plan. The time limit is
a wall-clock safety net (`Budget`) sized never to decide on the project's workloads; if it ever stops a
phase, the plan's notes say so (that plan may then differ between runs). No solver, no solution or a
wrong solution -> LPT, with a RuntimeWarning (from build_plan) and a note in the Plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .balance import Loads, WorkModel, lpt, rank_load_s, rebatch
from .colgen import configuration_search
from .solver import Budget, new_var, stopped_by_clock, warm_highs
from .splitbal import Assignment, Job, makespan_s, split_lpt, trim_surplus

MAX_EXACT_VARS = 6000  # x variables of the exact (per-rank) model; above: rank groups
PER_RANK_MAX_NODES = 300  # branch-and-bound nodes per phase of the per-rank model (memory cap only)
GAP_TOLERANCE = 1e-3  # a plan this close to a proven bound is not searched further
TIME_SHARE = 0.93  # of build_plan's time limit that the solvers may use (the rest: model building)


@dataclass
class MilpResult:
    loads: Loads
    gap: float  # proven relative gap of the makespan (0 = optimal)
    bound_s: float  # best proven lower bound on the makespan
    notes: list[str] = field(default_factory=list)
    fallback: bool = False
    jobs: tuple[Job, ...] = ()  # split batches (see splitbal)


def _fallback(model: WorkModel, why: str, notes: list[str]) -> MilpResult:
    loads, jobs = split_lpt(model)
    notes.append(f"MILP fell back to LPT: {why}")
    mk = makespan_s(model, (loads, jobs))
    lb = model.lower_bound_s
    return MilpResult(loads, (mk - lb) / mk if mk > 0 else 0.0, lb, notes, fallback=True, jobs=jobs)


def _makespan(model: WorkModel, loads: Loads) -> float:
    return max(rank_load_s(model, r) for r in loads)


def solve_milp(
    model: WorkModel, *, time_limit_s: float = 10.0, seed: int = 0, max_exact_vars: int = MAX_EXACT_VARS
) -> MilpResult:
    """Best owner/batch assignment within the work limits (see the module docstring)."""
    notes: list[str] = []
    try:
        import highspy  # noqa: F401
        import numpy  # noqa: F401
        import pulp
    except ImportError as e:
        return _fallback(model, f"no MILP solver ({e.name} is not installed)", notes)
    budget = Budget(TIME_SHARE * time_limit_s)  # the rest covers model building and the plan around it
    plain = lpt(model)
    start: Assignment = split_lpt(model, plain)
    start_mk = makespan_s(model, start)
    best, best_mk = start, start_mk
    bound = model.lower_bound_s
    if start_mk <= bound * (1 + 1e-9):
        notes.append("MILP: the LPT start meets the lower bound, so it is optimal; no solve needed")
        return MilpResult(start[0], 0.0, bound, notes, jobs=start[1])
    n_ranks = model.world_size
    per_rank_vars = sum(len(c.sizes) for c in model.classes)
    exact = n_ranks * per_rank_vars <= max_exact_vars
    solver_cls = warm_highs(pulp, seed)
    how = []
    if model.memory_cap_bytes is None and model.pieces:
        # 1. the plan without splits, exactly as with max_split = 1 (its bound holds for whole plans only)
        whole = replace(model, pieces=(), max_split=1, _split_cache={}, _lb_terms=None)
        cfg0 = configuration_search(whole, (plain, ()), budget=budget, solver_cls=solver_cls)
        notes += [f"without splits: {n}" for n in cfg0.notes]
        if cfg0.assignment is not None and makespan_s(model, cfg0.assignment) < best_mk:
            best, best_mk = cfg0.assignment, makespan_s(model, cfg0.assignment)
        # 2. with splits, from the better start; its plan search only where splitting lowers the LP bound
        cfg = configuration_search(model, best, budget=budget, solver_cls=solver_cls,
                                   plan_below_s=cfg0.bound_s if cfg0.bound_s > 0 else None)
        notes += cfg.notes
        bound = max(bound, cfg.bound_s)
        if cfg.assignment is not None and makespan_s(model, cfg.assignment) < best_mk:
            best, best_mk = cfg.assignment, makespan_s(model, cfg.assignment)
        how.append("configuration models without and with splits")
    elif model.memory_cap_bytes is None:
        cfg = configuration_search(model, start, budget=budget, solver_cls=solver_cls)
        notes += cfg.notes
        bound = max(bound, cfg.bound_s)
        if cfg.assignment is not None and makespan_s(model, cfg.assignment) < best_mk:
            best, best_mk = cfg.assignment, makespan_s(model, cfg.assignment)
        how.append("configuration model")
    elif best_mk > bound * (1 + GAP_TOLERANCE):  # a memory cap: never split pieces (build_work_model)
        groups = [1] * n_ranks
        if not exact:
            g = max(1, max_exact_vars // per_rank_vars)
            groups = [n_ranks // g + (1 if k < n_ranks % g else 0) for k in range(g)]
            notes.append(
                f"MILP: {n_ranks} identical ranks aggregated into {g} groups of "
                f"{min(groups)}-{max(groups)} ranks running the same batches (memory cap set)"
            )
        solver = _Solver(pulp, solver_cls, model, groups, model.lower_bound_s, budget)
        sol1 = solver.solve(best[0] if exact else None, phase=1)
        if sol1 is not None:
            loads1, bound1 = sol1
            bound = max(bound, bound1)
            if _makespan(model, loads1) <= best_mk * (1 + 1e-12):
                best, best_mk = (loads1, ()), _makespan(model, loads1)
            sol2 = solver.solve(best[0], phase=2, makespan_cap_s=best_mk) if exact else None
            if sol2 is not None and _makespan(model, sol2[0]) <= best_mk * (1 + 1e-9):
                best = (sol2[0], ())
        notes.append(solver.last_status or "per-rank model: not run (wall-clock limit)")
        how.append("per-rank model" if exact else "grouped per-rank model")
    best = (rebatch(model, best[0]), best[1])
    mk = makespan_s(model, best)
    if mk > start_mk:
        best, mk = start, start_mk
    gap = max(0.0, (mk - bound) / mk) if mk > 0 else 0.0
    notes.append(
        f"MILP ({' + '.join(how) or 'LPT start kept'}): makespan {mk * 1e3:.3f} ms vs LPT "
        f"{start_mk * 1e3:.3f} ms; proven lower bound {bound * 1e3:.3f} ms, gap {gap:.2%}"
    )
    if budget.timed_out:
        notes.append(
            f"MILP: the wall-clock limit ({time_limit_s:g} s) stopped {', '.join(budget.stopped)} before "
            "its work limit, so this plan may differ between runs (a larger time_limit_s avoids it)"
        )
    return MilpResult(best[0], gap, bound, notes, jobs=best[1])


class _Solver:
    """Builds and solves one phase of the (exact or grouped) model with pulp's HiGHS interface."""

    def __init__(self, pulp, solver_cls, model: WorkModel, groups: list[int], scale_s: float, budget: Budget):
        self.pulp, self.solver_cls, self.model, self.groups, self.scale = (
            pulp,
            solver_cls,
            model,
            groups,
            scale_s,
        )
        self.budget = budget
        self.status_text: dict[int, str] = {}
        self.last_status = ""

    def solve(
        self, start: Loads | None, *, phase: int, makespan_cap_s: float | None = None
    ) -> tuple[Loads, float] | None:
        pulp, model, groups = self.pulp, self.model, self.groups
        if self.budget.expired(f"per-rank model phase {phase}"):
            return None
        exact = all(g == 1 for g in groups)
        prob = pulp.LpProblem(f"dmuon_balance_phase{phase}", pulp.LpMinimize)
        x = {}
        for s, cls in enumerate(model.classes):
            for b in cls.sizes:
                for g in range(len(groups)):
                    x[s, b, g] = new_var(pulp, prob, f"x_{s}_{b}_{g}", 0, cls.count // b, "Integer")
        makespan = new_var(pulp, prob, "M", model.lower_bound_s / self.scale * (1 - 1e-9), None, "Continuous")
        loads = []
        for g in range(len(groups)):
            load = pulp.LpAffineExpression(
                [
                    (x[s, b, g], cls.times_s[b] / self.scale)
                    for s, cls in enumerate(model.classes)
                    for b in cls.sizes
                ]
            )
            loads.append(load)
            prob += load - makespan <= 0, f"load_{g}"
            if model.memory_cap_bytes is not None:
                prob += (
                    pulp.LpAffineExpression(
                        [
                            (x[s, b, g], b * cls.state_bytes / model.memory_cap_bytes)
                            for s, cls in enumerate(model.classes)
                            for b in cls.sizes
                        ]
                    )
                    <= 1,
                    f"memory_{g}",
                )
        for g in range(len(groups) - 1):
            if groups[g] == groups[g + 1]:
                prob += loads[g] - loads[g + 1] >= 0, f"order_{g}"
        for s, cls in enumerate(model.classes):
            cover = pulp.LpAffineExpression(
                [(x[s, b, g], b * groups[g]) for b in cls.sizes for g in range(len(groups))]
            )
            prob += (cover == cls.count) if exact else (cover >= cls.count), f"cover_{s}"
        if phase == 1:
            prob += makespan
        else:
            prob += makespan <= makespan_cap_s / self.scale * (1 + 1e-9), "makespan_fixed"
            prob += pulp.lpSum(groups[g] * loads[g] for g in range(len(groups)))
        warm = None
        if start is not None:
            order = sorted(range(len(start)), key=lambda r: -rank_load_s(model, start[r]))
            warm = {v.name: 0.0 for v in x.values()}
            for g, r in enumerate(order):
                for s, sizes in start[r].items():
                    for b in sizes:
                        if (s, b, g) in x:
                            warm[x[s, b, g].name] += 1
            warm["M"] = max(rank_load_s(model, r) for r in start) / self.scale
        solver = self.solver_cls(
            warm, msg=False, timeLimit=self.budget.left_s(), threads=1, gapRel=1e-6,
            mip_max_nodes=PER_RANK_MAX_NODES,
        )
        prob.solve(solver)
        highs = prob.solverModel
        status = highs.getModelStatus()
        info = highs.getInfo()
        if stopped_by_clock(highs):
            self.budget.expired(f"per-rank model phase {phase}", force=True)
        text = highs.modelStatusToString(status)
        if info.mip_node_count >= PER_RANK_MAX_NODES and status != type(status).kOptimal:
            text = f"node limit ({PER_RANK_MAX_NODES})"
        self.status_text[phase] = f"HiGHS phase {phase}: {text}, gap {info.mip_gap:.2%}"
        self.last_status = self.status_text[phase]
        if info.primal_solution_status == 0:
            self.last_status += " (no solution)"
            return None
        out: Loads = []
        for g, size in enumerate(groups):
            ranks = [{} for _ in range(size)]
            for s, cls in enumerate(model.classes):
                for b in cls.sizes:
                    k = round(x[s, b, g].varValue or 0.0)
                    for rank in ranks:
                        rank.setdefault(s, []).extend([b] * k)
            out += ranks
        out = trim_surplus(model, out)
        if out is None:
            self.last_status += " (solution does not cover every matrix)"
            return None
        bound = (
            info.mip_dual_bound * self.scale
            if phase == 1 and exact and math.isfinite(info.mip_dual_bound)
            else 0.0
        )
        return out, bound
