"""Step programs: bytes per layout (muon.md's table), the shared Plan, monotonicity, determinism, errors."""

import dataclasses
from dataclasses import dataclass

import pytest

from dmuon.errors import InputError
from dmuon.plan.flops import ns_flops
from dmuon.runtime.exchange import LinkEstimate, choose_mode
from simulator.api import SimConfig, simulate
from simulator.fabric.hardware import load_profile
from simulator.models.workload import load_workload


@dataclass(frozen=True)
class Answer:
    time_s: float
    measured: bool
    detail: str


class FakeCost:
    """A small roofline cost table: NS at `flops` FLOP/s + 10 us per call; elementwise at `bw` bytes/s."""

    def __init__(self, flops=100e12, bw=1e12, name="fake"):
        self.flops, self.bw, self.name = flops, bw, name

    def ns_time(self, rows, cols, batch=1, method="gram_sym", dtype="bf16"):
        m = "gram_sym" if method == "auto" else method
        return Answer(1e-5 + ns_flops(rows, cols, m, batch=batch) / self.flops, False, "fake roofline")

    def elementwise_time(self, numel, op, dtype="fp32", tensors=1):
        return Answer(numel * 28 / self.bw if self.bw else 0.0, False, "fake bandwidth")


COST = FakeCost()
SMALL = load_workload("qwen2.5-1.5b").scaled(1.0, blocks=3)


def sim(**kw):
    base = dict(workload=SMALL, gpus=16, cost=COST)
    base.update(kw)
    return simulate(SimConfig(**base))


def expected_volume(strategy, layout, n, g):
    """Muon bytes per rank / (P_muon x 2 bytes): muon.md's table, extended to HSDP and sharded."""
    m = n // g
    ring, intra, inter = (n - 1) / n, (g - 1) / g, 2 * (m - 1) / m / g
    table = {
        ("adamw", "fsdp-keep"): 2 * ring, ("adamw", "fsdp-free"): 3 * ring, ("adamw", "ddp"): 2 * ring,
        ("adamw", "hsdp-keep"): 2 * intra + inter, ("adamw", "hsdp-free"): 3 * intra + inter,
        ("adamw", "sharded"): 2 * ring,
        ("naive", "fsdp-keep"): 3 * ring, ("naive", "fsdp-free"): 4 * ring, ("naive", "ddp"): 2 * ring,
        ("naive", "hsdp-keep"): 3 * intra + inter, ("naive", "hsdp-free"): 4 * intra + inter,
        ("naive", "sharded"): 3 * ring,
        ("dmuon", "fsdp-keep"): 2 * ring, ("dmuon", "fsdp-free"): 3 * ring, ("dmuon", "ddp"): 2 * ring,
        # dmuon on HSDP: the Muon matrices' exchange spans every rank (two-level), as the runtime's
        ("dmuon", "hsdp-keep"): 2 * ring, ("dmuon", "hsdp-free"): 3 * ring,
        ("dmuon", "sharded"): 2 * ring + 2 * ring / n,  # AG fwd + RS bwd + all_to_all there and back
    }
    return table[(strategy, layout)]


LAYOUTS = ("fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free", "ddp", "sharded")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_comm_bytes_per_layout_equal_muon_md_table(layout):
    n, g = 16, 8
    p_muon = sum(m.numel for m in SMALL.muon_matrices)
    got = {}
    for strategy in ("adamw", "naive", "dmuon"):
        r = sim(strategy=strategy, layout=layout, gpus=n, gpus_per_node=g)
        want = expected_volume(strategy, layout, n, g)
        assert r.muon_comm_volume == pytest.approx(want, rel=1e-9), (strategy, layout)
        assert r.muon_comm_bytes_per_rank == pytest.approx(want * p_muon * 2, rel=1e-9)
        got[strategy] = r.muon_comm_bytes_per_rank
    # the owner-centric layout never moves more Muon bytes than gather-then-compute
    assert got["dmuon"] <= got["naive"] * (1 + 1e-12)


def test_single_rank_moves_nothing_and_dmuon_equals_the_plan():
    r = sim(gpus=1, strategy="dmuon")
    assert r.comm_bytes_per_rank == 0 and r.exposed_comm_s == 0
    assert r.optimizer_s > 0 and r.step_s == pytest.approx(r.forward_s + r.backward_s + r.optimizer_s)


