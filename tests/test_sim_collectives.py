"""Collective costs equal their closed forms; bandwidth curves; profiles reproduce their measurements."""

import math

import pytest

from dmuon.errors import InputError
from simulator.fabric.collectives import (
    KINDS,
    BandwidthCurve,
    Group,
    Network,
    bytes_per_rank,
    collective_time_s,
)
from simulator.fabric.hardware import load_profile, profile_names

B_NV = 100e9  # flat intra-node busbw for the closed-form checks
BASE, A_NV, A_IB = 8e-6, 3e-6, 15e-6
NIC = 50e9  # bytes/s per node
EFF = 0.8


def net(b_nv=B_NV, nic=NIC, bcast=None):
    flat = BandwidthCurve((1.0, 1e12), (b_nv, b_nv))
    return Network({"all_gather": flat, "broadcast": bcast or flat}, BASE, A_NV, A_IB, nic, EFF)


S = 256e6


@pytest.mark.parametrize("n", [2, 4, 8])
def test_single_node_closed_forms(n):
    g, N = Group(1, n), net()
    ring = (n - 1) / n * S / B_NV
    assert collective_time_s("all_gather", S, g, N) == pytest.approx(BASE + (n - 1) * A_NV + ring, rel=1e-12)
    rs = collective_time_s("reduce_scatter", S, g, N)
    assert rs == pytest.approx(BASE + (n - 1) * A_NV + ring, rel=1e-12)
    ar = collective_time_s("all_reduce", S, g, N)
    assert ar == pytest.approx(BASE + 2 * (n - 1) * A_NV + 2 * ring, rel=1e-12)
    # owner broadcasts: balanced -> the ring bound; one owner of everything -> one pipelined broadcast S / B
    assert collective_time_s("broadcast", S, g, N) == pytest.approx(BASE + (n - 1) * A_NV + ring, rel=1e-12)
    assert collective_time_s("broadcast", S, g, N, max_share_bytes=S) == pytest.approx(
        BASE + (n - 1) * A_NV + S / B_NV, rel=1e-12)
    assert collective_time_s("reduce", S, g, N, max_share_bytes=S) == collective_time_s(
        "broadcast", S, g, N, max_share_bytes=S)


def test_multi_node_flat_and_hierarchical_closed_forms():
    M, p = 4, 8
    n = M * p
    g, N = Group(M, p), net()
    nic = NIC * EFF
    flat = collective_time_s("all_gather", S, g, N, hierarchical=False)
    lat_flat = BASE + (n - M) * A_NV + (M - 1) * A_IB
    assert flat == pytest.approx(lat_flat + max((n - 1) / n * S / B_NV, (n - 1) / n * S / nic), rel=1e-12)
    two = collective_time_s("reduce_scatter", S, g, N, hierarchical=True)
    intra = BASE + (p - 1) * A_NV + (p - 1) / p * S / B_NV
    inter = BASE + (M - 1) * A_IB + (M - 1) / M * (S / p) / (nic / p)
    assert two == pytest.approx(intra + inter, rel=1e-12)
    ar = collective_time_s("all_reduce", S, g, N, hierarchical=True)
    inter_ar = BASE + 2 * (M - 1) * A_IB + 2 * (M - 1) / M * (S / p) / (nic / p)
    assert ar == pytest.approx(2 * intra + inter_ar, rel=1e-12)
    # latency-bound small messages: two-level wins; flat never pays the two phases in sequence
    assert collective_time_s("all_gather", 1e3, g, N, hierarchical=True) < collective_time_s(
        "all_gather", 1e3, g, N, hierarchical=False)
    assert flat <= two


