"""CPU profiles: measured thread speedups and co-run slowdowns price multi-threaded and co-running ranks;
naive_ns_method='auto' prices each shape with its cheapest method."""

from dataclasses import replace

import pytest

from dmuon.errors import InputError
from simulator.api import SimConfig, simulate
from simulator.hardware import PROFILE_DIR, load_profile


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
