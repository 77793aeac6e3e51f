"""Validation at thousands of GPUs (issue 29 item 4): experiments/reference/megatron_public.csv vs the
simulator's own TP x PP x DP step on the a100 profile (simulator.validate_megatron), and the profile
entries that make that step price Megatron-LM's software (simulator.compute)."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest

from dmuon.errors import InputError
from simulator import validate_megatron as vm
from simulator.compute import activation_memory_s, layer_flops, layer_times
from simulator.hardware import load_profile
from simulator.hf_config import load_model

# Table 1 whole, and one row of every other table (`harness validate` runs them all)
CHECKED = ("n21_t2_174.6b_1536", "k22_22b_sel", "k22_175b_full", "mtnlg_420n", "bloom_176b")


@pytest.fixture(scope="module")
def rows():
    t1 = tuple(r["id"] for r in vm.public_rows() if r["table"] == "narayanan21_table1")
    return vm.megatron_rows(ids=t1 + CHECKED)


def test_csv_parses_with_a_source_on_every_row():
    raw = vm.public_rows()
    assert len(raw) >= 20 and len({r["id"] for r in raw}) == len(raw)
    for r in raw:
        assert r["source"].strip() and r["role"] == "held_out", r["id"]
        run = vm.run_of(r)  # settings check: tp x pp divides the GPUs, dp x micro-batch the batch
        assert run.dp * run.tp * run.pp == run.gpus and run.microbatches >= 1
    t1 = [r for r in raw if r["table"] == "narayanan21_table1"]
    assert [int(r["gpus"]) for r in t1] == [32, 64, 128, 256, 512, 1024, 1536, 1920, 2520, 3072]
    # the paper's aggregate PFLOP/s (4.4 ... 502.0) = per-GPU TFLOP/s x GPUs: the transcription is consistent
    agg = [4.4, 8.8, 18.2, 34.6, 70.8, 143.8, 227.1, 297.4, 410.2, 502.0]
    for r, a in zip(t1, agg, strict=True):
        assert float(r["value"]) * int(r["gpus"]) / 1e3 == pytest.approx(a, rel=0.01), r["id"]


def test_a100_layer_is_whole_attention_plus_korthikanti_bytes_and_other_profiles_keep_theirs():
    r = vm.run_of(vm.public_rows()[0])  # GPT 1.7B, tp 1
    b, s, l, h, v, a = r.global_batch, r.seq_len, r.layers, r.hidden, r.vocab, r.heads
    # eq. 3 term by term: 4 passes (fwd, recompute, 2 x bwd) of 24 B s h^2 + 4 B s^2 h per layer,
    # 3 of the head
    by_terms = 4 * l * (24 * b * s * h * h + 4 * b * s * s * h) + 3 * 2 * b * s * h * v
    assert vm.model_flops(r) == pytest.approx(by_terms, rel=1e-12)
    w = load_model(vm._config_json(h, l, a, v, s))
    a100, a800 = load_profile("a100"), load_profile("a800")
    assert (a800.attention_causal_fraction, a800.activation_rw_passes) == (0.5, 0.0)  # as fitted, unchanged
    assert (a100.fwd_layer_overhead_s, a100.bwd_layer_overhead_s) == (0.0, 0.0)
    layer = layer_flops(w, s, 1, a100.attention_causal_fraction)[1]
    assert layer.attention_flops == pytest.approx(4 * s * s * h)  # the whole s x s matrix (Megatron 2021-22)
    assert layer.matmul_flops == pytest.approx(2 * 12 * h * h * s, rel=1e-3)
    act = s * h * 34 + 5 * a * s * s  # Korthikanti Sec. 4.1 at t = 1, bytes of one layer's activations
    f, bw = layer_times(w, a100, s, 1, 8, heads=a, hidden=h)[1]
    assert f == pytest.approx(layer.fwd_flops / a100.fwd_flops + 2 * act / a100.hbm_Bps, rel=1e-12)
    assert bw == pytest.approx(layer.bwd_flops / a100.bwd_flops + 4 * act / a100.hbm_Bps, rel=1e-12)
    # a800: causal half, the fitted per-layer overhead, no memory term: the formula the fits were made with
    lf = layer_flops(w, s, 1)[1]
    f8, b8 = layer_times(w, a800, s, 1, 8)[1]
    assert f8 == lf.fwd_flops / a800.fwd_flops + a800.fwd_layer_overhead_s
    assert lf.attention_flops == 2 * s * s * h
    assert b8 == lf.bwd_flops / a800.bwd_flops + a800.bwd_layer_overhead_s
    # tensor and sequence parallelism split the bytes as Korthikanti counts them
    f8t, _, sc = activation_memory_s(a100, s, 1, h, a, tp=8, sp=False)
    f8s, _, _ = activation_memory_s(a100, s, 1, h, a, tp=8, sp=True)
    assert f8t * a100.hbm_Bps / 2 == pytest.approx(s * h * (10 + 24 / 8) + 5 * a * s * s / 8)
    assert f8s * a100.hbm_Bps / 2 == pytest.approx(s * h * 34 / 8 + 5 * a * s * s / 8)
    assert sc * a100.hbm_Bps / 2 == pytest.approx(5 * a * s * s / 8)


def test_the_memory_term_enters_the_simulated_step_once_per_layer_pass():
    """1.7B: tp = pp = 1, 16 micro-batches, full recompute: the a100 step minus the same step without the
    memory-bound passes = micro-batches x layers x (forward + recompute + backward) memory seconds."""
    from simulator.api import SimConfig, simulate

    row = vm.public_rows()[0]
    r = vm.run_of(row)
    a100 = load_profile("a100")
    cfg = SimConfig(model=vm._config_json(r.hidden, r.layers, r.heads, r.vocab, r.seq_len), gpus=r.gpus,
                    gpu=a100, strategy="adamw", layout="ddp", microbatches=r.microbatches, recompute="full",
                    seq_len=r.seq_len, micro_batch=r.micro_batch)
    with_mem = simulate(cfg).step_s
    without = simulate(replace(cfg, gpu=replace(a100, activation_rw_passes=0.0))).step_s
    mf, mb, _ = activation_memory_s(a100, r.seq_len, 1, r.hidden, r.heads)
    assert with_mem - without == pytest.approx(r.microbatches * r.layers * (2 * mf + mb), rel=1e-9)
    with pytest.raises(InputError, match="prices memory-bound passes from the attention heads; accepted: a "
                                         "config.json model"):
        simulate(SimConfig(workload="llama3.2-3b", gpus=8, gpu="a100", strategy="adamw", recompute="full"))


def test_held_out_rows_within_their_bounds(rows):
    bad = [(r["id"], f"{r['error']:+.1%}") for r in rows if not r["within_bound"]]
    assert not bad
    assert all(r["bound"] == (0.15 if r["table"] == "narayanan21_table1" else 0.20) for r in rows)
    assert sum(r["table"] == "narayanan21_table1" for r in rows) == 10
    assert {r["table"] for r in rows} >= {"narayanan21_table2", "korthikanti22", "smith22_mtnlg", "bloom22"}
    assert max(r["gpus"] for r in rows) >= 3000  # thousands of GPUs
    t1 = {r["id"]: r for r in rows}
    assert t1["n21_t1_1008b"]["split"]["bubble"] > t1["n21_t1_39.1b"]["split"]["bubble"]  # pp 64 vs pp 2


def test_bad_settings_get_one_line_errors(tmp_path):
    row = dict(vm.public_rows()[6], tp="7")
    with pytest.raises(InputError, match=r"tp x pp = 56 does not divide 1536 GPUs"):
        vm.run_of(row)
    row = dict(vm.public_rows()[0], recompute="some")
    with pytest.raises(InputError, match="recompute must be full or selective"):
        vm.run_of(row)
    bad = tmp_path / "m.csv"
    raw = vm.public_rows()[:1]
    for field, value, msg in (("source", " ", "every row needs a source"),
                              ("role", "calibration", r"role one of \('held_out',\)")):
        with open(bad, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(raw[0]))
            w.writeheader()
            w.writerow(dict(raw[0], **{field: value}))
        with pytest.raises(InputError, match=msg):
            vm.megatron_rows(path=bad)
    prof = tmp_path / "p.toml"
    prof.write_text((vm.Path(vm.__file__).parent / "profiles" / "a100.toml").read_text().replace(
        'attention_causal_fraction = { value = 1.0', 'attention_causal_fraction = { value = 1.5'))
    with pytest.raises(InputError, match=r"attention_causal_fraction must be in \(0, 1\] and activation_rw"):
        load_profile(prof)
