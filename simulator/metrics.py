"""Reading a finished simulation: phase boundaries, exposed communication, bytes on the wire.

Step s spans (t_{s-1}, t_s] with t_s = the end of step s's optimizer on the slowest rank (t_{-1} = 0).
Phase ends are maxima over ranks: forward = last forward compute, backward = last backward compute,
optimizer = last op of the optimizer phase (compute or communication). Exposed communication of a rank =
the idle gaps of its compute stream before compute ops that start inside the step (a compute op only
waits on another stream, i.e. on communication), clipped to the step. See `simulator.api` for the
definitions of the reported times.
"""

from __future__ import annotations


def measure(built, step: int) -> dict:
    cl = built.cluster
    n = cl.n_ranks
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
    t0 = opt_end[step - 1] if step >= 1 else 0.0
    t1 = opt_end[step]
    exposed = {}
    ns_busy = []
    rep_of = getattr(cl, "rep_of", range(n))  # the simulated rank whose times each rank has
    weight = getattr(cl, "weight", [1] * n)  # ranks each simulated rank stands for (0: not simulated)
    for r in range(n):
        if not weight[r]:
            continue
        prev_end = None
        waited = 0.0
        busy = 0.0
        for op in cl.queues[(r, cl.compute_stream)]:
            start = op.start
            if start is None:
                continue
            if prev_end is not None and start > prev_end and t0 < start <= t1:
                waited += start - max(prev_end, t0)
            if op.step == step and op.name.startswith(("batch", "ns")):
                busy += op.end - start
            prev_end = op.end
        exposed[r] = waited
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
        # time x its size (simulator.step_comm._mean_groups)
        "exposed_mean_s": sum([exposed[rep_of[r]] * k for r, k in getattr(cl, "mean_groups", None)
                               or [(r, 1) for r in range(n)]]) / n,
        "ns_busy_max_s": max(ns_busy),
        "bytes": total / n,
        "muon_bytes": muon / n,
        "t0": t0,
        "t1": t1,
    }
