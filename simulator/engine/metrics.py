"""Reading a finished simulation: phase boundaries, exposed communication, bytes on the wire.

Step s spans (t_{s-1}, t_s] with t_s = the end of step s's optimizer on the slowest rank (t_{-1} = 0).
Phase ends are maxima over ranks: forward = last forward compute, backward = last backward compute,
optimizer = last op of the optimizer phase (compute or communication). Exposed communication of a rank =
the idle gaps of its compute stream before compute ops that start inside the step (a compute op only
waits on another stream, i.e. on communication), clipped to the step. See `simulator.api` for the
definitions of the reported times.
"""

from __future__ import annotations

from . import engine_native
from .engine import Op


SCANS = {"mode": "auto"}  # "python": the Python scans even where the compiled ones load (tests)


def _native():
    """The compiled module with `phase_ends` / `compute_gaps` (simulator/engine/engine_native_measure.h: the
    same scans as below in C), or None: the Python loops here (DMUON_SIM_ENGINE=python, no compiler)."""
    return None if SCANS["mode"] == "python" else engine_native.load()


def measure(built, step: int) -> dict:
    cl = built.cluster
    n = cl.n_ranks
    native = _native()
    pre = getattr(cl, "phase_ends", None) if native else None  # the compiled loop's (engine_native.c: op_times)
    if pre is not None:
        got = tuple([a[s] if s < len(a) else 0.0 for s in range(step + 1)] for a in pre)
    else:
        got = native and native.phase_ends(Op, [(ops, stream == cl.compute_stream)
                                                for (_, stream), ops in cl.queues.items() if ops], step)
    if got:
        fwd_end, bwd_end, opt_end, grad_end = got
    else:
        fwd_end, bwd_end, opt_end, grad_end = _phase_ends(cl, step)
    t0 = opt_end[step - 1] if step >= 1 else 0.0
    t1 = opt_end[step]
    exposed = {}
    ns_busy = []
    rep_of = getattr(cl, "rep_of", range(n))  # the simulated rank whose times each rank has
    weight = getattr(cl, "weight", [1] * n)  # ranks each simulated rank stands for (0: not simulated)
    for r in range(n):
        if not weight[r]:
            continue
        ops = cl.queues[(r, cl.compute_stream)]
        gaps = native and native.compute_gaps(Op, ops, t0, t1, step)
        exposed[r], busy = gaps or _compute_gaps(ops, t0, t1, step)
        ns_busy.append(busy)
    total = muon = 0.0
    for c in cl.collectives:
        if c.step == step:
            b = c.bytes_per_rank * c.size * c.copies  # every rank of the group, simulated or not
            total += b
            muon += b * c.muon_fraction
    bwd = bwd_end[step]
    return {
        "step_s": t1 - t0,
        "forward_s": fwd_end[step] - t0,
        "backward_s": bwd - fwd_end[step],
        "optimizer_s": t1 - bwd,
        "grad_sync_tail_s": max(0.0, min(grad_end[step], t1) - bwd),
        "exposed_max_s": max(exposed.values()),
        # the same sum whichever ranks were simulated: fixed groups of equal ranks, each its representative's
        # time x its size (simulator.programs.step_comm._mean_groups)
        "exposed_mean_s": sum([exposed[rep_of[r]] * k for r, k in getattr(cl, "mean_groups", None)
                               or [(r, 1) for r in range(n)]]) / n,
        "ns_busy_max_s": max(ns_busy),
        "bytes": total / n,
        "muon_bytes": muon / n,
        "t0": t0,
        "t1": t1,
    }


def _phase_ends(cl, step: int) -> tuple[list, list, list, list]:
    """Per step 0..step the latest end of forward compute, backward compute, optimizer (any stream) and
    backward communication ops; 0.0 where none."""
    fwd_end = [0.0] * (step + 1)  # per step (lists: ~10^6 ops per MoE run are read here)
    bwd_end = list(fwd_end)
    opt_end = list(fwd_end)
    grad_end = list(fwd_end)
    for (_, stream), ops in cl.queues.items():
        compute = stream == cl.compute_stream
        for op in ops:
            s, e = op.step, op.end
            if s > step or e is None:
                continue
            ph = op.phase
            if ph == "opt":
                if e > opt_end[s]:
                    opt_end[s] = e
            elif compute:
                if ph == "fwd":
                    if e > fwd_end[s]:
                        fwd_end[s] = e
                elif ph == "bwd" and e > bwd_end[s]:
                    bwd_end[s] = e
            elif ph == "bwd" and e > grad_end[s]:
                grad_end[s] = e
    return fwd_end, bwd_end, opt_end, grad_end


def _compute_gaps(ops: list, t0: float, t1: float, step: int) -> tuple[float, float]:
    """(idle gaps of one rank's compute stream before ops starting in (t0, t1], time of its NS batches of
    `step`)."""
    prev_end = None
    waited = 0.0
    busy = 0.0
    for op in ops:
        start = op.start
        if start is None:
            continue
        if prev_end is not None and start > prev_end and t0 < start <= t1:
            waited += start - max(prev_end, t0)
        if op.step == step and op.name.startswith(("batch", "ns")):
            busy += op.end - start
        prev_end = op.end
    return waited, busy