def test_inter_node_group_shares_the_nics():
    M, p = 4, 8
    one = collective_time_s("all_reduce", S, Group(M, 1, share=1), net())
    shared = collective_time_s("all_reduce", S, Group(M, 1, share=p), net())
    bw = 2 * (M - 1) / M * S / (NIC * EFF)
    lat = BASE + 2 * (M - 1) * A_IB
    assert one == pytest.approx(lat + bw, rel=1e-12)
    assert shared == pytest.approx(lat + p * bw, rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hier", [True, False])
def test_more_bandwidth_is_never_slower(kind, hier):
    for g in (Group(1, 8), Group(4, 8), Group(16, 8)):
        for size in (1e3, 1e6, 1e8, 4e9):
            base = collective_time_s(kind, size, g, net(), hierarchical=hier, max_share_bytes=size / 3)
            faster_nic = collective_time_s(kind, size, g, net(nic=2 * NIC), hierarchical=hier,
                                           max_share_bytes=size / 3)
            faster_nv = collective_time_s(kind, size, g, net(b_nv=2 * B_NV), hierarchical=hier,
                                          max_share_bytes=size / 3)
            assert faster_nic <= base and faster_nv <= base
            assert collective_time_s(kind, 2 * size, g, net(), hierarchical=hier,
                                     max_share_bytes=2 * size / 3) >= base


def test_bytes_per_rank_matches_muon_md_convention():
    assert bytes_per_rank("all_gather", 800, 8) == 700
    assert bytes_per_rank("reduce_scatter", 800, 8) == 700
    assert bytes_per_rank("all_reduce", 800, 8) == 1400
    assert bytes_per_rank("broadcast", 800, 8) == bytes_per_rank("reduce", 800, 8) == 700
    assert bytes_per_rank("all_gather", 800, 1) == 0


def test_curve_interpolates_time_log_log_and_clamps():
    c = BandwidthCurve((1e3, 1e5), (10.0, 1000.0))  # t = 100 s at both sizes
    assert c.at(1e3) == pytest.approx(10.0) and c.at(1e5) == pytest.approx(1000.0)
    assert c.at(1e4) == pytest.approx(100.0)  # t stays 100 s: busbw grows with the size
    assert c.at(1.0) == pytest.approx(10.0) and c.at(1e9) == pytest.approx(1000.0)
    rising = BandwidthCurve((1e3, 1e5), (10.0, 10.0 * 100 ** 0.5))  # t from 100 s to 1000 s
    assert 1e4 / rising.at(1e4) == pytest.approx(100 * 10 ** 0.5)  # geometric midpoint
    jump = BandwidthCurve((1e3, 1e4), (1.0, 1e6))  # measured t falls 1000 s -> 0.01 s: held at 1000 s
    assert 5e3 / jump.at(5e3) == pytest.approx(1000.0) and 1e4 / jump.at(1e4) == pytest.approx(1000.0)
    with pytest.raises(InputError, match="strictly increasing"):
        BandwidthCurve((2.0, 1.0), (1.0, 1.0))


def test_bad_input_names_what_is_accepted():
    with pytest.raises(InputError, match="accepted: all_gather"):
        collective_time_s("gossip", 1.0, Group(1, 2), net())
    with pytest.raises(InputError, match=">= 0 bytes"):
        collective_time_s("all_gather", -1.0, Group(1, 2), net())
    with pytest.raises(InputError, match="positive integer"):
        Group(0, 8)


def test_a800_profile_reproduces_the_published_8gpu_times():
    """The busbw curve is derived from reported.csv a800_8gpu_comm: the model must give those times back."""
    prof = load_profile("a800")
    g = Group(1, 8)
    for size, t_ms in ((3.7e6, 0.08), (25.7e6, 0.53), (135.8e6, 1.85), (466e6, 5.75)):
        assert collective_time_s("all_gather", size, g, prof.network) == pytest.approx(t_ms * 1e-3, rel=1e-9)
    for size, t_ms in ((3.7e6, 0.18), (466e6, 3.8)):  # 5 concurrent broadcasts of the same total bytes
        got = collective_time_s("broadcast", size, g, prof.network, max_share_bytes=size / 5, owners=5)
        assert got == pytest.approx(t_ms * 1e-3, rel=1e-9)


def test_every_profile_loads_with_provenance():
    names = profile_names()
    assert {"a800", "h100", "h200"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.fwd_flops > 0 and p.bwd_flops > 0 and p.network.nic_Bps_per_node > 0
        for key in ("fwd_tflops", "bwd_tflops", "nic_gbps_per_node", "inter_efficiency", "peak_bf16_tflops"):
            assert p.provenance[key].strip(), f"{name}: {key} has no source"
        assert not math.isnan(p.network.busbw("all_gather", 1e8))
    h100 = load_profile("h100")
    assert h100.network.busbw("all_gather", 1e9) > load_profile("a800").network.busbw("all_gather", 1e9)


def test_profile_errors(tmp_path):
    with pytest.raises(InputError, match="accepted: .*a800"):
        load_profile("b200")
    import re

    from simulator.fabric.hardware import PROFILE_DIR

    bad = tmp_path / "bad.toml"
    bad.write_text(re.sub(r"^fwd_tflops = .*$", "fwd_tflops = 202.0", (PROFILE_DIR / "a800.toml").read_text(),
                          flags=re.M))
    with pytest.raises(InputError, match="fwd_tflops .*provenance is required"):
        load_profile(bad)
    missing = tmp_path / "missing.toml"
    missing.write_text("[compute]\n")
    with pytest.raises(InputError, match="misses peak_bf16_tflops; required:"):
        load_profile(missing)
    with pytest.raises(InputError, match="Gbit/s"):
        load_profile("a800").with_nic_gbps(-5)


@pytest.mark.parametrize("name", ["a800", "h100", "cpu"])
def test_profile_times_grow_with_size(name):
    """Measured curves are not monotone in busbw, but the time they give must grow with the bytes."""
    net_ = load_profile(name).network
    sizes = [10 ** (3 + k / 8) for k in range(57)]  # 1 kB .. 10 GB
    for kind in KINDS:
        for g in (Group(1, 8), Group(4, 8)):
            times = [collective_time_s(kind, x, g, net_) for x in sizes]
            assert all(b >= a * (1 - 1e-12) for a, b in zip(times, times[1:], strict=False)), (name, kind, g)
