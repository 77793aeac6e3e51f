"""scripts/gpu_opt_passes.py (issue 17's one-GPU measurement) end to end in its CPU dry run: a gloo world of
1, FSDP2 on a Qwen2.5-1.5B-shaped model / 32; the CSV holds every pass, the counts the workload implies,
and the simulator's own price of each pass for those counts; the verdict rule on made-up rows."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dmuon.errors import InputError
from scripts import gpu_opt_passes as gop
from simulator.setup import profile_pricer
from simulator.models.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
SCALE = 32


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("opt_passes")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(out / "not_here")}
    cmd = [sys.executable, "scripts/gpu_opt_passes.py", "--cpu", "--scale", str(SCALE), "--tokens", "16",
           "--repeats", "2", "--warmup", "0", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(out / "cpu_dryrun_opt_passes.csv", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    return header, {r["pass"]: r for r in rows}, [r["pass"] for r in rows], out, p.stdout


def test_csv_has_every_pass_measured(dry_run):
    header, rows, order, out, stdout = dry_run
    assert tuple(header) == gop.COLUMNS
    assert tuple(order) == gop.PASSES
    for r in rows.values():
        assert float(r["measured_ms"]) > 0 and float(r["host_ms"]) > 0, r
        assert int(r["elements"]) > 0 and int(r["tensors"]) >= 1
    assert not (out / "not_here").exists()  # --out wins over $OUT
    md = (out / "cpu_dryrun_opt_passes.md").read_text()
    assert "## Verdict" in md and all(f"| {p} |" in md for p in gop.PASSES)
    for name in gop.BASELINES:  # one verdict line per (a) / (b) pass, printed and written
        assert f"{name}: " in stdout.split("verdict:")[1] and f"- {name}: " in md


def test_counts_are_the_workloads(dry_run):
    """The Muon rows hold exactly the workload's matrices / 32; the AdamW rows the rest of the model (Qwen2's
    embedding, q/k/v biases, RMSNorm scales); the plain rows the same counts as the passes they mirror."""
    _, rows, *_ = dry_run
    n = lambda name: (int(rows[name]["elements"]), int(rows[name]["tensors"]))  # noqa: E731
    muon = [p for p in load_workload("qwen2.5-1.5b").params if p.optimizer == "muon"]
    assert n("dmuon_momentum") == (sum((p.rows // SCALE) * (p.cols // SCALE) for p in muon), len(muon))
    d = gop.qwen_dims("qwen2.5-1.5b", SCALE)
    per_block = d["hidden"] + 2 * d["kv"] + 2 * d["hidden"]  # q, k, v biases; two norms
    adamw = (d["vocab"] * d["hidden"] + d["blocks"] * per_block + d["hidden"], 1 + 5 * d["blocks"] + 1)
    assert n("dmuon_adamw") == adamw
    total = (n("dmuon_momentum")[0] + adamw[0], n("dmuon_momentum")[1] + adamw[1])
    for name in ("fsdp2_torch_adamw_foreach", "fsdp2_torch_adamw_fused", "dmuon_step", "dmuon_step_no_ns",
                 "plain_adamw_all_fused_k", "plain_torch_adamw_foreach_k"):
        assert n(name) == total, name
    batch = n("dmuon_momentum_batch")  # the plan's largest batch: up to max_batch (8) same-shape matrices
    assert 1 <= batch[1] <= 8 and batch[0] % batch[1] == 0
    assert batch[0] // batch[1] == max((p.rows // SCALE) * (p.cols // SCALE) for p in muon)
    for name, twin in (("plain_adamw_fused_k", "dmuon_adamw"), ("plain_momentum_k", "dmuon_momentum"),
                       ("plain_momentum_batch_k", "dmuon_momentum_batch")):
        assert n(name) == n(twin)
        assert n(name.replace("_k", "_1")) == (n(twin)[0], 1)


def test_predictions_are_the_simulators(dry_run):
    """predicted_ms = the simulator's elementwise_s (a800) for the row's op(s), elements and tensors; empty
    for the rows with NS in them; the a800 table's intercept shows (every pass >= 7.85 ms)."""
    _, rows, *_ = dry_run
    price = profile_pricer("a800")
    for r in rows.values():
        if not r["op"]:
            assert r["predicted_ms"] == "" and r["pass"] in ("dmuon_momentum_ns", "dmuon_step")
            continue
        if "+" in r["op"]:  # the step: its momentum pass + its AdamW pass, each at its own counts
            want = float(rows["dmuon_momentum"]["predicted_ms"]) + float(rows["dmuon_adamw"]["predicted_ms"])
        else:
            want = price(int(r["elements"]), r["op"], int(r["tensors"])) * 1e3
        assert float(r["predicted_ms"]) == pytest.approx(want, rel=1e-12), r["pass"]
        assert float(r["predicted_ms"]) >= 7.85 * len(r["op"].split("+"))
    assert rows["dmuon_step_no_ns"]["op"] == "muon_momentum+adamw"


def test_verdict_rule():
    """A pass pays the intercept when it takes >= half the table's intercept longer than its plain
    one-tensor twin; a missing row is 'not measured'."""
    price = profile_pricer("a800")
    half = price(1, "adamw") * 1e3 / 2
    blank = dict.fromkeys(gop.COLUMNS, "")
    rows = [{**blank, "pass": "dmuon_adamw", "op": "adamw", "measured_ms": 1.0 + half + 0.01,
             "predicted_ms": 9.0},
            {**blank, "pass": "plain_adamw_fused_1", "op": "adamw", "measured_ms": 1.0}]
    lines = {line.split(":")[0]: line for line in gop.verdicts(rows, price)}
    assert "-> PAYS" in lines["dmuon_adamw"]
    rows[0]["measured_ms"] = 1.0 + half - 0.01
    lines = {line.split(":")[0]: line for line in gop.verdicts(rows, price)}
    assert "does NOT pay" in lines["dmuon_adamw"]
    assert lines["dmuon_momentum"] == "dmuon_momentum: not measured"


def test_device_slug():
    assert [gop.device_slug(n) for n in ("NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA A800-SXM4-80GB", "")] == [
        "h200", "h200", "a800sxm480gb", "gpu"]


def test_bad_input():
    with pytest.raises(InputError, match="Qwen/Llama-shaped"):
        gop.qwen_dims("wall-oss", 1)
    with pytest.raises(SystemExit):
        gop.parse(["--scale", "0"])
