"""The Plan from build_plan: fields, buckets, JSON round trip; the `harness plan` command."""

from __future__ import annotations

import json

import pytest

from dmuon.plan.build import build_plan, make_buckets
from dmuon.plan.cost import CostTable
from dmuon.plan.types import Plan
from harness.cli import main
from simulator.workload import load_workload

A800 = CostTable.load("a800")


@pytest.fixture(scope="module")
def qwen():
    return load_workload("qwen2.5-7b").muon_matrices


def test_plan_fields_and_json_round_trip(qwen, tmp_path):
    plan = build_plan(qwen, 8, A800, balancer="lpt")
    assert (
        plan.world_size == 8 and plan.balancer == "lpt" and plan.method == "gram_sym" and plan.dtype == "bf16"
    )
    assert plan.cost_source == "a800" and plan.solve_time_s > 0 and plan.makespan_s == max(plan.loads_s)
    assert 0 < plan.efficiency <= 1 and plan.gap == pytest.approx(1 - plan.efficiency)
    assert all(b.method == "gram_sym" for b in plan.batches)
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan and back.to_json() == text


def test_auto_method_picks_the_cheapest_call_per_batch():
    mats = load_workload("pi0").muon_matrices
    auto = build_plan(mats, 8, A800, balancer="lpt", method="auto")
    for b in auto.batches:
        best = min(
            A800.ns_time(b.rows, b.cols, b.size, m, "bf16").time_s
            for m in ("standard", "standard_sym", "gram", "gram_sym")
        )
        assert b.ns_s == pytest.approx(best, rel=1e-12)  # time_s adds the owner's momentum
        assert A800.ns_time(b.rows, b.cols, b.size, b.method, "bf16").time_s == best
    assert len({b.method for b in auto.batches}) > 1
    assert auto.makespan_s < build_plan(mats, 8, A800, balancer="lpt", method="gram_sym").makespan_s
    cpu = CostTable.load("cpu")  # no symmetric kernels on the CPU: auto picks among what was measured
    small = load_workload("qwen2.5-7b").scaled(1 / 16, blocks=2).muon_matrices
    on_cpu = build_plan(small, 2, cpu, method="auto", dtype="fp32")
    assert cpu.runnable_methods == ("standard", "gram") and {b.method for b in on_cpu.batches} <= {
        "standard",
        "gram",
    }


def test_buckets_follow_layer_order(qwen):
    per_layer = make_buckets(qwen, 0)
    assert len(per_layer) == 28
    assert [i for b in per_layer for i in b.members] == sorted(
        range(len(qwen)), key=lambda i: (qwen[i].layer, i)
    )
    for b in per_layer:
        assert len({qwen[i].layer for i in b.members}) == 1
    layer_numel = sum(m.numel for m in qwen if m.layer == qwen[0].layer)
    merged = make_buckets(qwen, 3 * layer_numel)
    assert len(merged) == 10  # 3 layers per bucket, the last holds the remaining 1
    assert all(b.numel(qwen) >= 3 * layer_numel for b in merged[:-1])
    assert [i for b in merged for i in b.members] == [i for b in per_layer for i in b.members]


def test_plan_is_deterministic(qwen):
    a = build_plan(qwen, 16, A800, balancer="milp", time_limit_s=5)
    b = build_plan(qwen, 16, A800, balancer="milp", time_limit_s=5, seed=3)
    assert a.owners == b.owners and a.batches == b.batches and a.makespan_s == b.makespan_s


def test_cli_plan_json(capsys, tmp_path):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--workload", "pi0", "--ranks", "8", "--balancer", "lpt", "--json", "--out", str(out)])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    for key in (
        "ranks",
        "balancer",
        "makespan_s",
        "lower_bound_s",
        "loads_s",
        "solve_time_s",
        "assignment",
        "matrices",
        "efficiency",
        "gap",
        "profile",
    ):
        assert key in d
    assert d["ranks"] == 8 and d["matrices"] == 415 == len(d["assignment"]) and len(d["loads_s"]) == 8
    assert max(d["loads_s"]) == pytest.approx(d["makespan_s"])
    assert Plan.from_json(out.read_text()).makespan_s == pytest.approx(d["makespan_s"])


