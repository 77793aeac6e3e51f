"""`harness bench step --layout fsdp2-owner|fsdp2-sharded`: a real 2-rank run of a tiny model reports the
layout, memory mode and counted bytes (the Muon-matrix bytes of owner-centric vs naive follow muon.md's
table); bad layout / memory input exits 2 before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.cli import main

TINY = ["--ranks", "2", "--width-scale", "1/32", "--layers", "1", "--seq-len", "16", "--micro-batch", "1",
        "--steps", "2", "--warmup", "1", "--rounds", "1", "--device", "cpu", "--json"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("memory,ratio", [("keep", 2 / 3), ("free", 3 / 4)])
def test_bench_step_owner_layout_bytes(memory, ratio):
    cmd = [sys.executable, "-m", "harness.cli", "bench", "step", "--strategy", "dmuon,naive",
           "--layout", "fsdp2-owner", "--memory", memory, *TINY]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    dmuon, naive = out["rows"]
    assert (dmuon["layout"], dmuon["memory"], naive["strategy"]) == ("fsdp2-owner", memory, "naive")
    for r in (dmuon, naive):
        assert r["comm_bytes_per_step"] == pytest.approx(r["opt_comm_bytes_per_step"]
                                                         + r["fsdp_comm_bytes_per_step"])
        assert r["peak_mem_bytes"] > 0 and r["optimizer_s"] > 0
    # every dimension of the width-1/32 model is even: no FSDP2 padding over 2 ranks; the flag
    # all-reduces (a few hundred bytes) are the only difference from the exact ratio
    assert out["ratios"]["dmuon_over_naive_muon_comm_bytes_overlap_on"] == pytest.approx(ratio, rel=1e-3)


@pytest.mark.parametrize("args,text", [
    (["--layout", "zero3"], "unknown layout 'zero3'"),
    (["--memory", "spill", "--layout", "fsdp2-owner"], "unknown memory 'spill'"),
    (["--memory", "free"], "--memory free needs an FSDP2 layout"),
    (["--layout", "fsdp2-owner", "--node-size", "1"], "--node-size is for --layout ddp"),
])
def test_bench_step_bad_layout_input_exits_2(args, text, capsys):
    assert main(["bench", "step", *args]) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1, err
