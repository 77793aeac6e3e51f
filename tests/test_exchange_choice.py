"""The "auto" owner-exchange choice (dmuon.runtime.exchange.choose_mode): cost-based, one rule for the
runtime (units.auto_mode) and the simulator's owner exchange (simulator.programs.step_comm.owner_coll)."""

from __future__ import annotations

import pytest

from dmuon.errors import InputError
from dmuon.runtime.exchange import (
    LINKS,
    LinkEstimate,
    choose_mode,
    default_links,
    exchange_costs_s,
)
from dmuon.runtime.groups import CommGroups
from dmuon.runtime.units import auto_mode

A800 = LINKS["a800"]


def _groups(n: int, node_size: int | None = None, backend: str = "nccl") -> CommGroups:
    return CommGroups(group=None, rank=0, world_size=n, global_ranks=tuple(range(n)), node_size=node_size,
                      backend=backend)


def test_flips_at_the_break_even_of_the_alpha_beta_forms():
    # one node of n ranks, k owners, payload S: reduce-scatter costs lat + (n-1) cap / B, the k reduces
    # k lat + (n-1)/n S / B (while cap < (n-1)/n S): equal at cap* = ((k-1) lat B + (n-1)/n S) / (n-1)
    n, k, S = 8, 4, 8e6
    L = A800
    lat = L.base_s + (n - 1) * L.intra_step_s
    cap_star = ((k - 1) * lat * L.intra_Bps + (n - 1) / n * S) / (n - 1)
    assert cap_star < (n - 1) / n * S
    assert choose_mode(S, cap_star * (1 - 1e-6), k, k, n, n, False, L) == "reduce_scatter"
    assert choose_mode(S, cap_star * (1 + 1e-6), k, k, n, n, False, L) == "reduce"
    c = exchange_costs_s(S, cap_star, k, k, n, n, False, L)
    assert c["reduce_scatter"] == pytest.approx(c["reduce"], rel=1e-9)


def test_latency_bound_buckets_pad_and_bandwidth_bound_ones_do_not():
    # 4 owners of 64 K bf16 elements on 8 ranks: padding doubles the bytes (the old 10% rule said
    # "reduce"), but 3 saved latencies outweigh 0.5 MB more at 71 GB/s
    small = [65536] * 4
    assert auto_mode(small, [0, 1, 2, 3], _groups(8), links=A800) == "reduce_scatter"
    # the same shapes at 64 M elements: the padding's bandwidth dominates
    assert auto_mode([64 << 20] * 4, [0, 1, 2, 3], _groups(8), links=A800) == "reduce"
    # 1024 ranks over 128 nodes, a layer with 4 owners: 256 x padding, never worth it
    big = [3584 * 3584, 3584 * 512, 3584 * 512, 3584 * 3584]
    assert auto_mode(big, [5, 300, 600, 900], _groups(1024, 8), links=A800) == "reduce"
    # even ZeRO shards (AdamW parameters, owners None) pad by under N elements: one collective
    assert auto_mode([10_000_000], None, _groups(64, 8), links=A800) == "reduce_scatter"


def test_auto_mode_passes_the_bucket_shape_to_choose_mode():
    numels, owners = [1000, 3000, 500, 2000], [0, 9, 1, 0]  # 16 ranks, 2 nodes of 8
    g = _groups(16, 8)
    cap, payload = 3000, 6500  # owner 0 holds 3000, owner 9 3000, owner 1 500
    per_local = 2  # owners 9 and 1 share local index 1
    for links in (A800, LINKS["h100"], LinkEstimate(1e9, 1e8)):
        want = choose_mode(payload * 4, cap * 4, 3, per_local, 16, 8, True, links)
        assert auto_mode(numels, owners, g, links=links, elem_bytes=4) == want
    assert auto_mode(numels, owners, _groups(16, backend="gloo"), links=A800) == "reduce"


def test_flat_groups_take_ranks_per_node_from_torchrun(monkeypatch):
    # without node_size the runtime is flat; LOCAL_WORLD_SIZE says how many of its ranks share a node
    numels, owners = [1 << 16] * 6, [0, 8, 16, 24, 32, 40]
    one_node = choose_mode(6 * 2 * (1 << 16), 2 * (1 << 16), 6, 6, 64, 64, False, A800)
    nodes = choose_mode(6 * 2 * (1 << 16), 2 * (1 << 16), 6, 6, 64, 8, False, A800)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert auto_mode(numels, owners, _groups(64), links=A800) == one_node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert auto_mode(numels, owners, _groups(64), links=A800) == nodes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "7")  # does not divide 64: treated as one node
    assert auto_mode(numels, owners, _groups(64), links=A800) == one_node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")  # not a number: one node
    assert auto_mode(numels, owners, _groups(64), links=A800) == one_node


