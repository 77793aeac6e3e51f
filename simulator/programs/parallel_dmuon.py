"""DMuon on a TP x PP x DP job: each pipeline stage runs the Plan `dmuon.plan.tp.build_tp_plan` returns.

One plan, two executors (docs/DESIGN.md principle 1). Per stage, the stage's Muon matrices whole (its TP
shards' full shapes, simulator.programs.parallel.stage_workload) go to `build_tp_plan` with the arguments the runtime
(`dmuon.runtime.tp.TPDMuonSteps._build_plan`) passes for that layout: world = dp x tp ranks (TP innermost),
the Megatron shard dims, mode "auto", the NS method and dtype the simulator plans with (simulator.setup), the
cost table's own link model (`dmuon.plan.split.links_for`, as the runtime), the gradient wire bytes and the
bucket size; built once per distinct input (simulator.costs.tp_plan_for). Its choices say, per TP-sharded
matrix, which TP group d (the DP index) orthogonalizes it, in which mode, and (gather) on which TP rank.

How the runtime executes it (`TPDMuonSteps._muon_update`), and so how it is timed here:
  A  the matrix's TP blocks go over the DP group to TP group d (the stage's data-parallel step program's
     gather to owner d: the plan's owner // tp);
  B  TP group d walks its matrices in matrix order; per matrix, gather mode: `dist.gather` of the blocks to
     TP rank `owner` on NVLink, the whole NS there, `dist.scatter` of the blocks back; group mode: every TP
     rank runs the distributed Gram NS with its all-reduces; a matrix TP leaves whole: NS on its owner rank,
     then a broadcast over the TP group. These are collectives on the TP group's one NCCL communicator,
     whose stream runs them in issue order on every member, so matrix i + 1's gather waits for matrix i's
     scatter, which waits for i's NS: the TP group runs its matrices one after another, whichever of its
     ranks owns each. So a TP group's time is the sum of its matrices' (gather + NS + scatter), or group
     mode's time, priced on the simulator's NVLink (`price_tp_modes` with simulator.programs.split_links); a whole
     matrix adds its NS and broadcast (an upper bound where two ranks' whole matrices sit next to each other
     in the order and could overlap);
  C  the blocks go back over the DP group (the step program's scatter from owner d).
So the stage's data-parallel step program runs the plan's DP view (`dp_view`): owners d, one batch per
matrix in matrix order on owner d, its time the TP group's time above. Load imbalance over the TP groups
shows in the step time through the step program's per-rank streams; which TP rank of a group owns a
gathered matrix does not change the time (the plan's LPT over TP ranks assumes they run at once; the
runtime's loop serializes them).
"""

from __future__ import annotations

from dmuon.errors import InputError
from dmuon.plan.types import Batch, MatrixSpec, Plan


def whole_matrices(stage_wl, full: dict) -> tuple[tuple[MatrixSpec, ...], list[int | None]]:
    """The stage's Muon matrices at their full shapes (what the runtime's plan sees) and each one's TP
    shard dim (0: rows cut, 1: columns cut, None: whole under TP)."""
    mats, dims = [], []
    for m in stage_wl.muon_matrices:
        if m.name not in full:
            mats.append(m)
            dims.append(None)
            continue
        R, C = full[m.name]
        mats.append(MatrixSpec(m.name, R, C, m.layer, m.count))
        dims.append(0 if m.rows != R else 1)
    return tuple(mats), dims


def stage_tp_plan(cfg, stage_wl, full: dict, tp: int, dp: int, profile, cost) -> Plan:
    """build_tp_plan of one stage, as the runtime calls it for this layout (module docstring)."""
    from dmuon.plan.split import LINKS, links_for

    from simulator.costs import tp_plan_for
    from simulator.setup import ns_method_of
    from .step import DTYPE_BYTES

    mats, dims = whole_matrices(stage_wl, full)
    try:
        links = links_for(cost)
    except InputError:  # the runtime's fallback where the table's device has no link model
        links = LINKS["cpu"]
    return tp_plan_for(mats, dp * tp, cost, tp=tp, shard_dims=tuple(dims), method=ns_method_of(cfg, profile),
                       dtype=cfg.ns_dtype or profile.dtype, links=links,
                       wire_bytes=DTYPE_BYTES[cfg.grad_comm_dtype or profile.dtype],
                       bucket_numel=cfg.bucket_numel)


