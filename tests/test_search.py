"""`harness search`: the enumeration's rules, search == brute force for adamw, naive and DMuon (pruning is
sound: every bound <= its simulated step), resume, the fit filter, the command's table."""

import json

import pandas as pd
import pytest

from dmuon.errors import InputError
from harness.cmd_search import pareto_front
from harness.search import Bounds, run_search
from harness.search_space import ModelDims, Space, enumerate_layouts, model_dims, sim_fields

TINY = {  # a 4-layer llama: every layout simulates in milliseconds
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4,
    "vocab_size": 1024, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def tiny_space(model: str, **kw) -> Space:
    base = dict(gpus=16, global_batch=32, seq_len=256, per_node=8, dims=model_dims(model),
                fixed={"model": model, "gpu": "h100"}, layouts=("fsdp-keep", "ddp", "hsdp-keep"),
                tp=(1, 2), pp=(1, 2), vpp=(1,), micro_batch=(1, 2), recompute=("none", "full"))
    base.update(kw)
    return Space(**base)


STRATEGIES = ("adamw", "naive", "dmuon")


def reasons(dropped) -> set[str]:
    return {why for _, why in dropped}


def test_rules_name_the_reason(tiny_model):
    dims = ModelDims("m", layers=6, heads=12, kv_heads=4, mlp_widths=(96,), experts=0)
    space = Space(gpus=96, global_batch=96, seq_len=64, per_node=8, dims=dims, fixed={"workload": "x"},
                  tp=(1, 3, 4, 8), pp=(1, 4), vpp=(1, 2), ep=(1, 2), micro_batch=(1, 64),
                  layouts=("fsdp-keep", "hsdp-keep", "sharded"), strategies=("adamw", "dmuon"),
                  recompute=("none",), have=sim_fields())
    from harness import search_space as ss

    dropped = []
    ax = ss.axis_values(space)
    for tp in ax["tp"]:
        why = ss._tp_rule(tp, tp > 1, space)
        if why:
            dropped.append(({"tp": tp}, why))
    got = reasons(dropped)
    assert "tp=3 does not divide the 8 GPUs per node: TP stays inside a node (NVLink)" in got
    assert "tp=8 does not divide the 12 attention heads" in got
    assert ss._tp_rule(4, True, space) is None
    assert ss._tp_rule(1, True, space) == "sp needs tp > 1"
    assert ss._pp_rule(4, 1, 96, space) == "pp x vpp = 4 does not divide the 6 decoder layers"
    assert ss._pp_rule(1, 2, 96, space) == "vpp=2 needs pp > 1"
    assert ss._dp_rule(48, 64, 1, 1, space)[1] == \
        "dp x micro_batch = 48 x 64 does not divide the global batch 96"
    assert ss._dp_rule(12, 2, 8, 1, space)[1] == "4 micro-batches < pp=8: a stage would idle the whole step"
    assert ss._dp_rule(4, 2, 8, 2, space)[1] == "12 micro-batches not a multiple of pp=8 (interleaved schedule)"
    assert ss._dp_rule(4, 2, 4, 2, space) == (12, None)
    assert ss._ep_rule(2, 48, 1, space) == "ep=2: m has no routed experts"
    assert ss._layout_rule("hsdp-keep", "adamw", 4, 2, space) == "hsdp-keep: dp=4 fits one node, where hsdp is fsdp"
    assert ss._layout_rule("sharded", "adamw", 48, 1, space) == \
        "sharded with adamw runs as fsdp-keep (the same layout twice)"
    # a simulator without tp / microbatches: asking for them is one clear error; defaults leave them out
    old = frozenset(sim_fields() - {"tp", "sp", "pp", "vpp", "microbatches", "recompute"})
    with pytest.raises(InputError, match="tp=2: this simulator has no tp"):
        enumerate_layouts(tiny_space(tiny_model, have=old, pp=None, recompute=None, vpp=None))
    kept, dropped = enumerate_layouts(tiny_space(tiny_model, have=old, tp=None, pp=None, recompute=None,
                                                 vpp=None))
    assert {(r["gpus"], r["micro_batch"], "tp" in r) for r in kept} == {(16, 2, False)}
    assert any("gradient accumulation" in why for why in reasons(dropped))


def test_every_kept_layout_is_valid_and_distinct(tiny_model):
    kept, dropped = enumerate_layouts(tiny_space(tiny_model))
    assert kept and dropped
    for r in kept:
        assert r["tp"] * r["pp"] * r["dp"] == 16
        assert r["dp"] * r["micro_batch"] * r["microbatches"] == 32
        assert not (r["layout"].startswith("hsdp") and r["dp"] * r["tp"] <= 8)
    keys = [json.dumps(r, sort_keys=True) for r in kept]
    assert len(set(keys)) == len(keys)


def test_search_equals_brute_force_and_resumes(tiny_model, tmp_path):
    space = tiny_space(tiny_model, gpus=8, global_batch=16, strategies=STRATEGIES, layouts=("fsdp-keep", "ddp"))
    found = run_search(space, tmp_path, top=1, front=True)
    csv = (tmp_path / "results.csv").read_bytes()
    assert found.pruned > 0  # the bound does prune this space
    again = run_search(space, tmp_path, top=1, front=True)  # resume: nothing simulated again, the same bytes
    assert again.simulated == 0 and again.reused == found.simulated
    assert (tmp_path / "results.csv").read_bytes() == csv
    brute = run_search(space, tmp_path, top=10**6)  # every layout (the searched ones reused)
    assert brute.pruned == 0 and brute.bound_violations == 0 and brute.reused == found.simulated
    assert brute.simulated + brute.reused == found.simulated + found.pruned
    assert all(r["step_s"] >= r["bound_s"] for r in brute.rows)  # the bound is a lower bound
    for s in STRATEGIES:
        want = [r for r in brute.rows if r["strategy"] == s][0]
        got = [r for r in found.rows if r["strategy"] == s][0]
        assert (got["run_id"], got["step_s"]) == (want["run_id"], want["step_s"]), s
        front = [r["run_id"] for r in pareto_front([r for r in found.rows if r["strategy"] == s])]
        assert front == [r["run_id"] for r in pareto_front([r for r in brute.rows if r["strategy"] == s])]
    assert found.memory_modelled and all(r["mem_gib"] > 0 for r in found.rows)
    layouts = pd.read_csv(tmp_path / "layouts.csv")
    assert (layouts["status"] == "simulated").sum() == len(brute.rows)
    quick = run_search(space, tmp_path / "quick", top=1)  # the table only (default): prunes at least as much
    assert quick.pruned >= found.pruned
    assert [quick.best(s)["run_id"] for s in STRATEGIES] == [brute.best(s)["run_id"] for s in STRATEGIES]


def test_dmuon_bound_is_sound_on_every_layout_kind(tiny_model, tmp_path):
    """DMuon's lower bound (compute of the busiest stage; its owners' NS and the exchanges only add) never
    exceeds its simulated step on 16 GPUs: fsdp / hsdp / sharded / ddp, tp, pp with interleaving,
    recompute; and the search's best DMuon layout is brute force's."""
    space = tiny_space(tiny_model, strategies=("dmuon",), layouts=("fsdp-keep", "hsdp-keep", "sharded", "ddp"),
                       pp=(1, 2, 4), vpp=(1, 2), micro_batch=(1, 2))
    brute = run_search(space, tmp_path, top=10**6)
    assert len(brute.rows) > 50 and {r["layout"] for r in brute.rows} >= {"fsdp-keep", "hsdp-keep", "sharded", "ddp"}
    assert {r["pp"] for r in brute.rows} == {1, 2, 4} and any(r["vpp"] == 2 for r in brute.rows)
    assert brute.bound_violations == 0 and all(r["step_s"] >= r["bound_s"] > 0 for r in brute.rows)
    found = run_search(space, tmp_path / "search", top=1)
    assert found.pruned > 0 and found.best("dmuon")["run_id"] == brute.best("dmuon")["run_id"]


def test_fit_filter_drops_what_does_not_fit(tiny_model, tmp_path):
    space = tiny_space(tiny_model, gpus=8, global_batch=16, strategies=("adamw",), recompute=("none",),
                       layouts=("ddp",), pp=(1,), micro_batch=(2,))
    mem = {1: 90.0, 2: 50.0}  # GiB per GPU by tp (an assumed memory model: only the filter is tested)
    s = run_search(space, tmp_path, top=1, memory=lambda r: mem[r["tp"]], capacity=lambda r: 80.0)
    assert s.unfit > 0 and all(r["tp"] == 2 and r["mem_gib"] == 50.0 for r in s.rows)
    layouts = pd.read_csv(tmp_path / "layouts.csv")
    nofit = layouts[layouts["status"] == "no-fit"]
    assert set(nofit["tp"]) == {1} and set(nofit["reason"]) == {"needs 90.0 GiB > 80 GiB per GPU"}


def test_bound_includes_pipeline_fill_and_naive_ns(tiny_model):
    kept, _ = enumerate_layouts(tiny_space(tiny_model))
    b = Bounds()
    one = next(r for r in kept if r["pp"] == 1 and r["tp"] == 1 and r["strategy"] == "adamw"
               and r["recompute"] == "none" and r["micro_batch"] == 1)
    two = next(r for r in kept if r["pp"] == 2 and r["tp"] == 1 and r["strategy"] == "adamw"
               and r["recompute"] == "none" and r["micro_batch"] == 1)
    naive = {**one, "strategy": "naive"}
    assert b(two) > b(one) / 2  # half the layers per stage, plus the fill and drain of one stage
    assert b(naive) > b(one)


def test_command_prints_the_side_by_side_table(tiny_model, tmp_path, capsys):
    from harness.cli import main

    code = main(["search", "--model", tiny_model, "--gpus", "8", "--gpu", "h100", "--global-batch", "16",
                 "--seq-len", "256", "--tp", "1,2", "--pp", "1", "--micro-batch", "2",
                 "--recompute", "none", "--layout", "ddp", "--strategy", "adamw,naive", "--top", "2",
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "best per strategy:" in out and "naive" in out and "vs adamw" in out
    assert (tmp_path / "pareto.png").is_file() and (tmp_path / "results.csv").is_file()
    assert main(["search", "--model", tiny_model, "--gpus", "16", "--tp", "x"]) == 2
