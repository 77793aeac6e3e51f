"""Multi-node mechanisms: NCCL's own algorithms and latencies, serialized owner collectives, shared SM
capacity, and the representative-rank reduction (exact)."""

import dataclasses
import math
from pathlib import Path

import pytest

from dmuon.errors import InputError
from simulator.api import SimConfig, run, simulate
from simulator.fabric.collectives import BandwidthCurve, Group, Network, collective_time_s
from simulator.engine.engine import MAX_SM_SHARE, Cluster
from simulator.fabric.hardware import load_profile

B_NV, BASE, A_NV, A_IB, NIC, EFF = 100e9, 8.4e-6, 3.4e-6, 14e-6, 100e9, 0.9


def net():
    flat = BandwidthCurve((1.0, 1e12), (B_NV, B_NV))
    return Network({"all_gather": flat, "broadcast": flat}, BASE, A_NV, A_IB, NIC, EFF)


@pytest.mark.parametrize("nodes", [2, 16, 32])
def test_nccl_all_gather_is_a_flat_ring_whose_latency_grows_with_every_rank(nodes):
    g, p = Group(nodes, 8), 8
    n = nodes * p
    t = collective_time_s("all_gather", 1e3, g, net(), nccl=True)  # latency-bound
    lat = BASE + (n - nodes) * A_NV + (nodes - 1) * A_IB  # NCCL tuner: ring steps
    bw = max((n - 1) / n * 1e3 / B_NV, (n - 1) / n * 1e3 / (NIC * EFF))  # every ring link out of a node
    assert t == pytest.approx(lat + bw, rel=1e-12)
    # the same call with hierarchical=True is still NCCL's flat ring (NCCL has no two-level all-gather)
    assert collective_time_s("all_gather", 1e3, g, net(), nccl=True, hierarchical=True) == t


def test_nccl_all_reduce_picks_the_cheaper_of_ring_and_tree():
    n0 = net()
    g = Group(32, 1, share=8)
    small, large = 64e3, 4e9
    ring = [collective_time_s("all_reduce", s, g, n0, hierarchical=False) for s in (small, large)]
    nccl = [collective_time_s("all_reduce", s, g, n0, nccl=True) for s in (small, large)]
    tree_small = BASE + 2 * math.log2(32) * 14e-6 + 2 * small / (0.92 * NIC * EFF / 8)
    assert nccl[0] == pytest.approx(min(ring[0], tree_small), rel=1e-12)
    assert nccl[0] < ring[0]  # latency-bound: tree's log2(32) hops beat the ring's 62
    assert nccl[1] == pytest.approx(ring[1], rel=1e-12)  # bandwidth-bound: the ring's (n-1)/n wins


def test_owner_collectives_pay_their_latency_once_per_owner():
    g1, g = Group(1, 8), Group(16, 8)
    one = collective_time_s("broadcast", 1e6, g1, net())
    seven = collective_time_s("broadcast", 1e6, g1, net(), owners=7)
    assert seven - one == pytest.approx(6 * (BASE + 7 * A_NV), rel=1e-9)
    flat = [collective_time_s("reduce", 1e6, g, net(), hierarchical=False, owners=k, nccl=True)
            for k in (1, 7)]
    assert flat[1] - flat[0] == pytest.approx(6 * (BASE + (128 - 16) * A_NV + 15 * A_IB), rel=1e-9)
    two = [collective_time_s("reduce", 1e6, g, net(), owners=7, owners_per_local=k) for k in (1, 3)]
    assert two[1] - two[0] == pytest.approx(2 * (BASE + 15 * A_IB), rel=1e-9)


def test_measured_points_subtract_the_latency_of_each_collective_they_cover():
    prof = load_profile("a800")
    # the 5-broadcast points: t = 5 latencies + bandwidth term, so the model gives back the measurement
    t = collective_time_s("broadcast", 466e6, Group(1, 8), prof.network, owners=5)
    assert t == pytest.approx(3.8e-3, rel=0.02)
    assert prof.sm_share == pytest.approx(24 / 108) and "hardware.csv" in prof.provenance["sm_count"]
    assert "tuning.cc" in prof.provenance["tree_inter_alpha_us"]


