"""Split NS in the simulator: owner groups run their shares, the group's collectives are real collectives
priced by simulator.fabric.collectives, the trace shows them, and max_split = 1 leaves everything as before."""

import json

import pytest

from dmuon.errors import InputError
from dmuon.plan.flops import ns_flops_parts
from dmuon.plan.split import all_reduces_per_call
from simulator.api import SimConfig, run
from simulator.fabric.collectives import collective_time_s
from simulator.fabric.hardware import load_profile
from simulator.programs.split_links import SimulatorLinks, group_of
from simulator.programs.split_program import segments, split_calls
from simulator.engine.trace import trace_events
from simulator.models.workload_spec import ParamSpec, Workload


def _wide() -> Workload:
    """Two dominant wide matrices beside small ones (splitting pays at 16 ranks)."""
    ps = [ParamSpec("emb.0.w", "emb", "w", 32000, 1024, 0, "adamw")]
    for b in range(2):
        ps.append(ParamSpec(f"blk.{b}.wide", "blk", "wide", 2048, 32768, b + 1, "muon", block=b))
        ps += [ParamSpec(f"blk.{b}.s{j}", "blk", f"s{j}", 1024, 1024, b + 1, "muon", block=b)
               for j in range(3)]
    return Workload("wide", tuple(ps))


WIDE = _wide()


def _run(**kw):
    return run(SimConfig(workload=WIDE, gpus=16, strategy="dmuon", **kw))


@pytest.mark.parametrize("method", ["standard", "standard_sym", "gram", "gram_sym"])
@pytest.mark.parametrize("shape,k", [((2048, 32768), 4), ((4097, 1023), 2), ((513, 513), 8), ((7, 1001), 8)])
def test_segments_add_up_to_the_plans_flops(method, shape, k):
    segs = segments(*shape, k, method)
    assert len(segs) == all_reduces_per_call(method) + 1
    assert all(s > 0 for s in segs)
    assert sum(segs) == pytest.approx(sum(ns_flops_parts(*shape, method, parts=k)), rel=1e-12)
    prog = split_calls(*shape, 3, k, method)
    assert sum(prog["fractions"]) == pytest.approx(1.0)
    n = min(shape)
    assert prog["all_reduce_bytes"] == 3 * n * (n + 1) / 2 * 4


def test_links_are_the_simulators_collectives():
    prof = load_profile("a800")
    links = SimulatorLinks(prof.network, 8)
    for ranks in [(0, 1), tuple(range(8)), tuple(range(16)), tuple(range(32))]:
        g = group_of(ranks, 8)
        assert g.size == len(ranks) and g.nodes == max(1, len(ranks) // 8)
        assert links.all_reduce_s(1e7, ranks) == collective_time_s("all_reduce", 1e7, g, prof.network)
    assert group_of(range(16), 8).share == 1  # a whole-node group owns its node's NICs
    assert group_of((0, 8), 1).share == 1 and group_of((0, 1, 8, 9), 8).per_node == 2
    assert links.all_reduce_s(1e7, (3,)) == 0.0


def test_max_split_one_is_the_unsplit_program():
    base, b0 = _run()
    one, _ = _run(max_split=1)
    assert base == one
    assert not b0.spec.plan.split_batches and "split" not in b0.cluster.stream_names


@pytest.mark.parametrize("exchange", ["lead", "blocks"])
@pytest.mark.parametrize("layout", ["fsdp-keep", "ddp", "hsdp-keep", "sharded"])
def test_split_batches_run_on_every_member(layout, exchange):
    res, built = _run(max_split=8, layout=layout, split_exchange=exchange)
    nosplit, _ = _run(layout=layout)
    plan = built.spec.plan
    assert plan.split_batches, "splitting the 2048 x 32768 matrices pays at 16 ranks"
    assert res.ns_makespan_s < nosplit.ns_makespan_s  # the NS parts (the makespans include momentum)
    cl = built.cluster
    per_node = built.spec.per_node
    for k, bt in enumerate(plan.batches):
        if not bt.group:
            continue
        method = bt.method or plan.method
        n_ar = all_reduces_per_call(method)
        for _copy in [(0,)]:  # the plan spans every rank in every layout (HSDP too): one copy
            ranks = list(bt.group)
            for r in ranks:
                mine = [op for op in cl.ops(r, "compute")
                        if op.step == 1 and op.name.startswith(f"batch{k}.")]
                assert [op.name for op in mine] == [f"batch{k}.prep"] + [f"batch{k}.ns{i}"
                                                                        for i in range(n_ar + 1)]
                ns = sum(op.dur for op in mine[1:])  # work (overlap slowdown may stretch it)
                assert ns == pytest.approx((bt.ns_s - bt.comm_s) * built.spec.ns_stretch, rel=1e-9)
                colls = [op.coll for op in cl.ops(r, "split") if op.step == 1 and f"/{k}/" in op.name]
                kinds = ["all_gather"] + ["all_reduce"] * n_ar
                if exchange == "lead":  # the lead scatters the stack's blocks and gathers the results
                    kinds = ["broadcast", *kinds, "reduce"]
                assert [c.kind for c in colls] == kinds
                prep = mine[0].dur
                if exchange == "lead" and r != ranks[0] and layout != "sharded":
                    assert prep == 0.0  # the lead alone holds the gradient and runs the momentum
                elif layout != "sharded":
                    assert prep > 0.0
                assert all(c.n == len(bt.group) and c.end is not None for c in colls)
    # the group's collectives are in the trace, on the split stream, with their kind and group
    ev = [e for e in trace_events(built, per_node) if e.get("name", "").startswith("split/")]
    kinds = {"all_gather", "all_reduce"} | ({"broadcast", "reduce"} if exchange == "lead" else set())
    assert ev and {e["args"]["kind"] for e in ev} == kinds
    assert all(e["args"]["group"].startswith("split") for e in ev)
    json.dumps(ev)


def test_split_shortens_the_ns_critical_path():
    nosplit, _ = _run()
    lead, _ = _run(max_split=8)
    blocks, _ = _run(max_split=8, split_exchange="blocks")
    assert blocks.ns_busy_max_s < lead.ns_busy_max_s < nosplit.ns_busy_max_s
    assert blocks.optimizer_s < lead.optimizer_s < nosplit.optimizer_s
    # the lead's scatter / gather of the stack: 2 (k - 1) / k of it more on the wire than block ownership
    assert lead.muon_comm_bytes_per_rank > blocks.muon_comm_bytes_per_rank


def test_given_plan_with_groups_is_executed():
    _, built = _run(max_split=8)
    again, b2 = _run(plan=built.spec.plan)  # a plan built elsewhere (e.g. the runtime's) with its groups
    assert b2.spec.plan.split_batches == built.spec.plan.split_batches
    assert "split" in b2.cluster.stream_names


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_max_split_names_the_field(bad):
    with pytest.raises(InputError, match="max_split"):
        _run(max_split=bad)


def test_bad_split_exchange_names_what_is_accepted():
    with pytest.raises(InputError, match="split_exchange.*lead.*blocks"):
        _run(max_split=8, split_exchange="owner")
