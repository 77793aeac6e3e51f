"""A TP x PP stage's data-parallel step is simulated once per distinct config in a process
(simulator.programs.parallel_run.dp_step): layouts that differ only in recomputation or micro-batches per
step reuse it, and every result is bit-identical to simulating it afresh."""

import json

import pytest

from simulator.api import SimConfig, simulate
from simulator.engine.symmetry import result_digest
from simulator.programs import parallel_run

TINY = {  # a 4-layer llama (as tests/test_search.py)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4,
    "vocab_size": 1024, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def cfg(model, strategy, layout, recompute, microbatches, pp=2):
    return SimConfig(model=model, gpu="h100", gpus=32, strategy=strategy, layout=layout, tp=2, pp=pp, sp=True,
                     seq_len=256, micro_batch=1, microbatches=microbatches, recompute=recompute)


@pytest.mark.parametrize("strategy,layout", [("dmuon", "hsdp-free"), ("naive", "fsdp-keep"),
                                             ("adamw", "ddp")])
def test_reused_stage_steps_give_fresh_results(tiny_model, strategy, layout):
    variants = [("none", 2), ("selective", 2), ("full", 2), ("none", 4)]
    cold = {}
    for rc, m in variants:
        parallel_run._DP_STEPS.clear()
        cold[rc, m] = result_digest(simulate(cfg(tiny_model, strategy, layout, rc, m)))
    parallel_run._DP_STEPS.clear()
    sizes = []
    for rc, m in variants:
        r = simulate(cfg(tiny_model, strategy, layout, rc, m))
        assert result_digest(r) == cold[rc, m], (rc, m)
        r.provenance["touched"] = True  # the caller's own copy: the cached result is not changed
        sizes.append(len(parallel_run._DP_STEPS))
    if strategy == "naive":  # its cost table is a new object per run: nothing reused, nothing wrong
        assert sizes[0] >= 1
    else:  # the stages' DP steps of the first variant serve the other three
        assert sizes == [sizes[0]] * 4 and sizes[0] >= 1
    assert all("touched" not in got[0].provenance for got in parallel_run._DP_STEPS.values())


def test_keys_need_values(tiny_model):
    c = cfg(tiny_model, "dmuon", "hsdp-free", "none", 2)
    assert parallel_run._dp_key(c, simulate) == parallel_run._dp_key(cfg(tiny_model, "dmuon", "hsdp-free",
                                                                         "none", 2), simulate)
    assert parallel_run._dp_key(c, simulate) != parallel_run._dp_key(cfg(tiny_model, "dmuon", "hsdp-keep",
                                                                         "none", 2), simulate)
    assert parallel_run._dp_key(SimConfig(workload=object()), simulate) is None  # an address: not cached
