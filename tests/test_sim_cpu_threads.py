"""CPU profiles: measured thread speedups and co-run slowdowns price multi-threaded and co-running ranks;
naive_ns_method='auto' prices each shape with its cheapest method."""

import re
from dataclasses import replace

import pytest

from dmuon.errors import InputError
from simulator.api import SimConfig, simulate
from simulator.fabric.hardware import PROFILE_DIR, load_profile


def test_contention_interpolates_measured_speedups_and_coruns():
    cpu = load_profile("cpu")
    p = replace(cpu, cpu_cores=4, thread_speedup={"compute": 2.5}, corun_slowdown={"compute": 1.3})
    assert p.contention(1, 1) == pytest.approx(1.0)
    assert p.contention(1, 4) == pytest.approx(1 / 2.5)  # the measured speedup at cpu_cores threads
    assert p.contention(1, 2) == pytest.approx(1 / 1.5)  # 1 + (2.5 - 1) x (2 - 1) / (4 - 1)
    assert p.contention(4, 1) == pytest.approx(1.3)  # every core busy: the measured co-run slowdown
    assert p.contention(8, 1) == pytest.approx(2 * 1.3)  # oversubscribed: time-shared cores on top
    assert p.contention(1, 4, "ns") == pytest.approx(1 / 4)  # not measured: linear (the assumption)
    gpu = load_profile("a800")
    assert gpu.contention(8, 4, "ns") == 1.0


def test_threads_section_is_validated(tmp_path):
    text = (PROFILE_DIR / "cpu.toml").read_text()
    bad = text.replace("[threads]\n", "[threads]\nbogus_speedup = { value = 2, source = \"x\" }\n", 1)
    path = tmp_path / "bad.toml"
    path.write_text(bad)
    with pytest.raises(InputError, match="unknown key 'bogus_speedup'"):
        load_profile(str(path))
    neg = text.replace("ns_speedup = { value = ", "ns_speedup = { value = -", 1)
    path.write_text(neg)
    with pytest.raises(InputError, match="ns_speedup"):
        load_profile(str(path))


def test_more_threads_never_slow_a_cpu_run_down_and_auto_naive_is_the_cheapest():
    base = dict(workload="qwen2.5-7b", gpu="cpu", gpus=1, strategy="naive", layout="ddp", seq_len=64,
                micro_batch=1)
    one = simulate(SimConfig(**base, cpu_threads=1))
    two = simulate(SimConfig(**base, cpu_threads=2))
    assert two.step_s <= one.step_s
    times = {m: simulate(SimConfig(**base, naive_ns_method=m)).ns_makespan_s
             for m in ("standard", "gram", "auto")}
    assert times["auto"] <= min(times["standard"], times["gram"]) + 1e-12


BENCH = dict(gpu="cpu", layout="ddp", seq_len=128, micro_batch=2, ns_method="auto", naive_ns_method="auto")


def _bench_workload():
    from simulator.models.workload import load_workload

    return load_workload("qwen2.5-7b").scaled(1 / 16, 4)


