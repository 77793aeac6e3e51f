"""The SimPy cluster: in-order streams, dependencies, collective rendezvous, overlap slowdown."""

import pytest

from simulator.engine.engine import Cluster


def _layers(prefetch: bool, n_layers=4, compute=1.0, comm=0.6) -> float:
    """FSDP-style forward on one rank: gather(l) on comm, compute(l) waits for it."""
    cl = Cluster(1)
    gathers, computes = {}, []

    def gather(l, dep):
        c = cl.new_collective(f"ag{l}", "all_gather", 1, comm)
        gathers[l] = cl.collective(c, 0, phase="fwd", step=0, deps=(dep,))

    if prefetch:  # gather(l+1) issued before compute(l), may start once compute(l-1) is done
        gather(0, None)
        for l in range(n_layers):
            if l + 1 < n_layers:
                gather(l + 1, computes[l - 1] if l else None)
            computes.append(cl.compute(0, f"c{l}", compute, phase="fwd", step=0, deps=(gathers[l],)))
    else:  # gather(l) only after compute(l-1)
        for l in range(n_layers):
            gather(l, computes[-1] if computes else None)
            computes.append(cl.compute(0, f"c{l}", compute, phase="fwd", step=0, deps=(gathers[l],)))
    cl.run()
    return computes[-1].end


def test_two_stream_overlap_prefetch_vs_none():
    assert _layers(prefetch=True) == pytest.approx(4.6)
    assert _layers(prefetch=False) == pytest.approx(6.4)


def test_collective_starts_when_the_last_participant_arrives():
    cl = Cluster(3)
    coll = cl.new_collective("ar", "all_reduce", 3, 0.5)
    ops = []
    for r, busy in enumerate((1.0, 2.0, 0.25)):
        pre = cl.compute(r, "pre", busy, phase="bwd", step=0)
        ops.append(cl.collective(coll, r, phase="bwd", step=0, deps=(pre,)))
    after = cl.compute(2, "post", 1.0, phase="opt", step=0, deps=(ops[2],))
    cl.run()
    assert coll.start == 2.0 and coll.end == 2.5
    assert all(o.start == 2.0 and o.end == 2.5 for o in ops)
    assert after.start == 2.5 and after.end == 3.5


def test_streams_run_in_program_order():
    cl = Cluster(1)
    slow = cl.new_collective("slow", "all_gather", 1, 3.0)
    a = cl.collective(slow, 0, phase="fwd", step=0)
    # queued behind `a` on the same comm stream even though it has no dependency of its own
    b = cl.collective(cl.new_collective("fast", "all_gather", 1, 1.0), 0, phase="fwd", step=0)
    c = cl.compute(0, "c", 1.0, phase="fwd", step=0)  # the compute stream is free meanwhile
    cl.run()
    assert (a.start, a.end, b.start, b.end) == (0.0, 3.0, 3.0, 4.0)
    assert (c.start, c.end) == (0.0, 1.0)


def test_mismatched_collective_order_is_reported_as_deadlock():
    cl = Cluster(2)
    x = cl.new_collective("x", "all_gather", 2, 1.0)
    y = cl.new_collective("y", "all_gather", 2, 1.0)
    cl.collective(x, 0, phase="fwd", step=0)
    cl.collective(y, 0, phase="fwd", step=0)
    cl.collective(y, 1, phase="fwd", step=0)
    cl.collective(x, 1, phase="fwd", step=0)
    with pytest.raises(RuntimeError, match="deadlock: collective 'x' got 1 of 2"):
        cl.run()


def test_compute_overlapping_communication_is_slowed():
    def run(slowdown):
        cl = Cluster(1, overlap_slowdown=slowdown)
        cl.collective(cl.new_collective("ag", "all_gather", 1, 0.6), 0, phase="fwd", step=0)
        c = cl.compute(0, "c", 1.0, phase="fwd", step=0)
        cl.run()
        return c

    assert run(0.0).end == pytest.approx(1.0)
    c = run(0.5)
    # rate 1 / 1.5 while the collective runs (0.4 of work in its 0.6 s), then rate 1 for the other 0.6
    assert c.end == pytest.approx(0.6 + (1.0 - 0.6 / 1.5)) and c.slowed_s == pytest.approx(0.2)


def test_a_collective_that_starts_during_compute_slows_it_from_then_on():
    cl = Cluster(1, overlap_slowdown=1.0)
    first = cl.compute(0, "a", 0.2, phase="fwd", step=0)
    cl.collective(cl.new_collective("ar", "all_reduce", 1, 0.4), 0, phase="bwd", step=0, deps=(first,))
    c = cl.compute(0, "b", 1.0, phase="bwd", step=0)
    cl.run()
    # b starts at 0.2 with the collective (0.2 .. 0.6): half rate there (0.2 of work), then 0.8 at rate 1
    assert c.start == pytest.approx(0.2) and c.end == pytest.approx(0.6 + 0.8)


def test_collectives_beside_compute_run_slower_with_comm_overlap_slowdown():
    def run(slowdown, compute_s):
        cl = Cluster(2, comm_overlap_slowdown=slowdown)
        col = cl.new_collective("ar", "all_reduce", 2, 0.5)
        ops = [cl.collective(col, r, phase="bwd", step=0) for r in range(2)]
        if compute_s:
            cl.compute(1, "c", compute_s, phase="bwd", step=0)  # one participant computes
        cl.run()
        return ops[0]

    assert run(1.0, 0.0).end == pytest.approx(0.5)  # nobody computes: full speed
    assert run(0.0, 1.0).end == pytest.approx(0.5)  # no slowdown configured
    # half rate while rank 1 computes (0 .. 0.3: 0.15 of work), full rate for the remaining 0.35
    assert run(1.0, 0.3).end == pytest.approx(0.3 + 0.35)
    assert run(1.0, 2.0).end == pytest.approx(1.0)  # computing throughout: twice as long
