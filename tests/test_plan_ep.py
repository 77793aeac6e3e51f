"""Plans with expert parallelism (dmuon.plan.ep): expert matrices owned inside their EP rank's replica
group, every matrix in one batch, dense ones planned around the experts' loads, clear errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dmuon.errors import InputError
from dmuon.plan.build import build_plan
from dmuon.plan.cost import CostTable
from dmuon.plan.ep import EPLayout, build_ep_plan, expert_index, expert_placement
from dmuon.plan.types import MatrixSpec, Plan

A800 = CostTable.load("a800")


def tiny_moe(layers: int = 3, experts: int = 8, hidden: int = 1024, inter: int = 512) -> list[MatrixSpec]:
    mats = []
    for layer in range(layers):
        p = f"model.layers.{layer}"
        for proj, shape in (("q_proj", (hidden, hidden)), ("k_proj", (256, hidden)),
                            ("o_proj", (hidden, hidden))):
            mats.append(MatrixSpec(f"{p}.self_attn.{proj}", *shape, layer))
        for e in range(experts):
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                mats.append(MatrixSpec(f"{p}.mlp.experts.{e}.{proj}", *shape, layer))
        mats.append(MatrixSpec(f"{p}.mlp.shared_experts.gate_proj", inter, hidden, layer))  # dense
    return mats


def test_expert_names():
    assert expert_index("model.layers.3.mlp.experts.17.gate_proj") == 17
    assert expert_index("model.layers.0.block_sparse_moe.experts.2.w1") == 2
    assert expert_index("model.layers.0.mlp.shared_experts.gate_proj") is None
    assert expert_index("model.layers.0.mlp.shared_expert.up_proj") is None
    assert expert_index("lm.0.q_proj") is None
    # the string-method reading agrees with EXPERT_RE's leftmost match, odd names included
    from dmuon.plan.ep import EXPERT_RE

    odd = ["experts.1.", "xexperts.3.experts.4.", "a.experts.1x.experts.2.", "experts.5", "a.experts..b",
           "a.experts.\u0663\u0664.w", "experts.-1.", "experts. 1.", "experts.1\n.", "sexperts.7.w",
           "a.experts.12.experts.3.w", "experts.x.experts.9."]
    for name in odd:
        m = EXPERT_RE.search(name)
        assert expert_index(name) == (int(m.group(1)) if m else None), name


@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("balancer", ["round_robin", "lpt", "milp"])
def test_experts_are_owned_in_their_replica_group(ep, balancer):
    mats = tiny_moe()
    n = 8
    plan = build_ep_plan(mats, n, A800, ep=ep, balancer=balancer, time_limit_s=5.0)
    layout = EPLayout(n, ep)
    where = expert_placement(mats, ep)
    for i, (m, w) in enumerate(zip(mats, where, strict=True)):
        if w is not None:
            assert plan.owners[i] in layout.replica_group(w), m.name
            e = expert_index(m.name)
            assert w == e // (8 // ep)  # contiguous blocks of experts per EP rank
    assert sorted(i for b in plan.batches for i in b.members) == list(range(len(mats)))
    for b in plan.batches:
        assert all(plan.owners[i] == b.owner for i in b.members)
        assert len({(min(mats[i].shape), max(mats[i].shape)) for i in b.members}) == 1
    assert max(plan.loads_s) == pytest.approx(plan.makespan_s, rel=1e-12)
    assert plan.makespan_s >= plan.lower_bound_s * (1 - 1e-12)
    assert plan.ep == ep
    again = Plan.from_json(plan.to_json())
    assert again == plan and json.loads(plan.to_json())["ep"] == ep


def test_ep_equal_to_ranks_owns_each_expert_on_its_only_holder():
    mats = tiny_moe()
    plan = build_ep_plan(mats, 8, A800, ep=8)
    for i, w in enumerate(expert_placement(mats, 8)):
        if w is not None:
            assert plan.owners[i] == w  # one replica: the EP rank itself


def test_dense_matrices_fill_around_the_experts():
    """LPT is no worse than round-robin, and where large dense matrices dominate, balancing them first and
    the experts around them beats the experts-first order (which is also tried: the better plan wins)."""
    from dmuon.plan.balance import build_work_model
    from dmuon.plan.ep import _experts_first, _loads

    mats = tiny_moe(layers=4, experts=16)
    lpt = build_ep_plan(mats, 16, A800, ep=4, balancer="lpt")
    rr = build_ep_plan(mats, 16, A800, ep=4, balancer="round_robin")
    assert lpt.makespan_s <= rr.makespan_s * (1 + 1e-12)
    big = [MatrixSpec("model.layers.0.mlp.down_proj", 4096, 4096, 0)] + tiny_moe(layers=2, experts=8)
    plan = build_ep_plan(big, 4, A800, ep=2, balancer="lpt")
    where = expert_placement(big, 2)
    local = [[i for i, w in enumerate(where) if w == k] for k in range(2)]
    dense = [i for i, w in enumerate(where) if w is None]
    dmodel = build_work_model([big[i] for i in dense], 4, A800)
    mkw = dict(method="gram_sym", dtype="bf16", batching=True, max_batch=8)
    first = _experts_first(big, local, dense, dmodel, EPLayout(4, 2), A800, "lpt", {}, mkw)
    assert plan.makespan_s < max(_loads(first[1], 4)) * (1 - 1e-6)
    assert any("dense matrices balanced first" in n for n in plan.notes)


def test_ep_one_is_build_plan_and_old_json_is_unchanged():
    mats = tiny_moe()
    a, b = build_ep_plan(mats, 4, A800, ep=1), build_plan(mats, 4, A800)
    assert a.owners == b.owners and a.batches == b.batches
    assert "ep" not in json.loads(b.to_json())


@pytest.mark.parametrize("kw,msg", [
    (dict(ep=3), "ep=3 does not divide the 8 ranks"),
    (dict(ep=0), "ep must be a positive integer"),
    (dict(ep=2, max_split=2), "max_split is not supported with expert parallelism"),
])
def test_bad_ep_input(kw, msg):
    with pytest.raises(InputError, match=msg):
        build_ep_plan(tiny_moe(), 8, A800, **kw)


def test_ep_must_divide_the_experts_and_needs_experts():
    with pytest.raises(InputError, match="ep=4 does not divide the 6 experts of layer 0"):
        build_ep_plan(tiny_moe(experts=6), 8, A800, ep=4)
    dense = [m for m in tiny_moe() if expert_index(m.name) is None]
    with pytest.raises(InputError, match="no expert matrices"):
        build_ep_plan(dense, 8, A800, ep=2)


def test_harness_plan_ep(tmp_path):
    from harness.cli import app

    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", "--model", "qwen3-30b-a3b", "--ranks", "16", "--ep", "8",
                                   "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    plan = Plan.from_json(out.read_text())
    assert plan.ep == 8 and plan.world_size == 16
    res = CliRunner().invoke(app, ["plan", "--model", "qwen3-30b-a3b", "--ranks", "12", "--ep", "8"])
    assert isinstance(res.exception, InputError)
    assert "--ep=8 does not divide the 12 ranks" in str(res.exception)