def matrix_times(plan: Plan, cost, sim_links, wire_bytes: int) -> list[float]:
    """Per matrix: its TP group's seconds for it in the plan's mode, on the simulator's links (module
    docstring, B)."""
    from dmuon.plan.tp import price_tp_modes

    tp = plan.tp
    group = tuple(range(tp))  # a TP group: tp GPUs of one node
    method_of = {i: b.method or plan.method for b in plan.batches for i in b.members}
    out = []
    for i, (m, c) in enumerate(zip(plan.matrices, plan.tp_choices or [None] * len(plan.matrices),
                                   strict=True)):
        n, k = min(m.rows, m.cols), max(m.rows, m.cols)
        if c is None:
            ns = cost.ns_time(n, k, m.count, method_of[i], plan.dtype).time_s
            out.append(ns + sim_links.time_s("broadcast", m.rows * m.cols * m.count * wire_bytes / tp, group))
            continue
        p = price_tp_modes(m.rows, m.cols, c.shard_dim, tp, cost, method=method_of[i], dtype=plan.dtype,
                           links=sim_links, ranks=group, wire_bytes=wire_bytes)
        out.append(p.group_s if c.mode == "group" else p.gather_s)
    return out


def dp_view(plan: Plan, shards, times: list[float]) -> Plan:
    """The plan over the stage's DP ranks the data-parallel step program runs: matrices its TP shards
    (`shards`, in the plan's order), matrix i owned by TP group plan.owners[i] // tp, one batch per matrix
    in matrix order per owner (the runtime's loop), its time `times[i]`; the plan's buckets."""
    tp = plan.tp
    dp = plan.world_size // tp
    if [s.name for s in shards] != [m.name for m in plan.matrices]:
        raise InputError("the TP plan's matrices are not the stage's shards (a bug in "
                         "simulator.programs.parallel_dmuon)")
    owners = tuple(o // tp for o in plan.owners)
    method_of = {i: b.method for b in plan.batches for i in b.members}
    batches = tuple(Batch(owner=owners[i], rows=min(s.rows, s.cols), cols=max(s.rows, s.cols), members=(i,),
                          time_s=times[i], method=method_of[i])
                    for i, s in sorted(enumerate(shards), key=lambda x: (owners[x[0]], x[0])))
    loads = [0.0] * dp
    for i, t in enumerate(times):
        loads[owners[i]] += t
    makespan = max(loads) if loads else 0.0
    lb = max([sum(times) / dp] + times) if times else 0.0
    return Plan(world_size=dp, matrices=tuple(shards), owners=owners, batches=batches, buckets=plan.buckets,
                balancer=plan.balancer, method=plan.method, dtype=plan.dtype,
                cost_source=plan.cost_source, makespan_s=makespan, lower_bound_s=lb,
                solve_time_s=plan.solve_time_s, gap=max(0.0, (makespan - lb) / makespan) if makespan else 0.0,
                notes=tuple(n for n in plan.notes if n.startswith("tensor parallelism:")) + (
                    f"DP view of the TP plan over {dp} TP groups: a TP group runs its "
                    "matrices one after another (simulator.programs.parallel_dmuon)",))


def stage_dp_plan(cfg, stage_wl, full: dict, lay, profile, cost) -> tuple[Plan, Plan]:
    """(the stage's TP plan, the DP view its data-parallel step program runs)."""
    from .split_links import SimulatorLinks
    from .step import DTYPE_BYTES

    plan = stage_tp_plan(cfg, stage_wl, full, lay.tp, lay.dp, profile, cost)
    wire = DTYPE_BYTES[cfg.grad_comm_dtype or profile.dtype]
    # the view depends on the plan (cached by its inputs, simulator.costs), the cost table, the links
    # (the network, by value, and node size) and the shards: built once per distinct input (a search
    # asks again for every micro-batch, recompute and layout of one tp / pp)
    key = (id(plan), id(cost), profile.name, repr(profile.network), lay.per_node, wire,
           tuple(stage_wl.muon_matrices))
    got = _VIEWS.get(key)
    if got is None:
        sim_links = SimulatorLinks(profile.network, lay.per_node, source=f"simulator profile {profile.name}")
        times = matrix_times(plan, cost, sim_links, wire)
        # holding plan and cost keeps their ids from being reused while cached
        got = _VIEWS[key] = (plan, cost, dp_view(plan, stage_wl.muon_matrices, times))
    return plan, got[-1]


_VIEWS: dict[tuple, tuple] = {}


def mode_note(views) -> str:
    """One line: per distinct stage, its TP plan's modes and its busiest TP group's seconds."""
    parts = []
    for v in views:
        what = next((n.split("; ", 1)[1] for n in v.notes if n.startswith("tensor parallelism:")), "")
        parts.append(f"{what}; busiest TP group {v.makespan_s * 1e3:.1f} ms "
                     f"(even {v.lower_bound_s * 1e3:.1f})")
    return " | ".join(parts)
