"""The profiler (CPU, tiny shapes), `harness profile`, and the import hygiene of dmuon.plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dmuon.errors import InputError
from dmuon.plan.cost import CostTable
from dmuon.plan.profile import check_request, profile_device
from dmuon.plan.profile_io import read_profile, write_profile
from harness.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_profile_device_rows_feed_a_cost_table(tmp_path):
    import torch

    torch.set_num_threads(1)
    rows = profile_device(
        [(24, 40), (40, 24), (16, 64), (32, 32), (8, 48)],
        device="cpu",
        max_batch=2,
        repeats=1,
        elementwise_numels=(1 << 10, 1 << 12, 1 << 14, 1 << 16),
    )
    ns = [r for r in rows if r.op == "ns"]
    assert {(r.rows, r.cols) for r in ns} == {(24, 40), (16, 64), (32, 32), (8, 48)}  # (40, 24) is (24, 40)
    assert {r.batch for r in ns} == {1, 2} and {r.method for r in ns} == {"standard", "gram"}
    assert {r.op for r in rows} == {"ns", "matmul", "copy", "muon_momentum", "adamw", "grad_prep"}
    assert all(r.time_s > 0 and r.source.startswith("measured here") for r in rows)
    path = tmp_path / "mini.csv"
    write_profile(path, rows)
    table = CostTable.load(str(path))
    a = table.ns_time(40, 24, 2, "gram", "fp32")
    assert a.measured and a.time_s == next(
        r.time_s for r in ns if (r.rows, r.cols, r.batch, r.method) == (24, 40, 2, "gram")
    )
    assert table.peak_flops("fp32") > 0 and table.hbm_bytes_per_s > 0
    assert table.ns_time(64, 256, 1, "gram", "fp32").time_s > table.ns_time(32, 128, 1, "gram", "fp32").time_s


def test_ns_calls_are_timed_in_interleaved_rounds(monkeypatch):
    import statistics

    import dmuon.newton_schulz as ns_mod
    import dmuon.plan.profile as prof
    from dmuon.plan.profile import profile_ns

    seen, clock = [], iter(range(10_000))
    monkeypatch.setattr(ns_mod, "orthogonalize",
                        lambda g, method, **kw: seen.append((tuple(g.shape), method)))
    monkeypatch.setattr(prof.time, "perf_counter", lambda: float(next(clock)))
    rows = profile_ns([(8, 16), (4, 12)], methods=("standard", "gram"), max_batch=2, repeats=3, warmup=1)
    one_round = [((b, n, m), meth) for n, m in ((4, 12), (8, 16)) for b in (1, 2)
                 for meth in ("standard", "gram")]
    # round 1: one warm-up + one timed call each; rounds 2 and 3: one timed call each, every call in turn
    assert seen == [c for c in one_round for _ in range(2)] + one_round + one_round
    assert len(rows) == 8 and all("interleaved" in r.source for r in rows)
    assert all(r.time_s == statistics.median([1.0, 1.0, 1.0]) for r in rows)  # each call: one clock tick


def test_elementwise_passes_are_also_timed_split_over_tensors():
    import torch

    from dmuon.plan.profile import elementwise_calls, profile_elementwise

    torch.set_num_threads(1)
    rows = profile_elementwise((1 << 10, 1 << 14, 1 << 23), repeats=1, tensor_counts=(4,))
    split = [r for r in rows if r.batch > 1]
    # the largest size <= SPLIT_NUMEL (1 << 22) gets the split rows: here 1 << 14 in 4 tensors, per op
    assert sorted((r.op, r.numel, r.batch) for r in split) == [(op, 1 << 14, 4) for op in
                                                               ("adamw", "grad_prep", "muon_momentum")]
    assert len(rows) == 3 * 3 + 3
    fns = elementwise_calls(10, tensors=3)  # 10 elements as 4 + 3 + 3; every op runs
    for fn in fns.values():
        fn()


def test_profiler_rejects_what_it_cannot_time():
    with pytest.raises(
        InputError, match="gram_sym.*needs the Triton symmetric kernels.*accepted: standard, gram"
    ):
        check_request("cpu", ("gram_sym",), ("fp32",), 8, 3)
    import dmuon.plan.profile as profile_mod

    real_flags = profile_mod.cpu_flags
    try:  # a CPU without native bf16 matmuls refuses bf16 and says what it accepts
        profile_mod.cpu_flags = lambda: frozenset({"avx2"})
        with pytest.raises(InputError, match="no native bf16 matmul.*accepted on this cpu: fp32$"):
            check_request("cpu", ("gram",), ("bf16",), 8, 3)
        profile_mod.cpu_flags = lambda: frozenset({"avx512_bf16"})
        check_request("cpu", ("gram",), ("bf16",), 8, 3)
        with pytest.raises(InputError, match="accepted on this cpu: fp32, bf16$"):
            check_request("cpu", ("gram",), ("fp16",), 8, 3)
    finally:
        profile_mod.cpu_flags = real_flags
    with pytest.raises(InputError, match="unknown device 'tpu'; accepted: cpu, cuda"):
        check_request("tpu", ("gram",), ("fp32",), 8, 3)
    with pytest.raises(InputError, match="max_batch must be a positive integer"):
        check_request("cpu", ("gram",), ("fp32",), 0, 3)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="no CUDA GPU"):
            check_request("cuda", ("gram",), ("bf16",), 8, 3)


def test_harness_profile_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "cpu_small.csv"
    rc = main(
        [
            "profile",
            "--device",
            "cpu",
            "--workload",
            "qwen2.5-7b",
            "--scale",
            "1/128",
            "--max-batch",
            "2",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = read_profile(out)
    assert {(r.rows, r.cols) for r in rows if r.op == "ns"} == {(8, 32), (32, 32), (32, 144)}
    assert main(["profile", "--device", "cpu", "--methods", "gram_sym", "--out", str(out)]) == 2
    assert "needs the Triton symmetric kernels" in capsys.readouterr().err


def test_plan_modules_import_without_torch_pulp_highspy_numpy():
    # dmuon/__init__ imports torch (the optimizer); the planner modules themselves must not.
    code = f"""