def test_cli_plan_table_and_compare(capsys):
    assert main(["plan", "--workload", "wall-oss", "--ranks", "4", "--balancer", "round_robin"]) == 0
    text = capsys.readouterr().out
    assert "makespan" in text and "lower bound" in text and "efficiency" in text
    assert (
        main(["plan", "--compare", "--workload", "wall-wm", "--ranks", "8", "--time-limit", "2", "--json"])
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["milp_makespan_s"] <= rows[0]["lpt_makespan_s"] * (1 + 1e-9)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--balancer", "greedy"], "unknown balancer 'greedy'; accepted: round_robin, lpt, milp"),
        (["--profile", "tpu"], "unknown profile 'tpu'; accepted:"),
        (["--ranks", "0"], "--ranks must be a positive integer"),
        (["--ranks", "eight"], "--ranks must be a positive integer"),
        (["--workload", "gpt5"], "unknown workload 'gpt5'"),
        (["--method", "svd"], "unknown method 'svd'"),
    ],
)
def test_cli_plan_bad_input_exits_2_with_one_line(capsys, argv, message):
    base = {"--workload": "pi0", "--ranks": "8"}
    args = ["plan"]
    for k, v in base.items():
        if k not in argv:
            args += [k, v]
    assert main(args + argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


# ---- owner groups (split NS) -------------------------------------------------------------------------
def test_plan_without_groups_serializes_as_before(qwen):
    plan = build_plan(qwen, 8, A800, balancer="lpt")
    d = plan.to_dict()
    assert d["format_version"] == 1 and "max_split" not in d
    keys = {"owner", "rows", "cols", "members", "time_s", "method"}
    assert all(set(b) == keys | {"momentum_s"} for b in d["batches"])  # the owner's momentum priced
    ns_only = build_plan(qwen, 8, A800, balancer="lpt", owner_momentum=False).to_dict()
    assert ns_only["format_version"] == 1 and all(set(b) == keys for b in ns_only["batches"])
    assert plan.groups == tuple((o,) for o in plan.owners) and not plan.split_batches
    assert Plan.from_dict(d) == plan


def test_plan_with_groups_round_trips(qwen):
    plan = build_plan(qwen, 256, A800, balancer="milp", max_split=8, time_limit_s=5)
    assert plan.split_batches and plan.max_split == 8
    d = plan.to_dict()
    assert d["format_version"] == 2 and d["max_split"] == 8
    assert sum("group" in b for b in d["batches"]) == len(plan.split_batches)
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.groups == plan.groups
    for i, g in enumerate(plan.groups):
        assert g[0] == plan.owners[i]
    with pytest.raises(ValueError, match="plan format version 4 is not supported"):  # 3: TP plans
        Plan.from_dict({**d, "format_version": 4})


def test_split_pricing_model():
    from dmuon.plan.flops import METHODS, ns_flops, ns_flops_parts
    from dmuon.plan.split import LINKS, place_groups, split_price

    for mt in METHODS:
        local, rep = ns_flops_parts(512, 4096, mt)
        assert local + rep == ns_flops(512, 4096, mt)
        local4, rep4 = ns_flops_parts(512, 4096, mt, parts=3)
        assert rep4 == rep and local4 == pytest.approx(local * 1366 / 4096)  # ceil(4096 / 3) = 1366
    links = LINKS["a800"]
    n, m, b = 1024, 16384, 2
    tri = b * n * (n + 1) / 2 * 4
    small = 2 * links.all_gather_s(64 * 4, range(4))
    for mt, reduces in (("gram_sym", 2), ("standard_sym", 5)):
        p = split_price(A800, n, m, b, 4, mt, "bf16", links, range(4))  # block 1024 x 4096: a real call
        assert p.compute_s == pytest.approx(A800.ns_time(n, m // 4, b, mt, "bf16").time_s)
        assert p.comm_s == pytest.approx(reduces * links.all_reduce_s(tri, range(4)) + small)
    narrow = split_price(A800, 2048, 4096, 1, 4, "gram_sym", "bf16", links, range(4))  # 2048 x 1024 block
    local, rep = ns_flops_parts(2048, 4096, "gram_sym", parts=4)
    square = A800.ns_time(2048, 2048, 1, "gram_sym", "bf16").time_s
    assert narrow.compute_s == pytest.approx(square * (local + rep) / ns_flops(2048, 2048, "gram_sym"))
    # collectives.md ring all-reduce: base + 2 (k-1) alpha + 2 (k-1) / k S / B inside a node
    s = 64e6
    assert links.all_reduce_s(s, range(8)) == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 14 / 8 * s / 64e9)
    two_nodes = 8.4e-6 + 14 * 3.4e-6 + 14 / 8 * s / 64e9 + 2 * (14e-6 + s / 8 / 2 / 12.5e9)
    assert links.all_reduce_s(s, range(16)) == pytest.approx(two_nodes)  # intra RS + inter AR + intra AG
    assert links.all_reduce_s(s, [3]) == 0.0
    blocks = place_groups([2, 8, 4, 2])
    assert blocks == [tuple(range(12, 14)), tuple(range(0, 8)), tuple(range(8, 12)), tuple(range(14, 16))]


def test_cli_plan_max_split(capsys):
    args = ["plan", "--workload", "qwen2.5-7b", "--ranks", "256", "--balancer", "lpt", "--json"]
    assert main(args + ["--max-split", "8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["max_split"] == 8 and len(d["split_batches"]) == 84 and d["efficiency"] > 0.99
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    # the makespans include the owner's momentum, which a split does not shrink (the lead runs it)
    assert "split_batches" not in plain and d["makespan_s"] < 0.85 * plain["makespan_s"]
    assert main(["plan", "--compare", "--workload", "wall-wm", "--ranks", "256", "--max-split", "8",
                 "--time-limit", "2", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["milp_makespan_s"] <= row["lpt_makespan_s"] * (1 + 1e-9) and row["milp_split_batches"] > 0
    assert row["split_speedup"] > 1.05 and row["milp_nosplit_makespan_s"] > row["milp_makespan_s"]
    assert main(args + ["--max-split", "8", "--links", "simulator"]) == 0
    assert json.loads(capsys.readouterr().out)["split_batches"]
    assert main(args + ["--max-split", "8", "--links", "nccl"]) == 2
    assert "unknown links 'nccl'; accepted: dmuon, simulator" in capsys.readouterr().err
    assert main(["plan", "--workload", "pi0", "--ranks", "16", "--max-split", "4"]) == 0
    assert "note: splits:" in capsys.readouterr().out
