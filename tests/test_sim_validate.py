"""Validation against published numbers (8 x A800 table), the headline summary, the CPU closed loop."""

import pytest

from simulator.validation.validate import BenchRow, closed_loop, headline_rows, headline_summary, published_rows


@pytest.fixture(scope="module")
def published():
    return published_rows()


def test_published_table_is_complete(published):
    fsdp = [r for r in published if r["layout"] == "fsdp-keep"]
    assert {(r["workload"], r["strategy"]) for r in fsdp} == {
        (w, s) for w in ("qwen2.5-1.5b", "llama3.2-3b", "qwen2.5-7b", "llama3.1-8b")
        for s in ("adamw", "naive", "dmuon")}
    assert all(r["profile"] == "a800" for r in published)


def test_optimizer_and_step_within_25pct_of_the_published_8xA800_rows(published):
    rows = [r for r in published if r["layout"] == "fsdp-keep" and r["metric"] in ("optimizer", "step")]
    assert len(rows) == 24
    bad = [(r["workload"], r["method"], r["metric"], round(r["error"], 3))
           for r in rows if abs(r["error"]) > 0.25]
    assert not bad


def test_held_out_forward_backward(published):
    held = [r for r in published if r["metric"] in ("forward", "backward") and not r["in_sample"]]
    fsdp = [r for r in held if r["layout"] == "fsdp-keep"]
    assert len(fsdp) == 20 and len(held) == 24
    assert max(abs(r["error"]) for r in fsdp) < 0.10
    # DDP+Muon: per-layer overheads fitted on FSDP2 runs (DDP has no FSDP hooks): looser
    assert max(abs(r["error"]) for r in held) < 0.15


def test_headline_summary_on_two_sizes():
    rows = headline_rows(workloads=("pi0",), gpus=(8, 64))
    assert [r["gpus"] for r in rows] == [8, 64]
    for r in rows:
        assert r["optimizer_speedup"] > 1 and r["step_speedup"] > 1
    # DMuon's optimizer advantage grows with the number of owners
    assert rows[1]["optimizer_speedup"] > rows[0]["optimizer_speedup"]
    summary = {s["quantity"]: s for s in headline_summary(rows)}
    assert summary["optimizer speedup dmuon/naive, max"]["paper"] == 163.0
    assert summary["step speedup dmuon/naive, min"]["simulated"] == min(r["step_speedup"] for r in rows)


def test_closed_loop_simulates_the_measured_cpu_run():
    row = BenchRow(ranks=2, strategy="dmuon", width_scale=0.0625, blocks=2, seq_len=64, micro_batch=1,
                   step_s=0.5, optimizer_s=0.1)
    out = closed_loop(row)
    assert out["profile"] == "cpu" and out["ranks"] == 2 and "x0.0625, 2 blocks" in out["workload"]
    assert out["step_error"] == pytest.approx(out["simulated_step_s"] / 0.5 - 1)
    assert out["optimizer_error"] == pytest.approx(out["simulated_optimizer_s"] / 0.1 - 1)
    # a run measured exactly as simulated has zero error
    again = closed_loop(BenchRow(**{**row.__dict__, "step_s": out["simulated_step_s"]}))
    assert again["step_error"] == pytest.approx(0.0, abs=1e-12)


def test_closed_loop_reads_a_bench_step_row():
    row = {"ranks": 2, "strategy": "naive", "width_scale": 0.0625, "layers": 2, "seq_len": 64,
           "micro_batch": 2, "step_s": 0.8, "optimizer_s": 0.4, "workload": "qwen2.5-7b",
           "threads_per_rank": 1}
    out = closed_loop(BenchRow.from_bench(row))
    assert out["strategy"] == "naive" and out["layout"] == "ddp"
    assert out["simulated_step_s"] > out["simulated_optimizer_s"] > 0
    one_thread = out["simulated_step_s"]
    two = closed_loop(BenchRow.from_bench({**row, "ranks": 1, "threads_per_rank": 2}))
    assert two["simulated_step_s"] < one_thread  # one rank with both cores computes faster


def test_closed_loop_compares_the_median_of_repeated_launches():
    from harness.validation import median_rows

    base = {"ranks": 2, "strategy": "dmuon", "threads_per_rank": 1, "layout": "ddp", "overlap": True}
    rows = [dict(base, step_s=s, optimizer_s=o, load_1m=1.0, steal_pct=st)
            for s, o, st in ((0.30, 0.10, 0.0), (0.50, 0.30, 20.0), (0.32, 0.12, 1.0))]
    rows.append(dict(base, strategy="naive", step_s=0.4, optimizer_s=0.2, load_1m=1.0))
    med = {r["strategy"]: r for r in median_rows(rows)}
    assert med["dmuon"]["step_s"] == 0.32 and med["dmuon"]["optimizer_s"] == 0.12
    assert "median of 3 launch(es)" in med["dmuon"]["spread"] and "300-500 ms" in med["dmuon"]["spread"]
    assert "steal 0-20%" in med["dmuon"]["spread"]
    assert med["naive"]["step_s"] == 0.4 and "median of 1" in med["naive"]["spread"]


def test_speed_probes_are_pooled_over_strategies_of_the_same_model():
    from harness.validation import median_rows

    model = {"threads_per_rank": 1, "layout": "ddp", "overlap": True, "width_scale": 0.0625, "layers": 4,
             "seq_len": 128, "micro_batch": 2, "workload": "qwen2.5-7b", "step_s": 0.3, "optimizer_s": 0.1}
    rows = [dict(model, ranks=2, strategy=s, probe_s=p, probe_ns_s=q)
            for s, p, q in (("adamw", 0.10, 0.020), ("naive", 0.30, 0.024), ("dmuon", 0.12, float("nan")))]
    rows.append(dict(model, ranks=1, strategy="dmuon", probe_s=0.9, probe_ns_s=0.05))  # another configuration
    med = {(r["ranks"], r["strategy"]): r for r in median_rows(rows)}
    for s in ("adamw", "naive", "dmuon"):  # the median of the three blocks' probes, NaN (no probe) left out
        assert med[(2, s)]["probe_s"] == 0.12 and med[(2, s)]["probe_ns_s"] == pytest.approx(0.022)
        assert "probe 100-300 ms (3 blocks)" in med[(2, s)]["spread"]
    assert med[(1, "dmuon")]["probe_s"] == 0.9 and med[(1, "dmuon")]["probe_ns_s"] == 0.05
