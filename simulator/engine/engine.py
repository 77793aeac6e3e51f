"""The SimPy cluster: per-rank streams executing ops in program order, collectives as rendezvous.

Model (what the step programs in `simulator.programs.step` build on):
- Every rank has named streams ("compute", "comm"). A stream is a capacity-1 resource served in
  program order, like a CUDA stream: one SimPy process per stream takes its ops one by one; an op
  starts when the stream is free and its dependencies (ops on other streams, of this or, through a
  collective, other ranks) have finished.
- A collective is one shared object per participant group: each participant's comm stream arrives at
  it in its own program order; when the last one arrives it runs for its closed-form time (one SimPy
  timeout for the whole group, not one per message hop) and every participant's op ends together.
  Programs that order collectives differently on different ranks deadlock; `Cluster.run` reports it.
- Compute that overlaps communication on the same rank may run slower (`overlap_slowdown` s): while
  at least one collective of the rank is running, its compute progresses at rate 1 / (1 + s), else at
  rate 1. A compute op's duration is its work at rate 1; the op is re-timed whenever a collective of its
  rank starts or ends (one extra event per change, and only when s > 0). On a GPU this is SM / memory
  contention with NCCL kernels; on a CPU host the collectives' copies and reductions run on the same
  cores as the compute.
- Shared SM capacity (GPUs): a collective's kernels occupy `sm_share` of its participants' SMs (NCCL runs
  one thread block per channel, each holding an SM for the collective's whole duration); compute on a
  rank then progresses at rate 1 - (sum of sm_share of the collectives running on it), capped at
  MAX_SM_SHARE, on top of the constant slowdown above. Two collectives on a rank take twice the SMs.
- Stragglers (`jitter` cv > 0): every compute op's duration is multiplied, when the op is added, by a
  lognormal draw with mean 1 and coefficient of variation cv (random.Random(seed), in program order, so
  runs are reproducible); collectives wait for the slowest participant, so the step grows with the
  expected maximum over the ranks that meet at each collective.
- The other way round (`comm_overlap_slowdown` c, CPU hosts): a running collective progresses at rate
  1 / (1 + c) while any of its participants computes, else at rate 1 (re-timed whenever a participant's
  compute starts or ends; only when c > 0).

Ops record their start and end; the step programs and the trace read them afterwards. `Cluster.run` runs
this model with `simulator.engine.engine_fast` (a heap of timers and per-stream state machines: the same op times,
bit for bit, tests/test_sim_engine_fast.py); `run(reference=True)` with one SimPy process per stream, the
original implementation, kept as the reference. simpy is imported only by that reference run.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass

from dmuon.errors import InputError

from . import engine_native
from .engine_fast import MAX_SM_SHARE, run_fast


@contextmanager
def paused_gc():
    """Python's cyclic garbage collector off while a program is built or run: ~10^6 ops (MoE at 1024
    ranks) are all alive until the run ends, and every collection pass would walk them all (1.6x the build
    time at 256 ranks, measured); the previous state is restored afterwards.

    On the way out, what was made while paused goes to the oldest generation without a pass (freeze then
    unfreeze: two list splices), as a long-lived object would after surviving two collections; else the
    first allocation after `gc.enable()` walks all of it as one young generation while the caller still
    holds the programs (`simulator.api.run` returns them: 1.0 s of CPU at 1024 GPUs, Kimi-K2-like, ep 64).
    Cyclic garbage made meanwhile is freed by the next full collection. Skipped when the process has frozen
    objects of its own (`gc.freeze`), which unfreeze would release."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


