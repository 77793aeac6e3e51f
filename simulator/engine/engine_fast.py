"""The cluster's event loop without SimPy: the same model as `simulator.engine.engine` (read its docstring), run by
one heap of timers and per-stream state machines instead of one SimPy process per stream.

Why: a MoE step program at 1024 ranks has ~1.8 M ops; SimPy spends most of its time resuming generators
and creating events (~3 M resumes, ~1 M events), so `Cluster.run` uses this loop and keeps the SimPy
processes as the reference (`Cluster.run(reference=True)`; tests/test_sim_engine_fast.py checks both give
the same op times on every strategy, layout and slowdown mode).

Mechanics (what each SimPy construct becomes):
  stream process      a `_Stream` (ops, position): the loop issues its ops until one waits: on a dependency
                      (the stream is appended to that op's or collective's waiters), a positive duration
                      (a timer on the heap) or a collective that is still incomplete or running
  op.done event       op.done = the list of streams waiting on op (created on the first waiter)
  collective.done     collective.done = the list of waiting streams (participants and dependents)
  env.timeout(d)      heap entry (now + d, sequence, kind, object, version); entries of retimed ops whose
                      version is stale are dropped when popped (the clock still advances to them, as SimPy's
                      stale timeouts do, so the run's end time is the same)
  equal times         streams made ready at one instant run in FIFO order, communication streams first at
                      the start (as the SimPy version); a rate change at zero elapsed time leaves the work
                      untouched, so the order among equal-time events does not move any op's end
"""

from __future__ import annotations

import heapq
from collections import deque

MAX_SM_SHARE = 0.9  # collectives never take more than this share of a rank's SMs from its compute
_END, _SLOW_END, _COLL_END, _COLL_SLOW = 0, 1, 2, 3


class _Stream:
    __slots__ = ("ops", "i", "rank", "compute", "arrived", "n", "slow", "comm_slow")

    def __init__(self, ops, rank: int, compute: bool, slow: bool, comm_slow: bool):
        self.ops, self.i, self.rank, self.compute = ops, 0, rank, compute
        self.arrived, self.n = False, len(ops)
        self.slow, self.comm_slow = compute and slow, compute and comm_slow  # its compute is slowed


