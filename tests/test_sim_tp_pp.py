"""Tensor, sequence and pipeline parallelism in the simulator (simulator.programs.parallel, .pipeline,
.parallel_run)."""

from dataclasses import replace

import pytest

from dmuon.errors import InputError
from simulator.api import SimConfig, profile_of, run, simulate
from simulator.fabric.collectives import Group, collective_time_s
from simulator.fabric.hardware import load_profile
from simulator.programs.parallel import Layout, layout_of, stage_layers, tp_layer_comm
from simulator.programs.parallel_run import TPCost, run_parallel
from simulator.programs.pipeline import simulate_pipeline
from simulator.models.workload import resolve_workload

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


def test_naive_muon_on_tp_shards_is_duplicated():
    """naive: every TP rank all-gathers the whole matrix and runs its NS (price_tp_modes' duplicated)."""
    from dmuon.plan.tp import price_tp_modes
    from simulator.costs import load_cost
    from simulator.programs.split_links import SimulatorLinks

    prof = load_profile("h100")
    base = load_cost(prof.cost_profiles)
    links = SimulatorLinks(prof.network, 8)
    for whole, shard, dim in (((8192, 8192), (1024, 8192), 0), ((1024, 65536), (1024, 8192), 1)):
        price = price_tp_modes(*whole, dim, 8, base, method="gram_sym", links=links)
        dup = TPCost(base, {shard: (*whole, dim)}, 8, links, 2).ns_time(*shard, 1, "gram_sym", "bf16")
        assert dup.time_s == pytest.approx(price.duplicated_s)


def _dmuon_tp_run(monkeypatch, change=None):
    """A dmuon tp=8 x pp=2 step of Llama 3.1 70B on 64 H100s (dp 4); `change(plan)` edits each stage's TP
    plan before the step runs it. Returns (result, [(TP plan, the DP plan the step program ran)])."""
    import simulator.costs as costs

    seen, real = [], getattr(costs.tp_plan_for, "__wrapped__", costs.tp_plan_for)

    def tp_plan_for(*a, **k):
        plan = real(*a, **k)
        return change(plan) if change else plan

    tp_plan_for.__wrapped__ = real
    monkeypatch.setattr(costs, "tp_plan_for", tp_plan_for)
    cfg = SimConfig(model=L70, gpus=64, gpu="h100", tp=8, pp=2, microbatches=2, strategy="dmuon")
    prof = profile_of(cfg)

    def run_dp(dcfg, all_ranks=False):
        r, built = run(dcfg, all_ranks=all_ranks)
        seen.append(built.spec.plan)
        return r, built

    out = run_parallel(cfg, resolve_workload(cfg.workload, cfg.model), prof, prof.gpus_per_node, run_dp)
    return out, seen


def test_dmuon_on_tp_runs_build_tp_plans_plan(monkeypatch):
    """Each stage's step program runs build_tp_plan's Plan, called as the runtime calls it (whole matrices,
    Megatron shard dims, the cost table's links, bf16 wire): its owners' TP groups, one batch per matrix of
    the TP group's gather + NS + scatter on the simulator's NVLink; harness plan --tp prints that plan."""
    from functools import partial

    from dmuon.plan.build import build_plan
    from dmuon.plan.split import links_for
    from dmuon.plan.tp import build_tp_plan, price_tp_modes
    from harness.plan_parallel import stage_plans
    from simulator.costs import load_cost
    from simulator.programs.parallel import stage_workload
    from simulator.programs.split_links import SimulatorLinks

    out, seen = _dmuon_tp_run(monkeypatch)
    w = resolve_workload(None, L70)
    cost = load_cost(load_profile("h100").cost_profiles)
    sim_links = SimulatorLinks(load_profile("h100").network, 8)
    layers = [l for c in stage_layers(w, 2, 1)[0] for l in c]
    stage_wl, full = stage_workload(w, layers, 8, "s0")
    whole = [replace(m, rows=full[m.name][0], cols=full[m.name][1]) for m in stage_wl.muon_matrices]
    ref = build_tp_plan(whole, 32, cost, tp=8, method="gram_sym", dtype="bf16", links=links_for(cost),
                        wire_bytes=2)
    view = seen[0]
    assert view.world_size == 4 and view.owners == tuple(o // 8 for o in ref.owners)
    assert [b.members for b in view.batches] == [(i,) for i in sorted(range(len(whole)),
                                                                      key=lambda i: (view.owners[i], i))]
    for b in view.batches:
        m, c = whole[b.members[0]], ref.tp_choices[b.members[0]]
        p = price_tp_modes(m.rows, m.cols, c.shard_dim, 8, cost, links=sim_links)
        assert c.mode == "gather" and b.time_s == pytest.approx(p.gather_s)  # Llama at tp 8: all gathered
    fn = partial(build_plan, balancer="lpt", method="gram_sym", dtype="bf16", batching=True, max_batch=8,
                 bucket_numel=0, time_limit_s=1.0)
    shown = stage_plans(w, L70, 64, 8, 2, 1, "h100", cost, fn)
    assert shown[0][2].owners == ref.owners and shown[0][3].owners == view.owners
    assert "build_tp_plan" in out["notes"][-1]


def test_tp_plan_imbalance_lengthens_the_optimizer(monkeypatch):
    """All matrices on TP group 0: its matrices run one after another, the optimizer takes at least their
    sum; moving a gathered matrix to another TP rank of its group changes nothing (the TP group's
    collectives serialize it, as the runtime's loop runs)."""
    def one_group(plan):
        return replace(plan, owners=tuple(o % 8 for o in plan.owners),
                       tp_choices=tuple(replace(c, dp_index=0) for c in plan.tp_choices))

    def other_rank(plan):
        return replace(plan, owners=tuple(o - o % 8 + (o + 3) % 8 for o in plan.owners),
                       tp_choices=tuple(replace(c, owner=(c.owner + 3) % 8) for c in plan.tp_choices))

    base, seen = _dmuon_tp_run(monkeypatch)
    bad, bad_seen = _dmuon_tp_run(monkeypatch, one_group)
    moved, _ = _dmuon_tp_run(monkeypatch, other_rank)
    total = sum(b.time_s for b in bad_seen[0].batches)
    assert set(bad_seen[0].owners) == {0} and bad_seen[0].makespan_s == pytest.approx(total)
    assert bad["optimizer_s"] >= total > 2 * seen[0].makespan_s
    assert base["optimizer_s"] < total and bad["step_s"] > base["step_s"]
    assert moved["step_s"] == pytest.approx(base["step_s"], rel=1e-12)


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
