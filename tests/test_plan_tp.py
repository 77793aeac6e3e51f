"""dmuon/plan/tp.py: pricing of the TP modes, the plan's choices and DP share, JSON (pure plan, no torch)."""

from __future__ import annotations

import json

import pytest

from dmuon.errors import InputError
from dmuon.plan import CostTable, MatrixSpec
from dmuon.plan.split import LINKS
from dmuon.plan.tp import build_tp_plan, megatron_shard_dim, price_tp_modes, tp_summary
from dmuon.plan.types import Plan

H100 = CostTable.load("h100")


def llama70b(layers: int = 80) -> list[MatrixSpec]:
    """Llama-3.1-70B's Muon matrices (hidden 8192, 8 KV heads of 128, MLP 28672: its config.json)."""
    shapes = {"self_attn.q_proj": (8192, 8192), "self_attn.k_proj": (1024, 8192),
              "self_attn.v_proj": (1024, 8192), "self_attn.o_proj": (8192, 8192),
              "mlp.gate_proj": (28672, 8192), "mlp.up_proj": (28672, 8192), "mlp.down_proj": (8192, 28672)}
    return [MatrixSpec(f"model.layers.{i}.{k}", r, c, layer=i) for i in range(layers)
            for k, (r, c) in shapes.items()]


def test_megatron_shard_dims():
    assert [megatron_shard_dim(f"model.layers.0.{k}") for k in (
        "self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj", "self_attn.o_proj", "mlp.down_proj",
        "attention.wq", "feed_forward.w2", "input_layernorm")] == [0, 0, 0, 1, 1, 0, 1, None]


def test_bytes_formulas():
    """group: A=2 fp32 ring all-reduces of the n x n upper triangle; gather: (tp-1)/tp of the matrix there
    and back; duplicated: every rank receives (tp-1)/tp of it."""
    p = price_tp_modes(28672, 8192, 0, 8, H100, method="gram_sym", wire_bytes=2)
    n = 8192
    assert p.group_ok and p.tall
    assert p.group_bytes == pytest.approx(2 * 2 * 7 * n * (n + 1) / 2 * 4)
    assert p.gather_bytes == pytest.approx(2 * 7 / 8 * 28672 * 8192 * 2)
    assert p.duplicated_bytes == pytest.approx(7 * 28672 * 8192 * 2)
    # a shard along the short side (k_proj column-parallel) cannot run group NS
    k = price_tp_modes(1024, 8192, 0, 8, H100)
    assert not k.group_ok and k.group_s == float("inf") and k.best(8) == "gather"


def test_group_crossover_at_m_over_tp_n_plus_1():
    """Bytes: group < gather iff m > tp (n + 1) with an fp32 gather (2 tp (n + 1) with bf16)."""
    n, tp = 1024, 8
    for wire, factor in ((4, 1), (2, 2)):
        edge = factor * tp * (n + 1)
        below = price_tp_modes(n, edge - 8, 1, tp, H100, wire_bytes=wire)
        above = price_tp_modes(n, edge + 8, 1, tp, H100, wire_bytes=wire)
        assert below.group_bytes > below.gather_bytes and above.group_bytes < above.gather_bytes


@pytest.mark.parametrize("profile", ["h100", "a800"])
def test_group_picked_only_where_it_moves_fewer_bytes(profile):
    """The issue's invariant, on Llama-70B at tp 8 and on a sweep of shapes: wherever auto picks
    TP-group NS, it moves fewer bytes than gather-to-owner (the plan reports both)."""
    cost = CostTable.load(profile)
    mats = llama70b(4) + [MatrixSpec(f"x.{n}.{m}.{s}.w", *((m, n) if s == 0 else (n, m)), layer=9)
                          for n in (256, 1024, 4096) for m in (n, 8 * n, 32 * n, 128 * n) for s in (0, 1)]
    shard = [megatron_shard_dim(m.name) if not m.name.startswith("x.") else int(m.name.split(".")[3])
             for m in mats]
    plan = build_tp_plan(mats, 64, cost, tp=8, shard_dims=shard)
    picked = [c for c in plan.tp_choices if c.mode == "group"]
    assert picked, "the sweep has matrices wide enough for group NS"
    assert all(c.group_bytes < c.gather_bytes for c in picked)
    s = tp_summary(plan)
    assert s["group"]["count"] + s["gather"]["count"] == len(mats)


