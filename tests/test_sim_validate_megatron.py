"""Validation at thousands of GPUs (issue 29 item 4): experiments/reference/megatron_public.csv vs
simulator.validate_megatron on the a100 profile."""

from __future__ import annotations

import csv

import pytest

from dmuon.errors import InputError
from simulator import validate_megatron as vm


@pytest.fixture(scope="module")
def rows():
    return vm.megatron_rows()


def test_csv_parses_with_a_source_on_every_row():
    raw = vm.public_rows()
    assert len(raw) >= 20 and len({r["id"] for r in raw}) == len(raw)
    for r in raw:
        assert r["source"].strip(), r["id"]
        run = vm.run_of(r)  # settings check: tp x pp divides the GPUs, dp x micro-batch the batch
        assert run.dp * run.tp * run.pp == run.gpus and run.microbatches >= 1
    t1 = [r for r in raw if r["table"] == "narayanan21_table1"]
    assert [int(r["gpus"]) for r in t1] == [32, 64, 128, 256, 512, 1024, 1536, 1920, 2520, 3072]
    # the paper's aggregate PFLOP/s (4.4 ... 502.0) = per-GPU TFLOP/s x GPUs: the transcription is consistent
    agg = [4.4, 8.8, 18.2, 34.6, 70.8, 143.8, 227.1, 297.4, 410.2, 502.0]
    for r, a in zip(t1, agg, strict=True):
        assert float(r["value"]) * int(r["gpus"]) / 1e3 == pytest.approx(a, rel=0.01), r["id"]


def test_model_flops_is_narayanan_eq3_and_the_simulator_charges_the_tied_head():
    r = vm.run_of(vm.public_rows()[0])  # GPT 1.7B
    b, s, l, h, v = r.global_batch, r.seq_len, r.layers, r.hidden, r.vocab
    # eq. 3 term by term: 4 passes (fwd, recompute, 2 x bwd) of 24 B s h^2 + 4 B s^2 h per layer, 3 of the head
    by_terms = 4 * l * (24 * b * s * h * h + 4 * b * s * s * h) + 3 * 2 * b * s * h * v
    assert vm.model_flops(r) == pytest.approx(by_terms, rel=1e-12)
    mm, attn, head = vm._gpt_flops(h, l, r.heads, v, s, 1)
    assert mm == pytest.approx(2 * 12 * h * h * s, rel=1e-3)  # 12 h^2 weights (+ biases none counted)
    assert attn == pytest.approx(4 * s * s * h) and head == pytest.approx(2 * s * h * v)


def test_held_out_rows_within_their_bounds(rows):
    held = [r for r in rows if r["role"] == "held_out"]
    bad = [(r["id"], f"{r['error']:+.1%}") for r in held if not r["within_bound"]]
    assert not bad
    assert all(r["bound"] == (0.15 if r["table"] == "narayanan21_table1" else 0.20) for r in held)
    assert sum(r["table"] == "narayanan21_table1" for r in held) == 8
    assert max(r["gpus"] for r in held) >= 3000  # thousands of GPUs


def test_calibration_rows_are_named_and_few(rows):
    cal = [r["id"] for r in rows if r["role"] == "calibration"]
    assert sorted(cal) == sorted(vm.CALIBRATION_ROWS) and len(cal) <= 3
    assert vm.fit_gemm_scale() == pytest.approx(vm.GEMM_SCALE, rel=2e-3)  # the constant is that fit


def test_bad_settings_get_one_line_errors(tmp_path):
    row = dict(vm.public_rows()[6], tp="7")
    with pytest.raises(InputError, match=r"tp x pp = 56 does not divide 1536 GPUs"):
        vm.run_of(row)
    row = dict(vm.public_rows()[0], recompute="some")
    with pytest.raises(InputError, match="recompute must be full or selective"):
        vm.run_of(row)
    bad = tmp_path / "m.csv"
    raw = vm.public_rows()[:1]
    with open(bad, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(raw[0]))
        w.writeheader()
        w.writerow(dict(raw[0], source=" "))
    with pytest.raises(InputError, match="every row needs a source"):
        vm.megatron_rows(path=bad)
