"""`harness bench step --max-split 1,2 --wide-matrix ROWSxCOLS`: the bench model's extra matrix, split and
unsplit DMuon side by side in one run with their ratio, and bad input (exit 2 before any process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from harness.cli import main
from harness.cmd_bench_step import ratios


def test_the_wide_matrix_is_one_more_muon_matrix_and_gets_a_gradient():
    from dmuon.params import route
    from simulator.models.benchmodel import build_bench_model, synthetic_batch
    from simulator.models.workload import load_workload

    workload = load_workload("qwen2.5-7b").scaled(1 / 32, blocks=1)
    plain = build_bench_model(workload)
    model = build_bench_model(workload, wide=(300, 1000))
    extra = set(model.matrix_shapes().items()) - set(plain.matrix_shapes().items())
    assert extra == {("model.wide.weight", (300, 1000))}
    muon = {r.name for r in route(model) if r.use_muon}
    assert "model.wide.weight" in muon
    x, y = synthetic_batch(model.vocab, 8, 1, seed=0, step=0, rank=0)
    model(x, y).backward()
    g = model.get_parameter("model.wide.weight").grad
    assert g is not None and bool((g != 0).all())  # tiled inputs, folded outputs: every entry is used


def test_split_ratios_compare_each_split_with_the_smallest():
    base = dict(strategy="dmuon", overlap=True, exchange="auto", ns_method="standard", ns_dtype="default",
                step_s=2.0, optimizer_s=1.0, optimizer_s_min=0.9, optimizer_cpu_s=0.8, optimizer_runq_s=0.2)
    rows = [{**base, "max_split": 1}, {**base, "max_split": 2, "optimizer_s": 0.5, "optimizer_s_min": 0.6,
                                       "step_s": 1.5, "optimizer_cpu_s": 0.5, "optimizer_runq_s": 0.1}]
    out = ratios(rows)
    assert out["split2_over_split1_optimizer_s_overlap_on_split2"] == pytest.approx(2.0)
    assert out["split2_over_split1_optimizer_s_min_overlap_on_split2"] == pytest.approx(1.5)
    assert out["split2_over_split1_step_s_overlap_on_split2"] == pytest.approx(2.0 / 1.5)
    assert out["split2_over_split1_optimizer_cpu_s_overlap_on_split2"] == pytest.approx(1.6)
    assert out["split2_over_split1_optimizer_s_less_runq_overlap_on_split2"] == pytest.approx(0.8 / 0.4)


def _session_of_spawned_rank(q) -> None:
    import os

    from harness.bench_step_launch import _own_session

    before = os.getsid(0)
    _own_session()
    q.put((before, os.getsid(0), os.getpid()))


def test_a_spawned_rank_gets_a_session_of_its_own():
    import multiprocessing as mp
    import os

    if not hasattr(os, "setsid"):
        pytest.skip("no sessions on this platform")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_session_of_spawned_rank, args=(q,))
    p.start()
    before, after, pid = q.get(timeout=60)
    p.join(timeout=60)
    assert before == os.getsid(0)  # spawned into the launcher's session (one scheduler autogroup) ...
    assert after == pid != before  # ... and then the leader of its own


def test_run_queue_wait_is_read_from_schedstat():
    import math

    from harness.bench_step_rank import _runq_s

    if not os.path.exists("/proc/thread-self/schedstat"):
        assert math.isnan(_runq_s())
        return
    start = _runq_s()
    spin = [sys.executable, "-c", "import time\nend = time.time() + 0.5\nwhile time.time() < end: pass"]
    spinners = [subprocess.Popen(spin) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:  # runnable the whole time, with twice as many spinners as cores
            pass
    finally:
        for p in spinners:
            p.wait(timeout=30)
    waited = _runq_s() - start
    assert 0.0 < waited < 5.0


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_bench_step_split_and_plain_side_by_side():
    cmd = [sys.executable, "-m", "harness.cli", "bench", "step", "--ranks", "2", "--width-scale", "1/32",
           "--layers", "1", "--seq-len", "16", "--micro-batch", "1", "--steps", "2", "--warmup", "1",
           "--rounds", "1", "--device", "cpu", "--json", "--ns-method", "standard", "--max-split", "1,2",
           "--wide-matrix", "512x4096"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    rows = out["rows"]
    assert [(r["max_split"], r["wide_matrix"]) for r in rows] == [(1, "512x4096"), (2, "512x4096")]
    assert rows[0]["split_batches"] == 0 and rows[1]["split_batches"] == 1  # the balancer splits it
    assert rows[1]["split_groups"] == "0-1"
    assert out["ratios"]["split2_over_split1_optimizer_s_overlap_on_split2"] > 0
    assert not any(r["rank_sessions"] for r in rows)  # the default: the ranks share the launcher's session
    if os.path.exists("/proc/thread-self/schedstat"):
        assert all(r["optimizer_runq_s"] >= 0 for r in rows)


@pytest.mark.parametrize("args,text", [
    (["--max-split", "4"], "max split must be an integer from 1 (no splitting) to --ranks (2), got 4"),
    (["--max-split", "two"], "--max-split takes integers"),
    (["--wide-matrix", "512by4096"], "--wide-matrix takes ROWSxCOLS"),
    (["--wide-matrix", "1x4096"], "two integers >= 2"),
])
def test_bench_step_bad_split_input_exits_2(args, text, capsys):
    assert main(["bench", "step", *args]) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1, err