def test_llama70b_tp8_gathers_and_shares_over_dp():
    plan = build_tp_plan(llama70b(), 1024, H100, tp=8)
    s = tp_summary(plan)
    assert s["gather"]["count"] == 560 and s["group"]["count"] == 0  # m <= tp (n + 1) everywhere
    assert s["gather"]["bytes"] == pytest.approx(sum(2 * 7 / 8 * m.rows * m.cols * 2 for m in plan.matrices))
    # each matrix once, by one rank; the load is spread over all 128 TP groups
    assert len({c.dp_index for c in plan.tp_choices}) == 128
    assert plan.makespan_s == pytest.approx(max(plan.loads_s))
    assert plan.lower_bound_s <= plan.makespan_s


def test_forced_group_and_dp_share():
    mats = [MatrixSpec(f"layers.{i}.mlp.up_proj", 64, 16, layer=i) for i in range(6)]
    mats.append(MatrixSpec("layers.9.self_attn.k_proj", 8, 16, layer=9))
    plan = build_tp_plan(mats, 8, H100, tp=2, mode="group", links=LINKS["cpu"])
    modes = [c.mode for c in plan.tp_choices]
    assert modes == ["group"] * 6 + ["gather"]  # k_proj is cut along its short side
    assert any("gathered instead" in n for n in plan.notes)
    used = {c.dp_index for c in plan.tp_choices[:6]}
    assert used == {0, 1, 2, 3}  # 6 group matrices over the 4 TP groups
    for i, c in enumerate(plan.tp_choices[:6]):
        assert plan.owners[i] == c.dp_index * 2  # the TP group's lead


def test_json_roundtrip_and_old_plans():
    plan = build_tp_plan(llama70b(2), 16, H100, tp=8, mode="group")
    d = json.loads(plan.to_json())
    assert d["format_version"] == 3 and d["tp"] == 8
    assert Plan.from_json(plan.to_json()) == plan
    assert d["tp_choices"][1]["group_bytes"] is None  # k_proj: no group mode (JSON has no inf)
    old = build_tp_plan(llama70b(1), 8, H100, tp=1)
    od = json.loads(old.to_json())
    assert od["format_version"] == 1 and "tp" not in od and "tp_choices" not in od
    with pytest.raises(ValueError, match="plan format version 9 is not supported"):
        Plan.from_dict({**d, "format_version": 9})


def test_bad_input_one_line_errors():
    m = [MatrixSpec("layers.0.mlp.up_proj", 30, 16)]
    with pytest.raises(InputError, match=r"tp=4 does not divide dim 0 \(30\).*accepted: a TP degree"):
        build_tp_plan(m, 4, H100, tp=4)
    with pytest.raises(InputError, match="tp=3 does not divide the 8 ranks; accepted"):
        build_tp_plan(m, 8, H100, tp=3)
    with pytest.raises(InputError, match="unknown TP mode|TP mode"):
        build_tp_plan(m, 2, H100, tp=2, mode="blockwise")
    with pytest.raises(InputError, match="shard_dims has 2 entries for 1 matrices"):
        build_tp_plan(m, 2, H100, tp=2, shard_dims=[0, 1])


def test_least_loaded_heaps_answer_as_the_scans():
    """build_tp_plan's heaps (`_LeastLoaded`) pick what a scan over every rank / TP group picks, ties
    included (equal loads: many zero-time and repeated times)."""
    import random

    from dmuon.plan.tp import _LeastLoaded

    rng = random.Random(3)
    for world, tp in ((48, 4), (16, 1), (64, 8)):
        loads, group_load = [0.0] * world, [0.0] * (world // tp)
        pick = _LeastLoaded(loads, group_load, tp)
        for _ in range(300):
            t = rng.choice((0.0, 1.0, 2.5, rng.random()))
            if tp > 1 and rng.random() < 0.4:
                d = min(range(world // tp), key=lambda d: (max(loads[d * tp:(d + 1) * tp]), d))
                assert pick.group() == d
                for r in range(d * tp, (d + 1) * tp):
                    loads[r] += t
                group_load[d] += tp * t
            else:
                d = min(range(world), key=lambda r: (loads[r], group_load[r // tp], r))
                assert pick.rank() == d
                loads[d] += t
                group_load[d // tp] += t
                d //= tp
            pick.changed(d)
