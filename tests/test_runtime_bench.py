"""`harness bench step`: a real 2-rank run of a tiny model returns the documented keys; bad input exits 2
before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.cli import main

KEYS = {"ranks", "strategy", "overlap", "step_s", "forward_s", "backward_s", "optimizer_s", "exposed_comm_s",
        "optimizer_cpu_s", "peak_mem_bytes", "comm_bytes_per_step", "opt_state_bytes", "workload",
        "width_scale", "layers", "seq_len", "micro_batch", "n_params", "n_muon_params"}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_bench_step_json_on_two_ranks(tmp_path):
    csv_path = tmp_path / "rows.csv"
    cmd = [sys.executable, "-m", "harness.cli", "bench", "step", "--ranks", "2", "--strategy", "dmuon,naive",
           "--width-scale", "1/32", "--layers", "1", "--seq-len", "16", "--micro-batch", "1", "--steps", "2",
           "--warmup", "1", "--rounds", "1", "--device", "cpu", "--json", "--csv", str(csv_path),
           "--speed-probe"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    rows = out["rows"]
    assert [(r["strategy"], r["ranks"]) for r in rows] == [("dmuon", 2), ("naive", 2)]
    for r in rows:
        assert KEYS <= r.keys(), KEYS - r.keys()
        assert r["step_s"] > 0 and r["optimizer_s"] > 0 and r["forward_s"] > 0 and r["backward_s"] > 0
        assert r["step_s"] >= r["forward_s"] + r["backward_s"]
        assert r["comm_bytes_per_step"] > 0 and r["peak_mem_bytes"] > 0
        assert 0 < r["probe_s"] < r["step_s"] * 10  # the model's forward + backward before the block
        assert 0 < r["probe_ns_s"] < r["optimizer_s"] * 10  # one NS call the optimizer makes
        assert 0 < r["probe_ew_s"] < 1.0  # one AdamW pass over 4M elements
    dmuon, naive = rows
    assert dmuon["opt_state_bytes"] < naive["opt_state_bytes"]  # momentum and AdamW state split over 2 ranks
    assert "naive_over_dmuon_optimizer_s_overlap_on" in out["ratios"]
    assert csv_path.read_text().count("\n") == 3  # header + 2 rows


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_bench_step_ns_settings_side_by_side():
    cmd = [sys.executable, "-m", "harness.cli", "bench", "step", "--ranks", "2", "--strategy", "dmuon,naive",
           "--width-scale", "1/32", "--layers", "1", "--seq-len", "16", "--micro-batch", "1", "--steps", "2",
           "--warmup", "1", "--rounds", "1", "--device", "cpu", "--json", "--ns-method", "standard",
           "--ns-dtype", "fp32,bf16", "--comm-dtype", "bf16", "--layout", "fsdp2-sharded"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    rows = out["rows"]
    assert [(r["strategy"], r["ns_method"], r["ns_dtype"], r["comm_dtype"]) for r in rows] == [
        ("dmuon", "standard", "fp32", "bf16"), ("dmuon", "standard", "bf16", "bf16"),
        ("naive", "standard", "fp32", "bf16"), ("naive", "standard", "bf16", "bf16")]
    for r in rows:
        assert r["optimizer_ns_s"] > 0 and r["ns_calls"] >= 1
        assert 0 < r["optimizer_ns_cpu_s"] <= r["optimizer_cpu_s"]  # CPU inside NS calls, inside step()
        assert 0 <= r["optimizer_wait_s"] <= r["optimizer_s"]
        assert r["optimizer_over_ns_comm"] >= 1.0  # NS and waits happen inside step()
    for key in ("ns_fp32_over_bf16_ns_s_dmuon_standard", "ns_fp32_over_bf16_optimizer_s_naive_standard",
                "ns_fp32_over_bf16_ns_cpu_s_dmuon_standard",
                "naive_over_dmuon_optimizer_s_overlap_on_ns_standard_bf16",
                "dmuon_optimizer_over_ns_comm_overlap_on_ns_standard_fp32"):
        assert out["ratios"][key] > 0, key


@pytest.mark.parametrize("args,text", [
    (["--ranks", "0"], "ranks must be an integer >= 1"),
    (["--strategy", "sgd"], "unknown strategy 'sgd'"),
    (["--workload", "gpt5"], "unknown workload 'gpt5'"),
    (["--workload", "pi0"], "decoder-only"),
    (["--width-scale", "x"], "--width-scale 'x' is not a number"),
    (["--balancer", "greedy"], "unknown balancer"),
    (["--ranks", "4", "--node-size", "3"], "does not divide"),
    (["--ns-method", "newton"], "'newton'; accepted: auto, standard, gram"),
    (["--ns-dtype", "fp8"], "'fp8'; accepted: default, bf16, fp16, fp32"),
    (["--comm-dtype", "int8"], "'int8'; accepted: bf16, fp16, fp32"),
])
def test_bench_step_bad_input_exits_2(args, text, capsys):
    assert main(["bench", "step", *args]) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1, err