def test_device_table_and_bad_input():
    assert default_links("NVIDIA A800-SXM4-80GB") is LINKS["a800"]
    assert default_links("NVIDIA H200") is LINKS["h200"]
    assert default_links("Some Future GPU") is LINKS["h100"]
    assert all(v.source for v in LINKS.values())
    with pytest.raises(InputError, match="bandwidths must be > 0"):
        LinkEstimate(0.0, 1e9)


@pytest.mark.parametrize("gpu,gpus,layout", [("a800", 16, "fsdp-keep"), ("a800", 64, "hsdp-free"),
                                             ("h200", 16, "fsdp-keep"), ("cpu", 4, "fsdp-keep")])
def test_simulator_picks_what_the_runtime_would(gpu, gpus, layout):
    """Every bucket of a simulated DMuon step is exchanged in the mode units.auto_mode picks for the same
    bucket (its owners and sizes), given the fabric estimate the simulator prices with."""
    from simulator.programs import step_comm
    from simulator.api import SimConfig, run

    seen = []
    orig = step_comm.CommPrograms.owner_coll

    def spy(self, r, key, b, kind, elem_bytes, group, step, part=None):
        col = orig(self, r, key, b, kind, elem_bytes, group, step, part)
        if part is None:
            g, _ = self._instance(group, r)
            shape = self._owner_shapes[(b, kind, group)]
            owned = self.owned[b]
            numels, owners = list(owned.values()), list(owned)
            groups = _groups(g.size, self.s.per_node if self.s.hierarchical else None,
                             backend=self.s.network.backend)
            want = auto_mode(numels, owners, groups, links=self._links(), elem_bytes=elem_bytes,
                             per_node=self.s.per_node)
            seen.append((want, "reduce" if shape[0] in ("reduce", "broadcast") else "reduce_scatter"))
        return col

    step_comm.CommPrograms.owner_coll = spy
    try:
        run(SimConfig(workload="qwen2.5-1.5b", gpus=gpus, strategy="dmuon", layout=layout, gpu=gpu),
            all_ranks=False)
    finally:
        step_comm.CommPrograms.owner_coll = orig
    assert seen and all(a == b for a, b in seen)
    if gpu == "cpu":  # gloo ranks: the runtime never pads (its reduce-scatter is an all-reduce)
        assert {b for _, b in seen} == {"reduce"}


def test_two_level_owner_inter_phase_picks_its_protocol():
    """The inter phase of a two-level owner broadcast is its own NCCL call: NCCL's tuner picks the
    cheaper protocol, as for a flat ring (simulator.fabric.collectives)."""
    from dataclasses import replace

    from simulator.fabric.collectives import Group, _inter_bw_s, _intra, collective_time_s
    from simulator.fabric.hardware import load_profile

    net = load_profile("a800").network
    simple = replace(net, protocols=())
    g = Group(128, 8)
    S = 154e6
    with_p = collective_time_s("broadcast", S, g, net, hierarchical=True, nccl=True, owners=4)
    without = collective_time_s("broadcast", S, g, simple, hierarchical=True, nccl=True, owners=4)
    assert with_p < without
    # Simple only: intra phase per owner + one inter chain (base + 127 network steps) + both bandwidths
    lat, bw = _intra("broadcast", S, 8, net, 0.0)
    nic = net.nic_Bps_per_node * net.inter_efficiency
    inter_bw = _inter_bw_s("broadcast", S, 128, nic, 0.0)
    assert without == pytest.approx(4 * lat + bw + net.base_latency_s + 127 * net.inter_alpha_s + inter_bw)
    best = min((q.ring_base_s + 127 * q.ring_inter_s) + inter_bw / q.bw_factor for q in net.protocols)
    assert with_p == pytest.approx(4 * lat + bw + best)
    # nccl=False (the simulator's explicit two-level formula) keeps Simple
    assert collective_time_s("broadcast", S, g, net, hierarchical=True, owners=4) == pytest.approx(without)