import sys, types, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('torch', 'pulp', 'highspy', 'numpy', 'simpy'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
pkg = types.ModuleType('dmuon'); pkg.__path__ = [{str(ROOT / "dmuon")!r}]; sys.modules['dmuon'] = pkg
import dmuon.plan, dmuon.plan.build, dmuon.plan.cost, dmuon.plan.profile, dmuon.plan.milp, dmuon.plan.colgen
from dmuon.plan.cost import CostTable
from dmuon.plan.build import build_plan
from dmuon.plan.types import MatrixSpec
plan = build_plan([MatrixSpec('a', 64, 256), MatrixSpec('b', 256, 64)], 2, CostTable.load('a800'))
print('ok', plan.makespan_s > 0)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok True"


def test_keep_faster_merges_runs_point_by_point():
    from dmuon.plan.profile_io import ProfileRow, keep_faster

    a = [
        ProfileRow("cpu", "ns", 8, 32, 1, "gram", "fp32", 2.0, "run a"),
        ProfileRow("cpu", "ns", 8, 32, 2, "gram", "fp32", 3.0, "run a"),
    ]
    b = [
        ProfileRow("cpu", "ns", 8, 32, 1, "gram", "fp32", 1.5, "run b"),
        ProfileRow("cpu", "ns", 8, 32, 2, "gram", "fp32", 4.0, "run b"),
        ProfileRow("cpu", "adamw", 64, 1, 1, "", "fp32", 1e-6, "run b"),
    ]
    merged = keep_faster(b, a)
    assert [r.time_s for r in merged] == [1.5, 3.0, 1e-6]
    assert merged[0].source == "run b; fastest of 2 runs" and merged[1].source == "run a; fastest of 2 runs"
    assert keep_faster(merged, a)[1].source == "run a; fastest of 3 runs"
    assert merged[2].source == "run b"


def test_cpu_dtypes_follow_the_instruction_set_flags():
    from dmuon.plan.profile import cpu_dtypes

    assert cpu_dtypes([]) == ("fp32",)
    assert cpu_dtypes(["avx512f", "avx512_bf16"]) == ("fp32", "bf16")
    assert cpu_dtypes(["amx_bf16", "amx_fp16"]) == ("fp32", "bf16", "fp16")
    assert cpu_dtypes(["avx512_fp16"]) == ("fp32", "fp16")