class Collective:
    """One collective over `n` participants, taking `cost_s` once all have arrived."""

    __slots__ = ("name", "kind", "n", "cost_s", "arrived", "start", "end", "done", "bytes_per_rank",
                 "muon_fraction", "group", "step", "ranks", "sm_share", "size", "copies")

    def __init__(self, name: str, kind: str, n: int, cost_s: float, *, bytes_per_rank: float = 0.0,
                 muon_fraction: float = 0.0, group: str = "", step: int = 0, sm_share: float = 0.0,
                 size: int | None = None):
        if n <= 0:
            raise InputError(f"collective {name!r} needs at least one participant")
        self.name, self.kind, self.n, self.cost_s = name, kind, n, cost_s
        self.arrived = 0
        self.start: float | None = None
        self.end: float | None = None
        self.done = None  # simpy Event, created by the cluster
        self.bytes_per_rank = bytes_per_rank  # average bytes each participant sends
        self.muon_fraction = muon_fraction  # share of the bytes that are Muon-matrix data
        self.group = group
        self.step = step
        self.ranks: list[int] = []  # participants, in arrival order (kept when overlap slowdown is on)
        self.sm_share = sm_share  # share of each participant's SMs its kernels hold while it runs
        self.size = n if size is None else size  # ranks in the group (n: those simulated, see Cluster)
        self.copies = 1  # identical instances of this collective it stands for (groups not simulated)


class Op:
    """One unit of work on one rank's stream: a compute kernel (duration) or a collective."""

    __slots__ = ("rank", "stream", "name", "phase", "step", "dur", "coll", "deps", "start", "end",
                 "done", "slowed_s")

    def __init__(self, rank: int, stream: str, name: str, phase: str, step: int, dur: float = 0.0,
                 coll: Collective | None = None, deps: tuple = ()):
        self.rank, self.stream, self.name, self.phase, self.step = rank, stream, name, phase, step
        self.dur, self.coll, self.deps = dur, coll, deps
        self.start: float | None = None
        self.end: float | None = None
        self.done = None
        self.slowed_s = 0.0


@dataclass
class RunStats:
    end_s: float  # simulated time when the last op finished