def test_compute_loses_the_sm_share_of_the_collectives_running_beside_it():
    cl = Cluster(1)
    coll = cl.new_collective("ag", "all_gather", 1, 1.0, sm_share=0.25)
    cl.collective(coll, 0, phase="fwd", step=0)
    op = cl.compute(0, "c", 1.0, phase="fwd", step=0)
    cl.run()
    # 1 s at rate 0.75 while the collective runs (0.75 of the work), the remaining 0.25 at rate 1
    assert op.end == pytest.approx(1.25)
    two = Cluster(1, streams=("compute", "comm", "inter"))
    for s in ("comm", "inter"):
        c = two.new_collective(s, "all_gather", 1, 10.0, sm_share=0.6)
        two.collective(c, 0, phase="fwd", step=0, stream=s)
    op = two.compute(0, "c", 1.0, phase="fwd", step=0)
    two.run()
    assert op.end == pytest.approx(1 / (1 - MAX_SM_SHARE))  # capped: compute keeps 10% of the SMs


@pytest.mark.parametrize("layout", ["fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free", "ddp", "sharded"])
@pytest.mark.parametrize("strategy", ["adamw", "naive", "dmuon"])
def test_representative_ranks_give_the_same_result_as_every_rank(layout, strategy):
    cfg = SimConfig(workload="qwen2.5-1.5b", gpus=32, strategy=strategy, layout=layout)
    fast = dataclasses.asdict(simulate(cfg))
    full = dataclasses.asdict(run(cfg)[0])
    for k, v in full.items():
        if isinstance(v, float):
            assert fast[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
        else:
            assert fast[k] == v, k


def test_latency_grows_with_node_count_at_fixed_work_per_gpu():
    steps = [simulate(SimConfig(workload="qwen2.5-1.5b", gpus=n, strategy="adamw")).step_s
             for n in (8, 128, 1024)]
    assert steps[0] < steps[1] < steps[2]


def test_public_multinode_rows_cite_a_source_and_are_within_20pct():
    from simulator.validation.validate_multinode import multinode_rows, predict, public_rows

    rows = multinode_rows()
    assert len(rows) >= 4 and {r["nodes"] for r in rows} >= {2, 32}
    for r in rows:
        assert r["source"].startswith("https://"), r["id"]
        assert abs(r["error"]) <= 0.20, (r["id"], r["error"])
    # the prediction is the model's, not the table's: half the NICs, half the large-message busbw
    big = next(r for r in public_rows() if r["id"] == "nccl1048_2x8_a100")
    assert predict({**big, "nics_per_node": "2"}) == pytest.approx(predict(big) / 2, rel=0.01)


def test_tiny_all_reduce_across_32_nodes_takes_ll_tree_latency():
    prof = load_profile("a800")
    t = collective_time_s("all_reduce", 8, Group(32, 8), prof.network, nccl=True)
    ll = next(q for q in prof.network.protocols if q.name == "LL")
    assert t == pytest.approx(ll.tree_base_s + 2 * (7 * ll.tree_intra_s + 5 * ll.tree_inter_s), rel=1e-4)
    simple_only = collective_time_s("all_reduce", 8, Group(32, 8), prof.network, hierarchical=False)
    assert simple_only > 3 * t  # Simple ring: 2 (255 - 31) NVLink + 62 network steps


def test_jitter_reports_the_median_step_and_grows_with_the_ranks_that_wait():
    base = dict(workload="qwen2.5-1.5b", strategy="adamw", jitter_steps=4)
    quiet = simulate(SimConfig(gpus=16, **base))
    assert quiet.step_p90_s == quiet.step_s
    a, b = (simulate(SimConfig(gpus=16, jitter=0.05, seed=3, **base)) for _ in range(2))
    assert a == b  # seeded: reproducible
    assert a.step_p90_s >= a.step_s > quiet.step_s
    wide = simulate(SimConfig(gpus=64, jitter=0.05, seed=3, **base))
    assert wide.step_s - simulate(SimConfig(gpus=64, **base)).step_s > a.step_s - quiet.step_s
    with pytest.raises(InputError, match="jitter must be a finite number >= 0"):
        simulate(SimConfig(gpus=16, jitter=-0.1, **base))


def test_free_layouts_publish_on_their_own_stream_as_the_runtime_does():
    from simulator.api import run

    _, built = run(SimConfig(workload="qwen2.5-1.5b", gpus=16, strategy="dmuon", layout="fsdp-free"))
    pubs = built.cluster.ops(0, "pub")
    assert pubs and all(op.coll.kind in ("broadcast", "all_gather") for op in pubs)
    assert not any(op.name.startswith(("pub", "regather")) for op in built.cluster.ops(0, "comm"))


def test_hsdp_dmuon_plans_over_every_rank_as_the_runtime():
    from simulator.api import run

    res, built = run(SimConfig(workload="qwen2.5-1.5b", gpus=32, strategy="dmuon", layout="hsdp-keep"))
    plan = built.spec.plan
    assert plan.world_size == 32 and max(plan.owners) >= 8  # owners beyond the first node
    assert not any(op.name.startswith("ar_owned") for op in built.cluster.ops(0, "inter"))
    one_node = simulate(SimConfig(workload="qwen2.5-1.5b", gpus=8, strategy="dmuon", layout="hsdp-keep"))
    assert res.ns_makespan_s < one_node.ns_makespan_s  # each NS once in the job, spread over 32 ranks


def test_public_multinode_fsdp_scaling_rows_cite_a_source_and_are_within_20pct():
    from simulator.validation.validate_multinode import step_rows_public, step_scaling_rows

    rows = step_scaling_rows()
    assert {r["series"] for r in rows} >= {"mpt-125m", "mpt-7b", "torchtitan-llama3.1-8b"}
    assert max(r["gpus"] for r in rows) == 128 and min(r["base_gpus"] for r in rows) == 8
    for r in rows:
        assert r["source"].startswith("https://"), r["series"]
        assert abs(r["error"]) <= 0.20, (r["series"], r["gpus"], r["error"])
        assert r["published_growth"] == pytest.approx(1 / r["published"] - 1)
    # the unchecked outlier (mpt-1b at 32 GPUs) is listed but is no series' baseline
    assert any(p["checked"] == "no" for p in step_rows_public())
    assert {r["base_gpus"] for r in rows if r["series"] == "mpt-1b"} == {64}


def test_mpt_stand_in_has_the_published_parameter_count():
    from simulator.models.hf_config import n_params
    from simulator.validation.validate_multinode import _workload, step_rows_public

    # llm-foundry's NumParams column (seq 2048) minus MPT's learned position embedding (2048 x d_model)
    published = {"mpt-125m": 125311488, "mpt-760m": 760470528, "mpt-7b": 6658859008}
    rows = {r["series"]: r for r in step_rows_public()}
    for name, total in published.items():
        d = int(rows[name]["d_model"])
        assert n_params(_workload(rows[name])) == pytest.approx(total - 2048 * d, rel=0.005), name


def test_fsdp_scaling_row_follows_the_cluster_file(tmp_path):
    from simulator.validation.validate_multinode import simulate_step_row, step_rows_public

    row = next(r for r in step_rows_public() if r["series"] == "mpt-125m" and r["gpus"] == "128")
    text = (Path(__file__).resolve().parent.parent / row["cluster"]).read_text()
    slow = tmp_path / "slow.toml"  # a 64x slower fabric: the all-gathers are no longer hidden
    slow.write_text(text.replace('nic_gbps = { value = 200', 'nic_gbps = { value = 3.125'))
    fast = simulate_step_row(row)
    assert simulate_step_row({**row, "cluster": str(slow)})["step_s"] > 1.2 * fast["step_s"]


def test_every_public_step_row_states_its_settings_and_cluster():
    from simulator.fabric.cluster_file import read_cluster
    from simulator.validation.validate_multinode import _ROOT, step_rows_public

    rows = step_rows_public()
    needed = ("series", "gpus", "value", "checked", "workload", "gpu", "cluster", "seq_len", "micro_batch",
              "grad_accum", "global_batch", "precision", "sharding", "layout", "activation_checkpointing",
              "metric", "unit", "source", "note")
    for r in rows:
        assert all(r[k].strip() for k in needed), (r["series"], r["gpus"])
        assert r["checked"] in ("yes", "no") and r["grad_accum"] == "1"
        assert int(r["global_batch"]) == int(r["micro_batch"]) * int(r["gpus"])
        assert read_cluster(_ROOT / r["cluster"])["gpus_per_node"] == 8


def test_one_gpu_per_node_collectives_hold_the_nic_sized_channel_count():
    """HSDP's replicate all-reduce (one GPU per node) holds nccl_channels_net SMs (a800: 2 of 108); the
    in-node reduce-scatter / all-gather keep nccl_channels (24); a profile without the key keeps one count."""
    prof = load_profile("a800")
    assert prof.sm_share_net == pytest.approx(2 / 108) and "NVIDIA/nccl#1291" in prof.provenance["nccl_channels_net"]
    assert dataclasses.replace(prof, nccl_channels_net=0).sm_share_net == prof.sm_share
    assert dataclasses.replace(prof, sm_count=0).sm_share_net == 0.0
    built = run(SimConfig(workload="qwen2.5-1.5b", gpus=16, strategy="adamw", layout="hsdp-free"),
                all_ranks=False)[1]
    shares = {(c.group.rstrip("0123456789"), c.kind): c.sm_share for c in built.cluster.collectives}
    assert shares[("inter", "all_reduce")] == pytest.approx(2 / 108)
    assert shares[("intra", "reduce_scatter")] == shares[("intra", "all_gather")] == pytest.approx(24 / 108)
