"""Rank symmetry (simulator.symmetry): one rank per class gives the full simulation's results bit for bit."""

import json

import pytest

from dmuon.errors import InputError
from simulator.api import SimConfig, run, simulate
from simulator.symmetry import SWITCH, program_fingerprints, result_digest

TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "moe_intermediate_size": 128,
            "intermediate_size": 512, "num_experts": 16, "num_experts_per_tok": 4,
            "tie_word_embeddings": False}
SMALL = dict(workload="qwen2.5-1.5b", seq_len=256, micro_batch=1)
CONFIGS = [  # (label, SimConfig fields; "moe": the tiny MoE above)
    ("dmuon/fsdp-keep/16", dict(SMALL, gpus=16)),
    ("dmuon/hsdp-free/16", dict(SMALL, gpus=16, layout="hsdp-free")),
    ("dmuon/sharded/16", dict(SMALL, gpus=16, layout="sharded")),
    ("dmuon/ddp/nooverlap/16", dict(SMALL, gpus=16, layout="ddp", overlap=False)),
    ("naive/hsdp-keep/8x4", dict(SMALL, gpus=8, gpus_per_node=4, layout="hsdp-keep", strategy="naive")),
    ("adamw/fsdp-free/16/cluster", dict(SMALL, gpus=16, layout="fsdp-free", strategy="adamw",
                                        cluster="h100-ndr")),
    ("moe/dmuon/ep4/32", dict(moe=True, gpus=32, ep=4)),
    ("moe/dmuon/ep16/hsdp-free/32", dict(moe=True, gpus=32, ep=16, layout="hsdp-free")),
    ("moe/dmuon/ep8/sharded/32", dict(moe=True, gpus=32, ep=8, layout="sharded")),
    ("moe/naive/ep8/ddp/32", dict(moe=True, gpus=32, ep=8, layout="ddp", strategy="naive")),
]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinymoe")
    (d / "config.json").write_text(json.dumps(TINY_MOE))
    return str(d)


def _cfg(moe, kw):
    kw = dict(kw)
    if kw.pop("moe", False):
        kw.update(model=moe, seq_len=128, micro_batch=1)
    return SimConfig(**kw)


@pytest.mark.parametrize("label,kw", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_classes_give_the_full_simulation(moe, label, kw):
    """Bit-identical results (digest of every SimResult field), and on the full build every rank's program
    equals its representative's up to names and group instances (the signature misses nothing)."""
    cfg = _cfg(moe, kw)
    full, full_built = run(cfg, all_ranks=True)
    sym, built = run(cfg, all_ranks=False)
    assert result_digest(sym) == result_digest(full)
    rep_of = list(built.cluster.rep_of)
    fp = program_fingerprints(full_built.cluster, range(cfg.gpus))
    assert all(fp[r] == fp[rep_of[r]] for r in range(cfg.gpus))
    simulated = sum(1 for w in built.cluster.weight if w)
    assert sum(built.cluster.weight) == cfg.gpus and simulated == len(set(rep_of))
    if label.startswith(("adamw", "naive", "moe/adamw", "moe/naive")):
        assert simulated == 1  # every rank runs the same program in groups of one class
    elif label != "dmuon/hsdp-free/16":  # there the owners' nodes and local indices set every rank apart
        assert simulated < cfg.gpus


def test_classes_are_the_owner_signatures_without_groups():
    """fsdp-keep, no EP: only the world group, so the classes are the distinct lists of owned batches
    (NS time, matrices, buckets; owners of the same list are one class) and the ranks owning nothing."""
    cfg = SimConfig(**SMALL, gpus=16)
    _, built = run(cfg, all_ranks=False)
    plan = built.spec.plan
    bucket = {i: b.index for b in plan.buckets for i in b.members}
    owned: dict = {}
    for bt in plan.batches:
        owned.setdefault(bt.owner, []).append((bt.ns_s, len(bt.members), {bucket[i] for i in bt.members}))
    lists = [owned.get(r, []) for r in range(cfg.gpus)]
    distinct = [x for i, x in enumerate(lists) if x not in lists[:i]]
    assert sum(1 for w in built.cluster.weight if w) == len(distinct) < cfg.gpus
    assert all(lists[r] == lists[built.cluster.rep_of[r]] for r in range(cfg.gpus))


def test_switch_off_simulates_every_rank(monkeypatch):
    cfg = SimConfig(**SMALL, gpus=16)
    on = simulate(cfg)
    monkeypatch.setenv(SWITCH, "off")
    _, built = run(cfg, all_ranks=False)
    assert list(built.cluster.weight) == [1] * 16
    assert result_digest(simulate(cfg)) == result_digest(on)
    monkeypatch.setenv(SWITCH, "maybe")
    with pytest.raises(InputError, match="DMUON_SIM_SYMMETRY must be one of on | off, got 'maybe'"):
        simulate(cfg)


def test_undeclared_group_kind_falls_back_to_every_rank(moe, monkeypatch):
    """A collective over a group kind the classes were not refined over: every rank, and a note says so."""
    from simulator.step import _Programs

    cfg = _cfg(moe, dict(moe=True, gpus=16, ep=4))
    full, _ = run(cfg, all_ranks=True)
    monkeypatch.setattr(_Programs, "group_kinds", lambda self: ())
    res, built = run(cfg, all_ranks=False)
    assert list(built.cluster.weight) == [1] * 16
    assert res.step_s == full.step_s and res.exposed_comm_mean_s == full.exposed_comm_mean_s
    assert any("rank symmetry off: a collective over group kind 'ep'" in n for n in res.notes)
