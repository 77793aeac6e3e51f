"""`harness bench step --model config.json`: a Hugging Face causal LM (built by transformers from a local
config.json, shrunk by --layers / --hidden / --vocab) timed for adamw / naive / dmuon on 2 gloo ranks; the
shrink rules of harness.hf_model; bad input is one line, exit 2, before any process starts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

from harness.cli import main  # noqa: E402
from harness.hf_model import shrink, shrunk_config  # noqa: E402

# a tiny Llama as a config.json would give it; the run shrinks it to 2 layers, hidden 32, vocab 96
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, vocab_size=512,
             max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=300, torch_dtype="bfloat16")
SHRUNK = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=96, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture
def llama_json(tmp_path):
    path = tmp_path / "tiny-llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA))
    return path


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_bench_step_times_a_hf_model_for_every_strategy(llama_json, tmp_path):
    csv_path = tmp_path / "rows.csv"
    cmd = [sys.executable, "-m", "harness.cli", "bench", "step", "--model", str(llama_json), "--layers", "2",
           "--hidden", "32", "--vocab", "96", "--ranks", "2", "--strategy", "adamw,naive,dmuon",
           "--seq-len", "16", "--micro-batch", "1", "--steps", "2", "--warmup", "1", "--rounds", "1",
           "--device", "cpu", "--json", "--csv", str(csv_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)["rows"]
    assert [(r["strategy"], r["ranks"]) for r in rows] == [("adamw", 2), ("naive", 2), ("dmuon", 2)]
    # the parameter count is the transformers model's, built independently from the expected config
    expected = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SHRUNK))
    n = sum(p.numel() for p in expected.parameters())
    for r in rows:
        assert r["n_params"] == n
        assert (r["workload"], r["model_type"], r["model_config"]) == ("tiny-llama", "llama", str(llama_json))
        assert (r["hidden"], r["vocab"], r["layers"], r["width_scale"]) == (32, 96, 2, 0.5)
        for key in ("step_s", "forward_s", "backward_s", "optimizer_s"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["step_s"] >= r["forward_s"] + r["backward_s"]
        assert math.isfinite(r["final_loss"]) and 0 < r["final_loss"] < 2 * math.log(96)
    adamw, naive, dmuon = rows
    assert adamw["n_muon_params"] == 0 < naive["n_muon_params"] == dmuon["n_muon_params"] < n
    assert dmuon["opt_state_bytes"] < naive["opt_state_bytes"]  # DMuon splits the state over the ranks
    assert csv_path.read_text().count("\n") == 4  # header + 3 rows


@pytest.mark.parametrize("args,text", [
    (["--model", "/nonexistent/config.json"], "model config '/nonexistent/config.json' does not exist"),
    (["--model", "nothing-here"], "--model 'nothing-here' is not a config.json"),
    (["--layers", "0"], "--layers must be a positive integer, got 0"),
    (["--hidden", "20"], "--hidden=20 does not divide into the 4 attention heads (kept)"),
    (["--hidden", "0"], "--hidden must be a positive integer, got 0"),
    (["--vocab", "-1"], "--vocab must be a positive integer, got -1"),
    (["--workload", "qwen2.5-7b"], "--model replaces the bench model"),
    (["--speed-probe"], "--speed-probe prices the bench model's workload"),
])
def test_bad_model_input_exits_2_before_any_rank(args, text, llama_json, capsys):
    full = ["bench", "step", *(["--model", str(llama_json)] if "--model" not in args else []), *args]
    assert main(full) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1, err


def test_unknown_model_type_and_options_without_model(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(dict(LLAMA, model_type="llamaxx")))
    assert main(["bench", "step", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown model_type 'llamaxx'" in err and err.count("\n") == 1, err
    assert main(["bench", "step", "--hidden", "64"]) == 2
    assert "--hidden is for a Hugging Face model" in capsys.readouterr().err


def test_missing_transformers_is_named(llama_json, monkeypatch):
    from dmuon.errors import InputError

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(InputError, match="pip install transformers"):
        shrunk_config(llama_json)


def test_shrink_keeps_configs_valid():
    # explicit head_dim (Qwen3-MoE) scales with the hidden size; head and expert counts stay
    qwen = dict(model_type="qwen3_moe", hidden_size=2048, head_dim=128, num_attention_heads=32,
                num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                num_hidden_layers=48, mlp_only_layers=[0, 40], max_window_layers=48, vocab_size=151936,
                eos_token_id=151645)
    out = shrink(qwen, layers=2, hidden=256, vocab=1000)
    assert (out["head_dim"], out["intermediate_size"], out["moe_intermediate_size"]) == (16, 768, 96)
    assert (out["num_attention_heads"], out["num_experts"], out["num_hidden_layers"]) == (32, 128, 2)
    assert (out["mlp_only_layers"], out["max_window_layers"], out["eos_token_id"]) == ([0], 2, None)
    assert out["use_cache"] is False and qwen["num_hidden_layers"] == 48  # a copy
    # DeepSeek: one MoE layer remains, the MTP count follows, MLA dims scale to even numbers
    ds = dict(model_type="deepseek_v3", hidden_size=7168, num_attention_heads=128, first_k_dense_replace=3,
              num_nextn_predict_layers=1, num_hidden_layers=61, qk_rope_head_dim=64, qk_nope_head_dim=128,
              v_head_dim=128, kv_lora_rank=512, q_lora_rank=1536, moe_intermediate_size=2048)
    out = shrink(ds, layers=2, hidden=256)
    assert (out["first_k_dense_replace"], out["num_nextn_predict_layers"]) == (1, 1)
    dims = [out[k] for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")]
    assert all(d % 2 == 0 and d >= 2 for d in dims), dims
    assert out["moe_intermediate_size"] % 8 == 0