def test_several_threads_are_priced_from_the_cost_table_measured_at_that_thread_count():
    import torch

    from dmuon.runtime.planning import default_profile
    from simulator.costs import load_cost, plan_for
    from simulator.setup import orientation_of

    w = _bench_workload()
    res = simulate(SimConfig(workload=w, gpus=1, strategy="dmuon", cpu_threads=2, **BENCH))
    # one rank on every core: no oversubscription or co-run; the plan is built and priced from the
    # two-thread table (as the runtime plans on 2 threads), not one-thread times over a scalar speedup;
    # tall and wide matrices apart, as the runtime's plan on a CPU
    orientation = orientation_of(w.muon_matrices, load_profile("cpu"), "auto")
    assert orientation == {(min(m.shape), max(m.shape)) for m in w.muon_matrices}
    # the Triton kernels ('_sym') and GPU profiles keep both orientations in one class (and a CPU
    # profile simulated with a '_sym' method runs: it used to ask for the Triton kernels on a CPU)
    assert orientation_of(w.muon_matrices, load_profile("cpu"), "gram_sym") is False
    assert orientation_of(w.muon_matrices, load_profile("a800"), "auto") is False
    sym = SimConfig(workload=w, gpus=2, strategy="dmuon", **{**BENCH, "ns_method": "gram_sym"})
    assert simulate(sym).step_s > 0
    plan = plan_for(w.muon_matrices, 1, load_cost("cpu-t2"), balancer="lpt", method="auto", dtype="fp32",
                    batching=True, max_batch=8, bucket_numel=0, time_limit_s=10.0, orientation=orientation)
    assert res.ns_makespan_s == pytest.approx(max(plan.ns_loads_s), rel=1e-9)  # the NS part
    assert plan.makespan_s > res.ns_makespan_s  # the plan's batch times also carry the owner's momentum
    assert "measured at this thread count" in res.provenance["ns_plan"]
    one = simulate(SimConfig(workload=w, gpus=1, strategy="dmuon", cpu_threads=1, **BENCH))
    assert "measured at this thread count" not in one.provenance["ns_plan"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert default_profile(torch.device("cpu")) == "cpu-t2"
        torch.set_num_threads(1)
        assert default_profile(torch.device("cpu")) == "cpu"
    finally:
        torch.set_num_threads(before)


def test_naive_batching_prices_one_call_per_shape():
    from collections import Counter

    from simulator.costs import load_cost

    w = _bench_workload()
    cost = load_cost("cpu")
    per_matrix = simulate(SimConfig(workload=w, gpus=1, strategy="naive", **{**BENCH, "naive_ns_method":
                                                                             "standard"}))
    batched = simulate(SimConfig(workload=w, gpus=1, strategy="naive", naive_batching=True,
                                 **{**BENCH, "naive_ns_method": "standard"}))
    shapes = Counter((m.rows, m.cols) for m in w.muon_matrices)
    assert batched.ns_makespan_s == pytest.approx(
        sum(cost.ns_time(r, c, n, "standard", "fp32").time_s for (r, c), n in shapes.items()), rel=1e-9)
    assert per_matrix.ns_makespan_s == pytest.approx(
        sum(cost.ns_time(r, c, 1, "standard", "fp32").time_s * n for (r, c), n in shapes.items()), rel=1e-9)
    with pytest.raises(InputError, match="naive_batching"):
        simulate(SimConfig(workload=w, gpus=1, strategy="naive", naive_batching="yes", **BENCH))


@pytest.mark.parametrize("strategy", ["adamw", "naive", "dmuon"])
def test_speed_scale_stretches_every_cpu_time_alike(strategy):
    w = _bench_workload()
    base = simulate(SimConfig(workload=w, gpus=2, strategy=strategy, **BENCH))
    slow = simulate(SimConfig(workload=w, gpus=2, strategy=strategy, speed_scale=1.25, **BENCH))
    for key in ("step_s", "forward_s", "backward_s", "optimizer_s", "ns_makespan_s"):
        assert getattr(slow, key) == pytest.approx(1.25 * getattr(base, key), rel=1e-9), key
    assert "speed_scale" in slow.provenance and "speed_scale" not in base.provenance
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(InputError, match="speed_scale must be a finite number > 0"):
            simulate(SimConfig(workload=w, gpus=1, strategy=strategy, speed_scale=bad, **BENCH))


def test_interference_keys_are_read_and_validated(tmp_path):
    cpu = load_profile("cpu")
    assert cpu.comm_overlap_slowdown >= 0 and cpu.overlap_slowdown >= 0
    text = (PROFILE_DIR / "cpu.toml").read_text()
    path = tmp_path / "p.toml"
    key = "comm_overlap_slowdown = { value = "
    path.write_text(text.replace(key, key + "-", 1))
    with pytest.raises(InputError, match="comm_overlap_slowdown must be a non-negative number"):
        load_profile(str(path))
    path.write_text(re.sub(r"(comm_overlap_slowdown = \{ value = )[0-9.e+-]+", r"\1inf", text))
    with pytest.raises(InputError, match="comm_overlap_slowdown must be finite"):
        load_profile(str(path))


def test_closed_loop_runs_at_the_probed_speed():
    from simulator.models.compute import layer_times
    from simulator.validation.validate import BenchRow, closed_loop, speed_scale_of

    cpu = load_profile("cpu")
    model = sum(f + b for f, b in layer_times(_bench_workload(), cpu, 128, 2, 2, 1))
    row = BenchRow(ranks=2, strategy="dmuon", width_scale=1 / 16, blocks=4, seq_len=128, micro_batch=2,
                   step_s=0.3, optimizer_s=0.1, threads=1, probe_s=1.2 * model)
    k, how = speed_scale_of(row, cpu)
    assert k == pytest.approx(1.2) and "x1.200" in how
    c = closed_loop(row)
    assert c["simulated_step_s"] == pytest.approx(1.2 * c["raw_simulated_step_s"], rel=1e-9)
    assert c["step_error"] == pytest.approx(c["simulated_step_s"] / 0.3 - 1)
    for missing in (None, float("nan")):
        assert speed_scale_of(replace(row, probe_s=missing), cpu)[0] == 1.0


def _one_rank(strategy: str, **scaled):
    """The bench model on one rank: as profiled, and with the speed-scale keys `scaled`."""
    w = _bench_workload()
    return tuple(simulate(SimConfig(workload=w, gpus=1, strategy=strategy, **kw, **BENCH))
                 for kw in ({}, scaled))


def test_ns_speed_scale_stretches_ns_alone():
    w = _bench_workload()
    base, slow = _one_rank("naive", ns_speed_scale=1.5)
    assert slow.ns_makespan_s == pytest.approx(1.5 * base.ns_makespan_s, rel=1e-9)
    assert (slow.forward_s, slow.backward_s) == pytest.approx((base.forward_s, base.backward_s), rel=1e-12)
    # one rank, no communication: the optimizer phase is the elementwise passes plus every NS call
    assert slow.optimizer_s - base.optimizer_s == pytest.approx(0.5 * base.ns_makespan_s, rel=1e-9)
    assert "ns_speed_scale" in slow.provenance and "ns_speed_scale" not in base.provenance
    both = simulate(SimConfig(workload=w, gpus=1, strategy="naive", speed_scale=2.0, ns_speed_scale=1.5,
                              **BENCH))
    assert both.ns_makespan_s == pytest.approx(slow.ns_makespan_s, rel=1e-9)  # NS follows its own scale
    assert both.forward_s == pytest.approx(2.0 * base.forward_s, rel=1e-9)
    assert "NS" not in both.provenance["speed_scale"]
    for bad in (0, -2.0, float("nan"), float("inf"), "1.5"):
        with pytest.raises(InputError, match="ns_speed_scale must be a finite number > 0 or None"):
            simulate(SimConfig(workload=w, gpus=1, strategy="naive", ns_speed_scale=bad, **BENCH))


def test_closed_loop_prices_ns_at_the_ns_probe_speed():
    from simulator.costs import load_cost
    from simulator.validation.validate import BenchRow, closed_loop, ns_probe_call, ns_speed_scale_of

    cpu, w = load_profile("cpu"), _bench_workload()
    batch, rows, cols, method = ns_probe_call(w)
    big = max(w.muon_matrices, key=lambda m: m.numel)
    assert (rows, cols) == (big.rows, big.cols) and batch == 2
    assert method == "gram"  # aspect ratio 5.3: Gram NS needs fewer FLOPs
    # one rank of one thread: the cpu table's time for that call, no contention
    table_s = load_cost(cpu.cost_profiles).ns_time(rows, cols, batch, method, "fp32").time_s
    row = BenchRow(ranks=1, strategy="naive", width_scale=1 / 16, blocks=4, seq_len=128, micro_batch=2,
                   step_s=0.3, optimizer_s=0.1, threads=1, probe_ns_s=1.3 * table_s)
    k, how = ns_speed_scale_of(row, cpu)
    assert k == pytest.approx(1.3) and "x1.300" in how
    c = closed_loop(row)
    assert c["speed_scale"] == 1.0 and c["ns_speed_scale"] == pytest.approx(1.3)
    assert c["simulated_optimizer_s"] > c["raw_simulated_optimizer_s"]
    assert c["simulated_step_s"] - c["raw_simulated_step_s"] == pytest.approx(
        c["simulated_optimizer_s"] - c["raw_simulated_optimizer_s"], rel=1e-9)  # only NS moved
    for missing in (None, float("nan"), 0.0):
        assert ns_speed_scale_of(replace(row, probe_ns_s=missing), cpu)[0] is None


def _with_overhead(tmp_path, entry: str, name: str):
    text = (PROFILE_DIR / "cpu.toml").read_text()
    path = tmp_path / f"{name}.toml"
    path.write_text(re.sub(r"(?m)^optimizer_overhead_ms = .*$", lambda _: entry, text, count=1))
    return str(path)


def test_measured_optimizer_overhead_is_charged_once_per_step_on_one_thread(tmp_path):
    from simulator.calibration.calibrate_cpu import _optimizer_overhead_entry

    # 4 ms measured step, 1 ms of it priced by the cost table: 3 ms of bookkeeping
    entry = _optimizer_overhead_entry((0.004, 0.001, 141600, 39), "measured here: test")
    assert entry.startswith("optimizer_overhead_ms = { value = 3,") and "39 tensors" in entry
    on = _with_overhead(tmp_path, entry, "on")
    cheap = _optimizer_overhead_entry((0.001, 0.002, 1, 1), "measured here: test")
    off = _with_overhead(tmp_path, cheap, "off")
    assert load_profile(on).optimizer_overhead_s == pytest.approx(0.003)
    assert load_profile(off).optimizer_overhead_s == 0.0  # a step cheaper than the table's passes: none
    cpu = load_profile(on)
    w = _bench_workload()
    kw = {k: v for k, v in BENCH.items() if k != "gpu"}
    for ranks, threads in ((1, 2), (2, 1)):
        for strategy in ("adamw", "dmuon"):
            a, b = (simulate(SimConfig(workload=w, gpus=ranks, strategy=strategy, gpu=g, cpu_threads=threads,
                                       **kw)) for g in (on, off))
            # Python bookkeeping: a second thread does not shorten it; co-running processes stretch it
            expected = 0.003 * cpu.contention(ranks, threads, threads_measured=True)
            if ranks == 1:  # nothing to hide behind: the whole of it
                assert expected == pytest.approx(0.003)
                assert a.optimizer_s - b.optimizer_s == pytest.approx(expected, rel=1e-6), strategy
            else:  # it runs while the last gradient reduction is in flight: partly hidden
                assert 0 < a.optimizer_s - b.optimizer_s <= expected * (1 + 1e-9), strategy
            assert "optimizer_overhead" in a.provenance and "optimizer_overhead" not in b.provenance


def test_elementwise_speed_scale_stretches_passes_and_bookkeeping_alone():
    w = _bench_workload()
    base, slow = _one_rank("adamw", elementwise_speed_scale=1.5)
    # one rank of AdamW: the optimizer phase is the bookkeeping + the adamw and grad_prep passes
    assert slow.optimizer_s == pytest.approx(1.5 * base.optimizer_s, rel=1e-9)
    assert (slow.forward_s, slow.backward_s) == pytest.approx((base.forward_s, base.backward_s), rel=1e-12)
    naive, naive_slow = _one_rank("naive", elementwise_speed_scale=1.5)
    assert naive_slow.ns_makespan_s == pytest.approx(naive.ns_makespan_s, rel=1e-12)  # NS is not elementwise
    assert "elementwise_speed_scale" in slow.provenance and "elementwise" not in slow.provenance.get(
        "speed_scale", "")
    with pytest.raises(InputError, match="elementwise_speed_scale must be a finite number > 0 or None"):
        simulate(SimConfig(workload=w, gpus=1, strategy="adamw", elementwise_speed_scale=-1, **BENCH))


def test_closed_loop_prices_elementwise_passes_at_their_probe_speed():
    from simulator.costs import load_cost
    from simulator.validation.validate import (
        EW_PROBE_NUMEL,
        EW_PROBE_OP,
        BenchRow,
        closed_loop,
        elementwise_speed_scale_of,
    )

    cpu = load_profile("cpu")
    table_s = load_cost(cpu.cost_profiles).elementwise_time(EW_PROBE_NUMEL, EW_PROBE_OP, "fp32")
    assert table_s.measured  # the probe times a pass the table measured
    row = BenchRow(ranks=1, strategy="adamw", width_scale=1 / 16, blocks=4, seq_len=128, micro_batch=2,
                   step_s=0.1, optimizer_s=0.01, threads=1, probe_ew_s=0.7 * table_s.time_s)
    k, how = elementwise_speed_scale_of(row, cpu)
    assert k == pytest.approx(0.7) and "x0.700" in how
    c = closed_loop(row)
    assert c["elementwise_speed_scale"] == pytest.approx(0.7) and c["ns_speed_scale"] is None
    assert c["simulated_optimizer_s"] == pytest.approx(0.7 * c["raw_simulated_optimizer_s"], rel=1e-9)
    assert elementwise_speed_scale_of(replace(row, probe_ew_s=None), cpu)[0] is None


@pytest.mark.parametrize("ranks,threads", [(2, 1), (1, 2)])
def test_closed_loop_simulates_the_plan_the_runtime_builds(ranks, threads):
    """The bench runtime plans with NSConfig() (method auto, per shape) from the table of its thread count;
    the closed loop's simulation must time an equal plan (same batches, owners, methods, makespan)."""
    import torch

    from dmuon.newton_schulz import NSConfig
    from dmuon.runtime.planning import build_model_plan, default_profile
    from simulator.api import run

    w = _bench_workload()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        profile = default_profile(torch.device("cpu"))
        runtime = build_model_plan(tuple(w.muon_matrices), ranks, NSConfig(), torch.device("cpu"),
                                   balancer="lpt", profile=profile, max_batch=8, bucket_numel=0)
    finally:
        torch.set_num_threads(before)
    assert profile == ("cpu-t2" if threads == 2 else "cpu")
    _, built = run(SimConfig(workload=w, gpus=ranks, strategy="dmuon", cpu_threads=threads,
                             naive_batching=True, **BENCH))
    sim = built.spec.plan

    def batches(plan):
        return sorted((b.owner, b.rows, b.cols, tuple(b.members), b.method or plan.method)
                      for b in plan.batches)

    assert sim.cost_source == runtime.cost_source and batches(sim) == batches(runtime)
    assert sim.makespan_s == pytest.approx(runtime.makespan_s, rel=1e-12)


def test_optimizer_passes_are_priced_per_tensor_and_per_reduction_unit():
    from simulator.costs import load_cost

    cpu, w = load_profile("cpu"), _bench_workload()
    table = load_cost(cpu.cost_profiles)
    res = simulate(SimConfig(workload=w, gpus=1, strategy="adamw", **BENCH))
    numel = sum(p.numel for p in w.params)
    layers = len({p.layer for p in w.params})
    expected = (cpu.optimizer_overhead_s
                + table.elementwise_time(numel, "adamw", "fp32", len(w.params)).time_s
                + table.elementwise_time(numel, "grad_prep", "fp32", layers).time_s)
    # one rank, one thread, AdamW: bookkeeping, one AdamW step over every parameter, one gradient
    # preparation per layer's reduction unit
    assert res.optimizer_s == pytest.approx(expected, rel=1e-9)
    assert table.per_tensor_time("adamw") > 0 or table.per_tensor_time("grad_prep") > 0  # split rows measured
