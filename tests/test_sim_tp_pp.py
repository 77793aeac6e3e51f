"""Tensor, sequence and pipeline parallelism in the simulator (simulator.parallel, .pipeline,
.parallel_run)."""

from dataclasses import replace

import pytest

from dmuon.errors import InputError
from simulator.api import SimConfig, profile_of, run, simulate
from simulator.collectives import Group, collective_time_s
from simulator.hardware import load_profile
from simulator.parallel import Layout, layout_of, stage_layers, tp_layer_comm
from simulator.parallel_run import TPCost, run_parallel
from simulator.pipeline import simulate_pipeline
from simulator.workload import resolve_workload

L70 = "experiments/models/llama-3.1-70b/config.json"


@pytest.mark.parametrize("strategy", ["adamw", "naive", "dmuon"])
def test_one_stage_one_microbatch_is_todays_step(strategy):
    """tp = pp = 1 through the TP/PP composition gives today's step program's step time."""
    cfg = SimConfig(workload="qwen2.5-1.5b", gpus=16, gpu="h100", strategy=strategy)
    today = simulate(cfg)
    prof = profile_of(cfg)
    composed = run_parallel(cfg, resolve_workload(cfg.workload), prof, prof.gpus_per_node, run)
    assert composed["step_s"] == pytest.approx(today.step_s, rel=1e-12)
    assert composed["optimizer_s"] == pytest.approx(today.optimizer_s, rel=1e-12)


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (8, 1, 8), (4, 2, 8), (2, 3, 4)])
def test_bubble_matches_formula_for_uniform_stages(p, v, m):
    f, b = 1.0 / v, 2.0 / v
    r = simulate_pipeline(p, v, m, [[f] * v] * p, [[b] * v] * p)
    ideal = m * v * (f + b)
    assert r.bubble_s / ideal == pytest.approx((p - 1) / (m * v), rel=1e-12)
    if v == 1:
        assert r.makespan_s == pytest.approx((m + p - 1) * (f + b))


def test_sends_and_slow_stage_lengthen_the_pipeline():
    base = simulate_pipeline(4, 1, 8, [[1.0]] * 4, [[2.0]] * 4)
    sent = simulate_pipeline(4, 1, 8, [[1.0]] * 4, [[2.0]] * 4, 0.1, 0.1)
    # at least the first micro-batch's 3 hops forward and 3 back; 1F1B's steady state waits on them too
    assert sent.makespan_s >= base.makespan_s + 6 * 0.1 - 1e-12
    slow = simulate_pipeline(4, 1, 8, [[1.0], [1.5], [1.0], [1.0]], [[2.0], [3.0], [2.0], [2.0]])
    assert slow.busy_f_s[1] + slow.busy_b_s[1] == pytest.approx(8 * 4.5)
    # the slow stage paces the step: its work plus stage 0's first forward and last backward, at most as
    # if every stage were as slow
    assert 8 * 4.5 + 1.0 + 2.0 <= slow.makespan_s <= (8 + 4 - 1) * 4.5


def test_tp_bytes_per_layer_match_megatron():
    """Forward + backward: 4 all-reduces of b s h (Korthikanti et al. 2022); SP: 4 all-gathers + 4
    reduce-scatters, the same bytes; full recomputation: 2 more all-reduces in backward."""
    net = load_profile("h100").network
    b, s, h, t = 2, 2048, 8192, 8
    ar = 2 * (t - 1) / t * b * s * h * 2
    for sp, rec, n in ((False, "none", 4), (True, "none", 4), (False, "full", 6), (False, "selective", 4)):
        lay = Layout(t, 1, 1, 1, 1, sp, rec, 8)
        (tf, bf), (tb, bb) = (tp_layer_comm(lay, b * s, h, 2, net, backward=x) for x in (False, True))
        assert bf + bb == pytest.approx(n * ar)
        g, size = Group(1, t), b * s * h * 2
        kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
        one = sum(collective_time_s(k, size, g, net, nccl=True) for k in kinds)
        assert tf == pytest.approx(2 * one) and tb == pytest.approx((n - 2) * one)