def test_phases_sum_to_the_step_and_are_positive():
    for strategy in ("adamw", "naive", "dmuon"):
        for layout in LAYOUTS:
            r = sim(strategy=strategy, layout=layout)
            assert r.step_s == pytest.approx(r.forward_s + r.backward_s + r.optimizer_s, rel=1e-12)
            assert min(r.forward_s, r.backward_s, r.optimizer_s) > 0
            assert 0 <= r.grad_sync_tail_s <= r.optimizer_s
            assert r.tokens_per_s == pytest.approx(16 * 2048 * 2 / r.step_s)


def test_deterministic_bitwise():
    a = sim(strategy="dmuon", layout="hsdp-free", gpus=32)
    b = sim(strategy="dmuon", layout="hsdp-free", gpus=32)
    assert a == b and repr(a) == repr(b)


def test_simulator_times_the_plan_it_is_given():
    from dmuon.plan.build import build_plan

    zero_ew = FakeCost(bw=0)
    plan = build_plan(SMALL.muon_matrices, 8, zero_ew, balancer="lpt", method="gram_sym")
    no_sm = dataclasses.replace(load_profile("a800"), nccl_channels=0)  # no SM contention
    r = simulate(SimConfig(workload=SMALL, gpus=8, gpu=no_sm, strategy="dmuon", plan=plan, cost=zero_ew))
    assert r.ns_makespan_s == plan.makespan_s
    # no elementwise cost: the busiest rank's simulated NS time is exactly the plan's makespan
    assert r.ns_busy_max_s == pytest.approx(plan.makespan_s, rel=1e-12)
    # with NCCL's SMs taken while the last reductions / publications run beside it, NS only gets longer
    shared = simulate(SimConfig(workload=SMALL, gpus=8, strategy="dmuon", plan=plan, cost=zero_ew))
    assert shared.ns_busy_max_s >= r.ns_busy_max_s
    assert r.plan_balancer == "lpt"
    with pytest.raises(InputError, match="plan is for 8 ranks; this layout needs a plan over 16"):
        simulate(SimConfig(workload=SMALL, gpus=16, strategy="dmuon", plan=plan, cost=zero_ew))
    other = load_workload("qwen2.5-1.5b").scaled(0.5, blocks=3)
    with pytest.raises(InputError, match="does not match the workload"):
        simulate(SimConfig(workload=other, gpus=8, strategy="dmuon", plan=plan, cost=zero_ew))


def test_build_plan_called_once_per_config(monkeypatch):
    import dmuon.plan.build as build
    import simulator.costs as costs

    calls = []
    real = build.build_plan

    def counting(*a, **kw):
        calls.append(kw.get("balancer"))
        return real(*a, **kw)

    monkeypatch.setattr(build, "build_plan", counting)
    monkeypatch.setattr(costs, "_PLANS", {})
    sim(strategy="dmuon")
    sim(strategy="dmuon")
    sim(strategy="naive")
    assert calls == ["lpt"]
    sim(strategy="dmuon", balancer="round_robin")
    assert calls == ["lpt", "round_robin"]


def test_milp_makespan_non_increasing_in_ranks():
    w = load_workload("qwen2.5-1.5b").scaled(0.25, blocks=2)
    spans = [simulate(SimConfig(workload=w, gpus=n, strategy="dmuon", balancer="milp", cost=COST,
                                milp_time_limit_s=20.0)).ns_makespan_s for n in (1, 2, 3, 4, 6, 8)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(spans, spans[1:], strict=False)), spans


@pytest.mark.parametrize("strategy", ["adamw", "naive", "dmuon"])
def test_more_bandwidth_or_a_faster_gpu_is_never_slower(strategy):
    steps = [sim(strategy=strategy, gpus=32, nic_gbps=g).step_s for g in (100, 400, 1600, 6400)]
    assert all(b <= a for a, b in zip(steps, steps[1:], strict=False)), steps
    a800 = load_profile("a800")
    faster = dataclasses.replace(a800, fwd_flops=2 * a800.fwd_flops, bwd_flops=2 * a800.bwd_flops)
    slow = sim(strategy=strategy, gpus=32, gpu=a800)
    fast = sim(strategy=strategy, gpus=32, gpu=faster, cost=FakeCost(flops=2 * COST.flops, bw=2 * COST.bw))
    assert fast.step_s <= slow.step_s
    assert fast.forward_s < slow.forward_s


def test_overlap_moves_publication_out_of_the_optimizer():
    on = sim(strategy="dmuon", overlap=True)
    off = sim(strategy="dmuon", overlap=False)
    assert off.optimizer_s > on.optimizer_s
    assert on.step_s <= off.step_s
    assert on.muon_comm_bytes_per_rank == off.muon_comm_bytes_per_rank