class Cluster:
    """Holds every rank's streams and runs them in one SimPy environment."""

    def __init__(self, n_ranks: int, streams: tuple[str, ...] = ("compute", "comm"),
                 overlap_slowdown: float = 0.0, compute_stream: str = "compute",
                 comm_overlap_slowdown: float = 0.0, jitter: float = 0.0, seed: int = 0):
        if n_ranks <= 0:
            raise InputError(f"a cluster needs at least one rank, got {n_ranks}")
        self.n_ranks = n_ranks
        self._noise = None
        if jitter > 0:
            import math
            import random

            sigma = math.sqrt(math.log(1.0 + jitter * jitter))  # lognormal with mean 1, cv = jitter
            rng = random.Random(seed)
            self._noise = lambda: rng.lognormvariate(-sigma * sigma / 2, sigma)
        self.stream_names = streams
        self.compute_stream = compute_stream
        self.overlap_slowdown = overlap_slowdown
        self.comm_overlap_slowdown = comm_overlap_slowdown
        self.queues: dict[tuple[int, str], list[Op]] = {(r, s): [] for r in range(n_ranks) for s in streams}
        self.collectives: list[Collective] = []
        self.weight = [1] * n_ranks  # ranks each simulated rank stands for (0: not simulated; step_comm)
        self.rep_of = range(n_ranks)  # the simulated rank each rank's times are (simulator.engine.symmetry)
        self._busy = [0] * n_ranks  # collectives running per rank (overlap slowdown only)
        self._sm_used = [0.0] * n_ranks  # SM share held by the collectives running on each rank
        self._changed: list = []  # per rank: event fired when its number of running collectives changes
        self._ran = False
        self.engine = ""  # the event loop that ran it: native (C), python (engine_fast) or simpy (reference)
        self.phase_ends = None  # per step the ends `metrics.measure` reads, where the compiled loop gave them

    # ---- building ------------------------------------------------------------------------------
    def compute(self, rank: int, name: str, dur: float, *, phase: str, step: int, deps=(),
                stream: str | None = None) -> Op:
        if dur < 0:
            raise InputError(f"op {name!r}: negative duration {dur}")
        if self._noise is not None and dur > 0:
            dur *= self._noise()
        return self._enqueue(rank, stream or self.compute_stream, name, phase, step, dur, None, deps)

    def collective(self, coll: Collective, rank: int, *, phase: str, step: int, deps=(),
                   stream: str = "comm") -> Op:
        return self._enqueue(rank, stream, coll.name, phase, step, 0.0, coll, deps)

    def _enqueue(self, rank, stream, name, phase, step, dur, coll, deps) -> Op:
        """Append one op to its (rank, stream) queue, deps as a tuple without Nones (~10^6 calls per MoE run)."""
        q = self.queues.get((rank, stream))
        if q is None:
            self._unknown(rank, stream)
        if type(deps) is not tuple:
            deps = tuple(deps)
        if None in deps:
            deps = tuple([d for d in deps if d is not None])
        op = Op(rank, stream, name, phase, step, dur, coll, deps)
        q.append(op)
        return op

    def new_collective(self, *args, **kwargs) -> Collective:
        c = Collective(*args, **kwargs)
        self.collectives.append(c)
        return c

    def _unknown(self, rank: int, stream: str):
        raise InputError(f"unknown stream {stream!r} of rank {rank}; streams: {self.stream_names}")

    def clear_times(self) -> None:
        """Every op and collective back to its state before a run (times, waiters, arrivals), so one built
        graph can be run by several event loops in turn (scripts/engine_ab.py, tests); `run()` itself
        still runs a cluster once."""
        for ops in self.queues.values():
            for o in ops:
                o.start = o.end = o.done = None
                o.slowed_s = 0.0
        for c in self.collectives:
            c.arrived, c.start, c.end, c.ranks, c.done = 0, None, None, [], None
        self.phase_ends = None

    # ---- running -------------------------------------------------------------------------------
    def run(self, reference: bool = False) -> RunStats:
        """Run every stream to completion. reference=True: by one SimPy process per stream (the original
        implementation, kept to check `simulator.engine.engine_fast`, which runs the same model faster). A cluster
        runs once (its ops and collectives keep their times)."""
        if self._ran:
            raise InputError("this cluster has already run; build a new one to run the programs again")
        self._ran = True
        with paused_gc():
            native = None if reference else engine_native.load()
            if reference:
                end = self._run_simpy()
            elif native is not None:
                end = engine_native.run_native(self, native, Op, Collective)
            else:
                end = run_fast(self)
            self.engine = "simpy" if reference else "native" if native is not None else "python"
        stuck = [c for c in self.collectives if c.end is None]
        if stuck:
            c = stuck[0]
            raise RuntimeError(f"simulation deadlock: collective {c.name!r} got {c.arrived} of {c.n} "
                               f"participants ({len(stuck)} collectives unfinished); the step program "
                               "orders collectives differently on different ranks")
        return RunStats(end_s=end)

    def _run_simpy(self) -> float:
        import simpy

        env = simpy.Environment()
        self._busy = [0] * self.n_ranks
        self._sm_used = [0.0] * self.n_ranks
        self._slow = self.overlap_slowdown > 0 or any(c.sm_share > 0 for c in self.collectives)
        self._changed = [None] * self.n_ranks  # per rank: the state of its running slowed compute op
        self._computing = [False] * self.n_ranks
        self._compute_changed = ([env.event() for _ in range(self.n_ranks)] if self.comm_overlap_slowdown > 0
                                 else [])
        for c in self.collectives:
            c.done = env.event()
        needed = {id(d): d for ops in self.queues.values() for op in ops for d in op.deps if d.coll is None}
        for op in needed.values():  # ops another stream waits on get an event
            op.done = env.event()
        # communication streams first: at equal times their ops start before compute ops look for overlap
        order = sorted(self.queues.items(), key=lambda kv: kv[0][1] == self.compute_stream)
        for (rank, stream), ops in order:
            if ops:
                env.process(self._stream(env, rank, stream, ops))
        env.run()
        return env.now

    def _rate(self, rank: int) -> float:
        if not self._busy[rank]:
            return 1.0
        return (1.0 - min(MAX_SM_SHARE, self._sm_used[rank])) / (1.0 + self.overlap_slowdown)

    def _busy_changed(self, env, ranks, delta: int, sm: float = 0.0) -> None:
        running = self._changed
        for r in ranks:
            self._busy[r] += delta
            self._sm_used[r] = self._sm_used[r] + delta * sm if self._busy[r] else 0.0
            st = running[r]
            if st is not None:  # a compute op of r is running: re-time it
                self._retime(env, r, st)

    def _retime(self, env, rank: int, st: list) -> None:
        """st = [remaining work, rate, since, version, done event] of rank's running compute op: account
        the work done at the old rate, schedule its end at the new one (older timers are ignored)."""
        now = env.now
        st[0] -= (now - st[2]) * st[1]
        st[1], st[2], st[3] = self._rate(rank), now, st[3] + 1
        version, done = st[3], st[4]

        def fire(_ev, version=version):
            if st[3] == version and not done.triggered:
                done.succeed()

        env.timeout(max(0.0, st[0]) / st[1]).callbacks.append(fire)

    def _set_computing(self, env, rank: int, on: bool) -> None:
        self._computing[rank] = on
        ev, self._compute_changed[rank] = self._compute_changed[rank], env.event()
        ev.succeed()

    def _slowed_collective(self, env, c: Collective):
        """Run collective c's cost at rate 1 / (1 + comm_overlap_slowdown) while a participant computes."""
        import simpy

        slow_rate = 1.0 / (1.0 + self.comm_overlap_slowdown)
        remaining = c.cost_s
        while remaining > 1e-15 * max(1.0, c.cost_s):
            rate = slow_rate if any(self._computing[r] for r in c.ranks) else 1.0
            t0 = env.now
            timer = env.timeout(remaining / rate)
            yield simpy.AnyOf(env, [timer, *(self._compute_changed[r] for r in set(c.ranks))])
            if timer.processed or env.now - t0 >= remaining / rate:
                return
            remaining -= (env.now - t0) * rate

    def _slowed_compute(self, env, rank: int, work: float):
        """Run `work` seconds of compute at rate 1 / (1 + overlap_slowdown) x (1 - SM share held by running
        collectives) while the rank has a collective running, 1 otherwise (re-timed at every change)."""
        st = [work, self._rate(rank), env.now, 0, env.event()]
        self._changed[rank] = st
        version = 0

        def fire(_ev):
            if st[3] == version and not st[4].triggered:
                st[4].succeed()

        env.timeout(work / st[1]).callbacks.append(fire)
        yield st[4]
        self._changed[rank] = None

    def _stream(self, env, rank: int, stream: str, ops: list[Op]):
        is_compute = stream == self.compute_stream
        slow = self._slow
        comm_slow = self.comm_overlap_slowdown > 0
        track = slow or comm_slow  # participants are recorded
        for op in ops:
            for d in op.deps:
                ev = d.coll.done if d.coll is not None else d.done
                if ev.callbacks is not None:  # not processed yet
                    yield ev
            c = op.coll
            if c is None:
                op.start = env.now
                if op.dur > 0:
                    if is_compute and comm_slow:
                        self._set_computing(env, rank, True)
                    if is_compute and slow:
                        yield from self._slowed_compute(env, rank, op.dur)
                        op.slowed_s = env.now - op.start - op.dur
                    else:
                        yield env.timeout(op.dur)
                    if is_compute and comm_slow:
                        self._set_computing(env, rank, False)
                op.end = env.now
                if op.done is not None:
                    op.done.succeed()
                continue
            c.arrived += 1
            if track:
                c.ranks.append(rank)
            if c.arrived == c.n:
                c.start = env.now
                if c.cost_s > 0:
                    if slow:
                        self._busy_changed(env, c.ranks, +1, c.sm_share)
                    if comm_slow:
                        yield from self._slowed_collective(env, c)
                    else:
                        yield env.timeout(c.cost_s)
                    if slow:
                        self._busy_changed(env, c.ranks, -1, c.sm_share)
                c.end = env.now
                c.done.succeed()
            else:
                yield c.done
            op.start, op.end = c.start, c.end

    # ---- reading -------------------------------------------------------------------------------
    def ops(self, rank: int, stream: str) -> list[Op]:
        return self.queues[(rank, stream)]
