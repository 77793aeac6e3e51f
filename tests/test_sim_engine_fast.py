"""Both event loops, simulator.engine.engine_fast (Python) and simulator.engine.engine_native (the same loop in C, the
default where it builds), against the SimPy processes they replaced (the reference): every op's start, end
and slowdown and the results equal, bit for bit, on every strategy, layout, slowdown mode (a800: SM share;
cpu: compute and communication slowdowns), stragglers and expert parallelism (the `sim_engine` fixture of
conftest.py runs each test once per loop and checks the loop that ran is the one asked for)."""

import gc
import itertools
import weakref

import pytest

from simulator.api import SimConfig, run
from simulator.engine.engine import Cluster, paused_gc


def _both(monkeypatch, cfg, all_ranks=False, engine=None):
    orig = Cluster.run
    monkeypatch.setattr(Cluster, "run", lambda self: orig(self, reference=True))
    ref, ref_built = run(cfg, all_ranks=all_ranks)
    monkeypatch.setattr(Cluster, "run", orig)
    fast, fast_built = run(cfg, all_ranks=all_ranks)
    assert ref_built.cluster.engine == "simpy" and fast_built.cluster.engine == (engine or "native")

    def times(built):
        return [(k, o.name, o.start, o.end, o.slowed_s) for k, q in built.cluster.queues.items() for o in q]

    return ref, fast, times(ref_built), times(fast_built), ref_built, fast_built


CASES = [dict(strategy=s, layout=lay) for s, lay in itertools.product(
    ("adamw", "naive", "dmuon"), ("fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free", "ddp", "sharded"))]
CASES += [dict(strategy=s, gpu="cpu", gpus=8) for s in ("adamw", "naive", "dmuon")]  # both slowdowns
CASES += [dict(strategy="dmuon", jitter=0.1), dict(strategy="dmuon", overlap=False),
          dict(strategy="dmuon", balancer="round_robin", layout="hsdp-free")]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_fast_engine_equals_simpy(monkeypatch, kw, sim_engine):
    cfg = SimConfig(**{"workload": "qwen2.5-1.5b", "gpus": 16, **kw})
    ref, fast, t_ref, t_fast, rb, fb = _both(monkeypatch, cfg, engine=sim_engine)
    assert t_ref and t_fast == t_ref
    assert fast == ref
    def spans(built):
        return [(c.start, c.end) for c in built.cluster.collectives]

    assert spans(fb) == spans(rb)


def test_unit_scenarios_equal(sim_engine):
    """The engine's hand-built cases (overlap slowdown retimed mid-op, a collective beside compute)."""
    def build(reference):
        cl = Cluster(2, overlap_slowdown=0.5, comm_overlap_slowdown=1.0)
        a = cl.compute(0, "a", 0.2, phase="fwd", step=0)
        col = cl.new_collective("ar", "all_reduce", 2, 0.4, sm_share=0.25)
        x = [cl.collective(col, r, phase="bwd", step=0, deps=(a,)) for r in range(2)]
        b = cl.compute(0, "b", 1.0, phase="bwd", step=0)
        c = cl.compute(1, "c", 0.3, phase="bwd", step=0, deps=(x[1],))
        zero = cl.new_collective("z", "all_gather", 2, 0.0)
        z = [cl.collective(zero, r, phase="opt", step=0, deps=(c,)) for r in range(2)]
        end = cl.run(reference=reference).end_s
        return end, [(o.start, o.end, o.slowed_s) for o in (a, b, c, *x, *z)]

    assert build(False) == build(True)


def test_deadlock_reported_by_both(sim_engine):
    for reference in (False, True):
        cl = Cluster(2)
        x, y = (cl.new_collective(n, "all_gather", 2, 1.0) for n in "xy")
        cl.collective(x, 0, phase="fwd", step=0)
        cl.collective(y, 0, phase="fwd", step=0)
        cl.collective(y, 1, phase="fwd", step=0)
        cl.collective(x, 1, phase="fwd", step=0)
        with pytest.raises(RuntimeError, match="deadlock: collective 'x' got 1 of 2"):
            cl.run(reference=reference)


def test_paused_gc_restores_state():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Node:
    pass


def test_paused_gc_ages_what_it_made_and_still_collects_cycles():
    """What was made while paused starts no collection afterwards (the young generation would walk all of
    it while the caller still holds it), and a reference cycle made meanwhile is still freed."""
    young = gc.get_threshold()[0]
    passes = []

    def seen(phase, info):
        if phase == "start":
            passes.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        with paused_gc():
            passes.clear()
            kept = [_Node() for _ in range(3 * young)]  # past the threshold of a young collection
            cycle = _Node()
            cycle.me = cycle
            gone = weakref.ref(cycle)
            del cycle
        more = [_Node() for _ in range(young // 2)]
    finally:
        gc.callbacks.remove(seen)
    assert passes == []
    assert len(kept) + len(more) > 3 * young
    gc.collect()
    assert gone() is None


def test_paused_gc_keeps_the_process_frozen_objects_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with paused_gc():
            kept = [_Node()]
        assert gc.get_freeze_count() == frozen
        assert kept
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("comm_slow", [0.0, 0.7])
@pytest.mark.parametrize("seed", range(6))
def test_retimed_compute_equal_under_random_overlap(seed, comm_slow, sim_engine):
    """Long compute ops slowed and sped up by many overlapping collectives of random sizes (the deferred
    re-time timers of engine_fast.busy_changed: later ends pushed when the live timer pops, earlier ones
    at once), zero-length ops, a run that ends on a superseded timer: the same times as SimPy."""
    import random

    def build(reference):
        rng = random.Random(seed)
        n = 4
        cl = Cluster(n, overlap_slowdown=0.3, comm_overlap_slowdown=comm_slow)
        prev = [None] * n
        for k in range(40):
            for r in range(n):
                d = rng.choice((0.0, rng.random(), 3 * rng.random()))
                prev[r] = cl.compute(r, f"c{k}", d, phase="fwd", step=0,
                                     deps=(prev[r],) if rng.random() < 0.3 else ())
            members = sorted(rng.sample(range(n), rng.randint(1, n)))
            col = cl.new_collective(f"x{k}", "all_gather", len(members), rng.random() * 0.5,
                                    sm_share=rng.choice((0.0, 0.2, 0.45)))
            for r in members:
                cl.collective(col, r, phase="fwd", step=0, deps=(prev[r],) if rng.random() < 0.5 else ())
        end = cl.run(reference=reference).end_s
        assert cl.engine == ("simpy" if reference else sim_engine)
        return end, [(k, o.start, o.end, o.slowed_s) for k, q in cl.queues.items() for o in q] + [
            (c.name, c.arrived, c.start, c.end, sorted(c.ranks)) for c in cl.collectives]

    fast, ref = build(False), build(True)
    assert fast[1] and fast == ref