def test_ablation_switches_change_the_plan():
    full = sim(strategy="dmuon", gpus=8)
    std = sim(strategy="dmuon", gpus=8, gram=False, symmetric_kernels=False)
    nobatch = sim(strategy="dmuon", gpus=8, batching=False)
    assert (full.plan_method, std.plan_method) == ("gram_sym", "standard")
    assert std.ns_makespan_s > full.ns_makespan_s
    assert nobatch.ns_makespan_s >= full.ns_makespan_s
    # hierarchical: dmuon's own owner exchange (the runtime's node_size); NCCL-native collectives
    # (FSDP's, naive's all-gathers) are NCCL's flat rings either way
    flat = sim(strategy="dmuon", gpus=32, hierarchical=False)
    two = sim(strategy="dmuon", gpus=32, hierarchical=True)
    assert flat.step_s != two.step_s and flat.comm_bytes_per_rank == two.comm_bytes_per_rank
    naive = [sim(strategy="naive", gpus=32, hierarchical=h).step_s for h in (False, True)]
    assert naive[0] == naive[1]


@pytest.mark.parametrize("kw,match", [
    ({"workload": "gpt5"}, "unknown workload 'gpt5'; accepted: .*qwen2.5-7b"),
    ({"gpu": "b200"}, "unknown gpu profile 'b200'; accepted: .*a800"),
    ({"layout": "zero9"}, "unknown layout 'zero9'; accepted: fsdp-keep, fsdp-free"),
    ({"strategy": "sgd"}, "unknown strategy 'sgd'; accepted: adamw, naive, dmuon"),
    ({"gpus": 0}, "gpus must be an integer >= 1"),
    ({"gpus": 12}, r"gpus=12 is not a whole number of 8-GPU nodes \(1.5 nodes\); accepted: 1..8 .* "
                   r"multiple of 8 \(nearest: 8 or 16\)"),
    ({"nic_gbps": -100.0}, "nic_gbps must be a positive number"),
    ({"balancer": "greedy"}, "unknown balancer 'greedy'; accepted: round_robin, lpt, milp"),
])
def test_bad_input_says_what_is_accepted(kw, match):
    with pytest.raises(InputError, match=match):
        sim(**kw)


def test_custom_workload_file(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('name = "mine"\n'
                 '[[matrices]]\nname = "embed_tokens"\nrows = 1000\ncols = 256\noptimizer = "adamw"\n'
                 '[[matrices]]\nname = "q_proj"\nrows = 256\ncols = 256\ncount = 4\n'
                 '[[matrices]]\nname = "up_proj"\nrows = 1024\ncols = 256\ncount = 4\n')
    r = simulate(SimConfig(workload=str(f), gpus=4, strategy="dmuon", cost=COST, seq_len=128))
    # one bucket per layer, q_proj and up_proj on two owners: latency-bound, so "auto" pads both chunks to
    # up_proj's size and runs one reduce-scatter / all-gather (dmuon.runtime.exchange.choose_mode)
    q, up = 256 * 256, 1024 * 256
    net = load_profile("a800").network
    links = LinkEstimate(net.curves["all_gather"].busbw_Bps[-1], net.nic_Bps_per_node * net.inter_efficiency)
    assert choose_mode(2 * (q + up), 2 * up, 2, 2, 4, 4, True, links) == "reduce_scatter"
    padded = 4 * up / (q + up)
    assert r.workload == "mine" and r.step_s > 0 and r.muon_comm_volume == pytest.approx(2 * 3 / 4 * padded)


def test_overlap_slowdown_only_slows():
    base = sim(strategy="dmuon", layout="fsdp-free", gpus=32)
    slowed = sim(strategy="dmuon", layout="fsdp-free", gpus=32, overlap_slowdown=0.3)
    # forward may be comm-bound: then equal up to the summation order of floats
    assert slowed.forward_s >= base.forward_s * (1 - 1e-12) and slowed.step_s > base.step_s
    assert slowed.muon_comm_bytes_per_rank == base.muon_comm_bytes_per_rank


def test_hsdp_cross_node_all_reduces_run_on_their_own_stream():
    from simulator.api import run

    _, built = run(SimConfig(workload=SMALL, gpus=16, strategy="dmuon", layout="hsdp-keep", cost=COST))
    inter = built.cluster.ops(3, "inter")
    assert inter and all(op.coll.kind == "all_reduce" and op.coll.n == 2 for op in inter)
    assert all(op.coll.kind != "all_reduce" for op in built.cluster.ops(3, "comm"))


def test_config_fields_have_help():
    assert all(text for text in SimConfig.help().values())