def run_fast(cl) -> float:
    """Run cluster `cl` (a `simulator.engine.engine.Cluster`) to completion; returns the final clock."""
    n_ranks = cl.n_ranks
    slow = cl.overlap_slowdown > 0 or any(c.sm_share > 0 for c in cl.collectives)
    comm_slow = cl.comm_overlap_slowdown > 0
    track = slow or comm_slow
    ovl = 1.0 + cl.overlap_slowdown
    comm_rate = 1.0 / (1.0 + cl.comm_overlap_slowdown)
    busy = [0] * n_ranks
    sm_used = [0.0] * n_ranks
    running = [None] * n_ranks  # per rank: state of its running slowed compute op
    computing = [False] * n_ranks
    coll_running: list[list] = [[] for _ in range(n_ranks)] if comm_slow else []
    for c in cl.collectives:
        c.done = []
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    ready: deque = deque()
    seq = 0
    now = 0.0
    late = 0.0  # latest deferred end never pushed (busy_changed)

    def busy_changed(ranks, delta: int, sm: float) -> None:
        """Collectives running on `ranks` changed by delta; a running slowed compute op's state is st =
        [remaining work, rate, since, version, stream, op, end, end's sequence number, live timer's time]:
        the work done at the old rate is accounted and its end (end, seq) set at the new one. Deferred
        timers: a later end than the live timer's is not pushed now; the live timer, when it pops, pushes
        it with the sequence number it got here, so the heap pops every timer in the same (time, seq)
        order as pushing each at once would (the live timer's key is the smaller). An earlier end is
        pushed at once and the live timer becomes stale (older versions are ignored)."""
        nonlocal seq, late
        dsm = delta * sm
        for r in ranks:
            b = busy[r] + delta
            busy[r] = b
            sm_used[r] = sm_used[r] + dsm if b else 0.0
            st = running[r]
            if st is not None:  # a slowed compute op of r is running: re-time it at the new rate
                st[0] -= (now - st[2]) * st[1]
                st[1] = (1.0 - min(MAX_SM_SHARE, sm_used[r])) / ovl if b else 1.0
                st[2] = now
                seq += 1
                t = now + max(0.0, st[0]) / st[1]
                st[6], st[7] = t, seq
                if t < st[8]:
                    st[3] += 1
                    st[8] = t
                    push(heap, (t, seq, _SLOW_END, st, st[3]))
                elif t > late:  # the reference's stale timers still advance its clock: the same end
                    late = t

    def coll_timer(cs) -> None:
        """cs = [collective, remaining, rate, since, version]: (re)schedule a comm-slowed collective's end."""
        nonlocal seq
        c = cs[0]
        cs[2] = comm_rate if any(computing[r] for r in c.ranks) else 1.0
        cs[3], cs[4] = now, cs[4] + 1
        seq += 1
        push(heap, (now + cs[1] / cs[2], seq, _COLL_SLOW, cs, cs[4]))

    def set_computing(r: int, on: bool) -> None:
        computing[r] = on
        for cs in list(coll_running[r]):
            # as engine._slowed_collective on a participant's change: done if its time is up, else the
            # work left at the old rate and a new timer at the new one
            elapsed = now - cs[3]
            if elapsed >= cs[1] / cs[2]:
                cs[1] = 0.0
            else:
                cs[1] -= elapsed * cs[2]
            if cs[1] <= 1e-15 * max(1.0, cs[0].cost_s):
                finish_coll_slow(cs)
            else:
                coll_timer(cs)

    def finish_coll_slow(cs) -> None:
        cs[4] = -1  # no timer of it counts any more
        c = cs[0]
        for r in set(c.ranks):
            coll_running[r].remove(cs)
        end_coll(c)

    def end_coll(c) -> None:
        if slow:
            busy_changed(c.ranks, -1, c.sm_share)
        c.end = now
        ready.extend(c.done)
        c.done = []

    def start_coll(c) -> bool:
        """The last participant arrived: True when the collective is already over (no time)."""
        nonlocal seq
        c.start = now
        if c.cost_s <= 0:
            c.end = now
            ready.extend(c.done)
            c.done = []
            return True
        if slow:
            busy_changed(c.ranks, +1, c.sm_share)
        if comm_slow:
            cs = [c, c.cost_s, 1.0, now, 0]
            if cs[1] <= 1e-15 * max(1.0, c.cost_s):
                end_coll(c)
                return True
            for r in set(c.ranks):
                coll_running[r].append(cs)
            coll_timer(cs)
        else:
            seq += 1
            push(heap, (now + c.cost_s, seq, _COLL_END, c, 0))
        return False

    def finish_op(s: _Stream, op) -> None:
        if s.comm_slow:
            set_computing(s.rank, False)
        op.end = now
        if op.done:
            ready.extend(op.done)
            op.done = None
        s.i += 1
        ready.append(s)

    order = sorted(cl.queues.items(), key=lambda kv: kv[0][1] == cl.compute_stream)
    for (rank, stream), ops in order:  # op.done is None from Op() (a cluster runs once)
        if ops:
            ready.append(_Stream(ops, rank, stream == cl.compute_stream, slow, comm_slow))
    popleft = ready.popleft
    while True:
        while ready:  # advance stream s: issue its ops until one has to wait
            s = popleft()
            ops, i, n = s.ops, s.i, s.n
            if s.arrived:  # woken by the end of the collective it joined
                s.arrived = False
                op = ops[i]
                c = op.coll
                op.start, op.end = c.start, c.end
                i += 1
            while i < n:
                op = ops[i]
                c = op.coll
                blocked = False
                for d in op.deps:
                    dc = d.coll
                    if dc is not None:
                        if dc.end is None:
                            dc.done.append(s)
                            blocked = True
                            break
                    elif d.end is None:
                        if d.done is None:
                            d.done = [s]
                        else:
                            d.done.append(s)
                        blocked = True
                        break
                if blocked:
                    break
                if c is None:
                    op.start = now
                    dur = op.dur
                    if dur > 0:
                        if s.comm_slow:
                            set_computing(s.rank, True)
                        seq += 1
                        if s.slow:
                            r = s.rank
                            rt = (1.0 - min(MAX_SM_SHARE, sm_used[r])) / ovl if busy[r] else 1.0
                            t = now + dur / rt
                            running[r] = st = [dur, rt, now, 0, s, op, t, seq, t]
                            push(heap, (t, seq, _SLOW_END, st, 0))
                        else:
                            push(heap, (now + dur, seq, _END, s, op))
                        break
                    op.end = now
                    if op.done:
                        ready.extend(op.done)
                        op.done = None
                    i += 1
                    continue
                c.arrived += 1
                if track:
                    c.ranks.append(s.rank)
                if c.arrived == c.n and start_coll(c):
                    op.start, op.end = c.start, c.end
                    i += 1
                    continue
                c.done.append(s)
                s.arrived = True
                break
            s.i = i
        if not heap:
            break
        now, sq, kind, obj, ver = pop(heap)
        if kind == _SLOW_END:
            if obj[3] != ver or obj[5] is None:
                continue
            if sq != obj[7]:  # the live timer of a deferred end: push that end (busy_changed)
                obj[3] += 1
                obj[8] = obj[6]
                push(heap, (obj[6], obj[7], _SLOW_END, obj, obj[3]))
                continue
            s, op = obj[4], obj[5]
            obj[5] = None
            running[s.rank] = None
            op.slowed_s = now - op.start - op.dur
            finish_op(s, op)
        elif kind == _END:
            finish_op(obj, ver)
        elif kind == _COLL_END:
            end_coll(obj)
        elif obj[4] == ver:  # _COLL_SLOW, not stale
            finish_coll_slow(obj)
    cl._busy, cl._sm_used = busy, sm_used
    return max(now, late)