def test_step_is_the_slowest_stage_and_its_optimizer():
    r = simulate(SimConfig(model=L70, gpus=64, gpu="h100", tp=8, pp=4, microbatches=4, strategy="naive"))
    ends = [e + o for e, o in zip(r.settings["stage_end_s"], r.settings["stage_optimizer_s"], strict=True)]
    assert r.step_s == pytest.approx(max(ends))
    assert r.settings["slowest_stage"] == ends.index(max(ends))
    assert r.optimizer_s == r.settings["stage_optimizer_s"][r.settings["slowest_stage"]]
    assert r.tokens_per_s == pytest.approx(2 * 4 * 2 * 2048 / r.step_s)  # dp 2 x 4 micro-batches x 2 x seq
    d = simulate(SimConfig(model=L70, gpus=64, gpu="h100", tp=8, pp=4, microbatches=4, strategy="dmuon"))
    assert d.step_s < r.step_s


def test_muon_on_tp_shards_priced_by_dmuon_plan_tp():
    """dmuon: the mode price_tp_modes' best picks, in rank-seconds per TP rank; naive: duplicated."""
    from dmuon.plan.tp import price_tp_modes
    from simulator.costs import load_cost
    from simulator.split_links import SimulatorLinks

    prof = load_profile("h100")
    base = load_cost(prof.cost_profiles)
    links = SimulatorLinks(prof.network, 8)
    for whole, shard, dim in (((8192, 8192), (1024, 8192), 0), ((1024, 65536), (1024, 8192), 1)):
        price = price_tp_modes(*whole, dim, 8, base, method="gram_sym", links=links)
        shards = {shard: (*whole, dim)}
        owner = TPCost(base, shards, 8, links, 2, duplicated=False).ns_time(*shard, 1, "gram_sym", "bf16")
        dup = TPCost(base, shards, 8, links, 2, duplicated=True).ns_time(*shard, 1, "gram_sym", "bf16")
        assert owner.time_s == pytest.approx(min(price.group_s if price.group_ok else float("inf"),
                                                 price.gather_s / 8))
        assert dup.time_s == pytest.approx(price.duplicated_s)


def test_llama3_stage_split():
    w = resolve_workload("qwen2.5-7b", "llama-3.1-405b")
    stages = stage_layers(w, 16, 1)
    blocks = [sum(1 for l in st[0] if any(p.block is not None for p in w.layer_params()[l])) for st in stages]
    assert blocks == [7] + [8] * 14 + [7]  # Llama 3: one layer fewer on the first and last stage
    assert stage_layers(w, 2, 3)[1][2][-1] == w.n_layers - 1  # the head on the last chunk of the last stage


@pytest.mark.parametrize("change,message", [
    (dict(tp=3), "tp=3 does not divide the 8 GPUs per node; accepted: a divisor of 8 (TP runs on NVLink "
                 "inside "
                 "a node)"),
    (dict(tp=8, pp=3), "tp x pp = 24 does not divide gpus=64; accepted: gpus a multiple of tp x pp"),
    (dict(pp=32, gpus=256), "pp x vpp = 32 does not divide the 80 transformer layers (nor 80 + 2, one "
                            "fewer on "
                            "the first and last stage); accepted: pp x vpp a divisor of 80 or of 82"),
    (dict(pp=4, microbatches=2), "microbatches=2 < pp=4: 1F1B needs at least pp micro-batches; accepted: "
                                 "microbatches >= 4"),
    (dict(pp=4, vpp=2, microbatches=6), "pp=4 does not divide microbatches=6: the interleaved schedule runs "
                                        "micro-batches in groups of pp; accepted: a multiple of pp"),
    (dict(sp=True), "sp (sequence parallelism) splits the TP group's activations; accepted: sp with tp > 1"),
    (dict(tp=2, ep=2), "tp > 1 with ep > 1 is not modelled (expert tensor parallelism); accepted: tp=1 "
                       "with ep, "
                       "or ep=1 with tp"),
    (dict(recompute="some"), "unknown recompute 'some'; accepted: none, selective, full"),
])
def test_errors(change, message):
    cfg = replace(SimConfig(model=L70, gpus=64, gpu="h100"), **change)
    with pytest.raises(InputError) as e:
        simulate(cfg)
    assert str(e.value) == message


def test_heads_must_divide():
    cfg = SimConfig(model=L70, gpus=128, gpu="h100", gpus_per_node=16, tp=16)
    msg = r"^tp=16 does not divide the model's 8 KV heads; accepted: a divisor of 8$"
    with pytest.raises(InputError, match=msg):
        layout_of(cfg, 16, (64, 8))
