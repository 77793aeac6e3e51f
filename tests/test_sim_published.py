"""system 'published' (simulator.programs.step_published): every switch off builds our programs exactly, ours is
unchanged, each switch changes what it models (and only on the layouts it applies to), bad input errors."""

import dataclasses

import pytest

from dmuon.errors import InputError
from simulator.api import SimConfig, simulate
from simulator.programs.step_published import MECHANISMS, OPT_IN

BASE = dict(workload="qwen2.5-1.5b", gpus=16, strategy="dmuon", seq_len=512, micro_batch=1)
TIMES = ("step_s", "forward_s", "backward_s", "optimizer_s")


def _times(**kw):
    r = simulate(SimConfig(**{**BASE, **kw}))
    return tuple(getattr(r, k) for k in TIMES), r


@pytest.fixture(scope="module")
def ours():
    return {lay: _times(layout=lay) for lay in ("fsdp-keep", "hsdp-free")}


def test_every_switch_off_is_ours_bit_for_bit(ours):
    for lay, (t, r) in ours.items():
        t2, r2 = _times(layout=lay, system="published", published_off=tuple(MECHANISMS))
        assert t2 == t
        assert r2.comm_bytes_per_rank == r.comm_bytes_per_rank


def test_hsdp_only_switches_leave_fsdp_alone(ours):
    on = ("hsdp_stages", "master_fp32")
    off = tuple(m for m in MECHANISMS if m not in on)
    assert _times(layout="fsdp-keep", system="published", published_off=off)[0] == ours["fsdp-keep"][0]


def test_switches_change_what_they_model(ours):
    def only(lay, *names):
        return _times(layout=lay, system="published", published_off=tuple(m for m in MECHANISMS
                                                                          if m not in names))[1]
    _, o = ours["hsdp-free"]
    two = only("hsdp-free", "hsdp_stages")
    # the replicate broadcast moves each owned matrix across nodes once more per step than ours
    assert two.comm_bytes_per_rank != o.comm_bytes_per_rank
    fp32 = only("hsdp-free", "hsdp_stages", "master_fp32")
    assert fp32.comm_bytes_per_rank > two.comm_bytes_per_rank  # 4 bytes per element instead of 2
    # one NS call per matrix: the plan's batches are single matrices, more NS time in all
    per = only("fsdp-keep", "ns_per_matrix")
    assert per.plan_method == ours["fsdp-keep"][1].plan_method
    assert per.ns_busy_max_s != ours["fsdp-keep"][1].ns_busy_max_s
    # coalesced per-owner broadcasts and reduces pay one latency per layer: never slower
    assert only("fsdp-keep", "coalesce").step_s <= ours["fsdp-keep"][1].step_s


def test_adamw_is_the_same_in_both_systems():
    a = simulate(SimConfig(**{**BASE, "strategy": "adamw"}))
    b = simulate(SimConfig(**{**BASE, "strategy": "adamw", "system": "published"}))
    assert dataclasses.replace(b, settings=a.settings) == a


def test_errors():
    with pytest.raises(InputError, match="unknown system 'theirs'; accepted: ours, published"):
        simulate(SimConfig(**BASE, system="theirs"))
    with pytest.raises(InputError, match="unknown published_off switch 'nope'; accepted: ns_per_matrix"):
        simulate(SimConfig(**BASE, system="published", published_off=("nope",)))
    with pytest.raises(InputError, match="published_on applies to system 'published' only"):
        simulate(SimConfig(**BASE, published_on=tuple(OPT_IN)[:1]))
    with pytest.raises(InputError, match="published_off must be a list of switch names"):
        simulate(SimConfig(**BASE, system="published", published_off="drain"))


def test_coalesced_owner_collectives_pay_the_launch_once():
    from simulator.fabric.collectives import Group, collective_time_s
    from simulator.fabric.hardware import load_profile

    net = load_profile("a800").network_for(8, 1.0)
    g = Group(16, 8)
    for kind in ("broadcast", "reduce"):
        one = collective_time_s(kind, 64e6, g, net, hierarchical=False, nccl=True, owners=1)
        six = collective_time_s(kind, 64e6, g, net, hierarchical=False, nccl=True, owners=6)
        both = collective_time_s(kind, 64e6, g, net, hierarchical=False, nccl=True, owners=6, coalesced=True)
        assert one < both < six  # the ring steps per collective, the launch once
        assert collective_time_s(kind, 64e6, g, net, hierarchical=False, nccl=True, owners=1,
                                 coalesced=True) == one


def test_pack_small_and_param_collectives_count_group_py_collectives(ours):
    only = tuple(m for m in MECHANISMS if m not in ("pack_small", "param_collectives", "flat_exchange"))

    def run(*on):
        return _times(layout="fsdp-keep", system="published",
                      published_off=(*only, *{"pack_small", "param_collectives"} - set(on)))[1]
    flat, packed, per_param = run(), run("pack_small"), run("param_collectives")
    # qwen2.5-1.5b: every attention matrix is under 5 M elements, so a layer has fewer owners to broadcast
    # from (its publication, in forward on keep); its reduces one per parameter, more than its owners
    assert packed.forward_s < flat.forward_s and packed.backward_s == pytest.approx(flat.backward_s, rel=1e-9)
    assert per_param.backward_s > flat.backward_s
    assert per_param.forward_s == pytest.approx(flat.forward_s, rel=1e-9)
    assert packed.comm_bytes_per_rank == flat.comm_bytes_per_rank == per_param.comm_bytes_per_rank


def test_cli_compares_both_systems_per_layout_with_each_mechanism_s_cost(capsys):
    """`harness simulate --system ours,published`: per layout, dmuon under both schedules (the same steps as
    simulating each alone) and each mechanism's cost as the published step less it with that one off."""
    import json

    from harness.cli import main

    args = ["simulate", "--workload", "qwen2.5-1.5b", "--gpus", "16", "--seq-len", "512", "--micro-batch", "1",
            "--strategy", "dmuon", "--system", "ours,published", "--layout", "fsdp-keep,hsdp-free",
            "--published-off", "drain", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["layout"] for o in out] == ["fsdp-keep", "hsdp-free"]
    for o in out:
        base = {**BASE, "layout": o["layout"]}
        adamw = simulate(SimConfig(**{**base, "strategy": "adamw"})).step_s
        ours = simulate(SimConfig(**base)).step_s
        pub = simulate(SimConfig(**base, system="published", published_off=("drain",))).step_s
        assert [(r["label"], r["step_s"]) for r in o["results"]] == [("dmuon ours", ours), ("dmuon published", pub)]
        assert o["overhead_pct"] == {"ours": (ours / adamw - 1) * 100, "published": (pub / adamw - 1) * 100}
        assert list(o["mechanism_s"]) == [m for m in MECHANISMS if m != "drain"]
        off = simulate(SimConfig(**base, system="published", published_off=("drain", "master_fp32"))).step_s
        assert o["mechanism_s"]["master_fp32"] == pub - off
        assert o["mechanism_points"]["master_fp32"] == (pub - off) / adamw * 100
    fsdp, hsdp = (o["mechanism_s"] for o in out)
    assert fsdp["hsdp_stages"] == fsdp["master_fp32"] == 0.0  # HSDP-only mechanisms cost nothing on FSDP
    assert hsdp["master_fp32"] > 0  # fp32 replicate broadcasts: twice the bytes across nodes
