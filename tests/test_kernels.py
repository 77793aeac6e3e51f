"""Triton symmetric kernels (interpreter on CPU), dispatch, autotune cache, bench command, GPU-check dry run.

Under the Triton interpreter (set by conftest.py without CUDA) every case uses fp32 and tiny shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dmuon.errors import InputError
from dmuon.kernels import autotune, get_ops, torch_ops
from dmuon.kernels.configs import TileConfig, bucket, cache_key, candidates, default_config, parse_key

REPO = Path(__file__).resolve().parent.parent
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run without CUDA")


def _rel(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _ops():
    return get_ops(torch.zeros(1, 1), "triton")


def _sym(n, batch, gen):
    g = torch.randn((batch, n, n) if batch else (n, n), generator=gen)
    return (g + g.mT) / (2 * n ** 0.5)


# ---- kernels vs torch (interpreter) ----------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("batch,n,m", [(0, 5, 7), (0, 17, 45), (3, 33, 45), (2, 33, 7), (1, 16, 32)])
def test_syrk_matches_torch_and_is_exactly_symmetric(batch, n, m):
    gen = torch.Generator().manual_seed(n * 100 + m)
    x = torch.randn(((batch,) if batch else ()) + (n, m), generator=gen)
    out = _ops().syrk(x)
    assert out.shape == x.shape[:-1] + (n,) and out.dtype == torch.float32
    assert _rel(out, x.double() @ x.double().mT) <= 1e-5
    assert torch.equal(out, out.mT)


@needs_interpreter
@pytest.mark.parametrize("batch,n", [(0, 5), (2, 17), (3, 33)])
def test_sym_poly_and_sym_mul_add_match_torch(batch, n):
    gen = torch.Generator().manual_seed(n)
    r = _sym(n, batch, gen)
    z = torch_ops.sym_poly(r, -4.775, 2.0315)
    z = torch.tril(z) + torch.tril(z, -1).mT  # exactly symmetric, a polynomial in r
    ops = _ops()
    poly = ops.sym_poly(r, -4.775, 2.0315)
    assert _rel(poly, -4.775 * r.double() + 2.0315 * r.double() @ r.double()) <= 1e-5
    mul = ops.sym_mul_add(r, z, 3.4445)
    assert _rel(mul, r.double() @ z.double() + 3.4445 * r.double()) <= 1e-5
    assert torch.equal(poly, poly.mT) and torch.equal(mul, mul.mT)


@needs_interpreter
def test_non_contiguous_inputs_need_no_copy_and_give_the_same_numbers():
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(3, 45, 33, generator=gen)
    x = base.mT  # (3, 33, 45), column-major
    sliced = torch.randn(2, 40, 90, generator=gen)[:, ::2, ::2]  # strided rows and columns
    ops = _ops()
    assert not x.is_contiguous() and not sliced.is_contiguous()
    assert torch.allclose(ops.syrk(x), ops.syrk(x.contiguous()), rtol=1e-6, atol=1e-6)
    assert _rel(ops.syrk(sliced), sliced.double() @ sliced.double().mT) <= 1e-5
    r = _sym(17, 2, gen)
    assert _rel(ops.sym_poly(r.mT, 0.5, -1.5), 0.5 * r.double() - 1.5 * r.double() @ r.double()) <= 1e-5


@needs_interpreter
@pytest.mark.parametrize("cfg", [TileConfig(32, 16, 1, 1, group=1), TileConfig(16, 32, 1, 1, group=3)])
def test_other_tile_configs_and_groupings_agree(cfg):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 70, 50, generator=gen)
    from dmuon.kernels import triton_ops

    out = triton_ops.syrk(x, config=cfg)
    assert _rel(out, x.double() @ x.double().mT) <= 1e-5 and torch.equal(out, out.mT)
    r = _sym(37, 0, gen)
    out = triton_ops.sym_mul_add(r, r, -2.0, config=cfg)
    assert _rel(out, r.double() @ r.double() - 2 * r.double()) <= 1e-5


@needs_interpreter
def test_the_grid_covers_only_lower_triangle_tiles(monkeypatch):
    from dmuon.kernels import triton_kernels

    grids = []
    real = triton_kernels._sym_product_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_kernels, "_sym_product_kernel", Recorder())
    x = torch.randn(3, 70, 20)  # 70 / 16 -> 5 tile rows -> 15 lower tiles, batch 3
    _ops().syrk(x)
    assert grids == [(15, 3)]


def test_lower_tile_order_visits_each_lower_pair_once_grouped():
    from dmuon.kernels.triton_kernels import lower_tile_order

    for n_tiles, group in [(1, 8), (5, 2), (9, 4), (12, 8)]:
        order = lower_tile_order(n_tiles, group)
        assert sorted(order) == sorted((i, j) for i in range(n_tiles) for j in range(i + 1))
        # grouped: rows of one group are finished before the next group starts
        groups = [i // group for i, _ in order]
        assert groups == sorted(groups)


@needs_interpreter
def test_gram_ns_with_triton_ops_equals_torch_ops():
    orth = pytest.importorskip("dmuon.newton_schulz")
    gen = torch.Generator().manual_seed(11)
    g = torch.randn(2, 24, 40, generator=gen)
    a = orth.orthogonalize(g, method="gram", kernels="triton", dtype=torch.float32)
    b = orth.orthogonalize(g, method="gram", kernels="torch", dtype=torch.float32)
    assert _rel(a, b) <= 1e-5
    tall = torch.randn(40, 17, generator=gen)  # iterated transposed: a .mT view reaches the kernels
    assert _rel(orth.orthogonalize(tall, method="standard", kernels="triton"),
                orth.orthogonalize(tall, method="standard", kernels="torch")) <= 1e-5


def test_bad_inputs_get_clear_errors():
    from dmuon.kernels import triton_ops

    with pytest.raises(ValueError, match="2-D .* or batched 3-D"):
        triton_ops.syrk(torch.zeros(2, 3, 4, 5))
    with pytest.raises(ValueError, match="accept float32, bfloat16, float16"):
        triton_ops.syrk(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="must be square"):
        triton_ops.sym_poly(torch.zeros(4, 5), 1.0, 1.0)
    with pytest.raises(ValueError, match="must share shape, dtype and device"):
        triton_ops.sym_mul_add(torch.zeros(4, 4), torch.zeros(5, 5), 1.0)


# ---- dispatch --------------------------------------------------------------------------------------
def test_dispatch_choices():
    cpu = torch.zeros(8, 8)
    assert get_ops(cpu, "torch") is torch_ops
    assert get_ops(cpu, "auto") is torch_ops  # the CPU is always torch in auto
    with pytest.raises(InputError, match="unknown kernels 'cuda'; accepted: auto, torch, triton"):
        get_ops(cpu, "cuda")
    with pytest.raises(InputError, match="accepts float32, bfloat16 and float16"):
        get_ops(cpu.double(), "triton")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    import dmuon.kernels as kernels
    from dmuon.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "INTERPRETED", False)
    with pytest.raises(InputError, match="needs a CUDA tensor .*TRITON_INTERPRET=1"):
        get_ops(torch.zeros(4, 4), "triton")
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(InputError, match="needs the triton package"):
        get_ops(torch.zeros(4, 4), "triton")


def test_import_dmuon_works_without_triton():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'): raise ImportError('no triton here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, dmuon, dmuon.kernels as k\n"
        "assert k.get_ops(torch.zeros(3, 3), 'auto') is k.torch_ops\n"
        "assert 'triton' not in sys.modules\n"
        "print('ok')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


# ---- configs and cache -----------------------------------------------------------------------------
def test_cache_key_composition_and_buckets():
    assert [bucket(v) for v in (1, 16, 17, 512, 513, 3584, 18944)] == [16, 16, 32, 512, 1024, 4096, 32768]
    key = cache_key("NVIDIA H200", "syrk", 3584, 18944, "bf16", "3.6.0")
    assert key == "NVIDIA H200|syrk|n4096|m32768|bf16|triton3.6.0"
    assert cache_key("NVIDIA H200", "syrk", 3000, 17000, "bf16", "3.6.0") == key  # same shape class
    assert parse_key(key) == {"gpu": "NVIDIA H200", "op": "syrk", "n_bucket": 4096, "m_bucket": 32768,
                              "dtype": "bf16", "triton": "3.6.0"}
    bads = [("g", "gemm", 1, 1, "bf16", "3"), ("g", "syrk", 1, 1, "fp8", "3"),
            ("a|b", "syrk", 1, 1, "bf16", "3")]
    for bad in bads:
        with pytest.raises(ValueError):
            cache_key(*bad)
    with pytest.raises(ValueError, match="malformed"):
        parse_key("H200|syrk|4096|m1|bf16|triton3")
    with pytest.raises(ValueError, match="powers of two"):
        TileConfig(48, 32, 3, 4)
    assert all(c.block >= 64 for c in candidates("bf16")) and default_config("bf16", 4096).block == 128


def _entry(t=1e-3, torch_t=2e-3, block=128):
    return autotune.Entry(TileConfig(block, 64, 4, 8), t, torch_t, 1e-3, (1, 4096, 4096))


def test_cache_round_trip_location_and_atomic_write(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path / "c"))
    path = autotune.cache_path()
    assert path == tmp_path / "c" / "autotune.json"
    key = cache_key("GPU", "syrk", 4096, 4096, "bf16", "3.6.0")
    cache = autotune.get_cache()
    cache.put(key, _entry())
    assert json.loads(path.read_text())["format"] == autotune.CACHE_FORMAT
    assert autotune.read_cache_file(path) == {key: _entry()}
    assert sorted(p.name for p in path.parent.iterdir()) == ["autotune.json"]  # no temp file left
    # a failing write leaves the old file intact and no temp file behind

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(autotune.json, "dump", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        autotune.write_cache_file(path, {})
    assert autotune.read_cache_file(path) == {key: _entry()}
    assert sorted(p.name for p in path.parent.iterdir()) == ["autotune.json"]


def test_put_merges_entries_written_by_another_process(tmp_path):
    path = tmp_path / "autotune.json"
    k1 = cache_key("GPU", "syrk", 1024, 1024, "bf16", "3")
    k2 = cache_key("GPU", "symm", 2048, 2048, "bf16", "3")
    mine = autotune.AutotuneCache(path)
    assert mine.get(k1) is None  # loaded (empty) before the other process writes
    autotune.AutotuneCache(path).put(k1, _entry())
    mine.put(k2, _entry(block=64))
    assert set(autotune.read_cache_file(path)) == {k1, k2}


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": "other", "entries": {}}', ""])
def test_corrupt_cache_is_ignored_with_a_warning_and_rebuilt(tmp_path, text):
    path = tmp_path / "autotune.json"
    path.write_text(text)
    cache = autotune.AutotuneCache(path)
    with pytest.warns(UserWarning, match="ignoring corrupt autotune cache"):
        assert cache.entries == {}
    key = cache_key("GPU", "syrk", 64, 64, "fp32", "3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache.put(key, _entry())
    assert autotune.read_cache_file(path) == {key: _entry()}


def test_bad_entry_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "autotune.json"
    good = cache_key("GPU", "syrk", 64, 64, "fp32", "3")
    doc = {"format": autotune.CACHE_FORMAT, "entries": {
        good: _entry().to_dict(), "bad|key": _entry().to_dict(),
        cache_key("GPU", "syrk", 128, 64, "fp32", "3"): {"config": {"block": 128}, "time_s": 1, "rel_err": 0,
                                                          "shape": [1, 1, 1]}}}
    path.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="ignoring bad autotune cache entry"):
        assert list(autotune.read_cache_file(path)) == [good]


def test_search_picks_the_fastest_verified_config_with_a_fake_timer():
    cfgs = [TileConfig(128, 64, 3, 8), TileConfig(64, 32, 4, 4), TileConfig(128, 32, 4, 8),
            TileConfig(64, 64, 2, 4)]
    ref = torch.arange(1.0, 5.0)
    fake_time = {cfgs[0]: 3.0, cfgs[1]: 1.0, cfgs[2]: 2.0, cfgs[3]: 0.5}
    last = {}

    def run(cfg):
        last["cfg"] = cfg
        if cfg == cfgs[1]:
            return ref * 1.5  # fastest but wrong: must be rejected
        if cfg == cfgs[3]:
            raise RuntimeError("out of resources: shared memory")
        return ref + 1e-7

    def timer(fn):
        fn()
        return fake_time[last["cfg"]]

    cfg, t, err = autotune.search(cfgs, run, ref, timer, tol=1e-4)
    assert (cfg, t) == (cfgs[2], 2.0) and err < 1e-6
    with pytest.raises(RuntimeError, match="no Triton config passed verification.*rel err.*out of resources"):
        autotune.search(cfgs[1:2] + cfgs[3:], run, ref, timer, tol=1e-4)


def test_auto_threshold_is_data_driven():
    tv = "3.6.0"

    def key(n, m=4096, gpu="H200", dtype="bf16", op="syrk"):
        return cache_key(gpu, op, n, m, dtype, tv)

    assert autotune.auto_min_n({}, "H200", "bf16", tv) == autotune.DEFAULT_AUTO_MIN_N
    assert autotune.auto_min_n({}, "H200", "fp32", tv) == float("inf")  # torch until measured
    entries = {key(512): _entry(2e-3, 1e-3), key(1024): _entry(2e-3, 1e-3), key(2048): _entry(1e-3, 2e-3),
               key(4096): _entry(1e-3, 2e-3), key(8192, gpu="A100"): _entry(9.0, 1.0)}
    assert autotune.auto_min_n(entries, "H200", "bf16", tv) == 1025
    entries[key(1024)] = _entry(1e-3, 2e-3)  # measured: Triton already wins at n in (512, 1024]
    assert autotune.auto_min_n(entries, "H200", "bf16", tv) == 513
    assert autotune.auto_min_n(entries, "A100", "bf16", tv) == float("inf")  # torch won the largest
    assert autotune.auto_min_n({key(4096): _entry(1e-3, 2e-3)}, "H200", "bf16", tv) == 1025
    # the exact shape class decides when it was measured, the threshold otherwise
    assert autotune.prefers_triton(entries, key(512), 512, "H200", "bf16", tv) is False
    assert autotune.prefers_triton(entries, key(3000, 3000), 3000, "H200", "bf16", tv) is True
    assert autotune.prefers_triton(entries, key(300, 3000), 300, "H200", "bf16", tv) is False


def test_config_for_tunes_once_per_shape_class_then_reads_the_cache(tmp_path, monkeypatch):
    from dmuon.kernels import triton_ops

    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_ops, "INTERPRETED", False)
    monkeypatch.setattr(triton_ops, "gpu_name", lambda device: "FakeGPU")
    calls = []

    def fake_tune(op, shape, dtype, device):
        calls.append((op, shape))
        return _entry(block=64)

    monkeypatch.setattr(triton_ops, "_tune", fake_tune)
    p = torch.zeros(2, 300, 1000)
    assert triton_ops.config_for("syrk", p, 1000) == TileConfig(64, 64, 4, 8)
    assert triton_ops.config_for("syrk", torch.zeros(1, 260, 900), 900) == TileConfig(64, 64, 4, 8)
    assert calls == [("syrk", (2, 300, 1000))]  # the second shape is in the same class
    stored = autotune.read_cache_file(tmp_path / "autotune.json")
    assert list(stored) == [cache_key("FakeGPU", "syrk", 300, 1000, "fp32", __import__("triton").__version__)]
    monkeypatch.setenv("DMUON_AUTOTUNE", "0")
    assert triton_ops.config_for("symm", torch.zeros(1, 4096, 4096), 4096) == default_config("fp32", 4096)
    assert len(calls) == 1


# ---- bench command and GPU-check dry run -----------------------------------------------------------
def test_bench_kernels_cli_json_on_cpu(capsys):
    from harness.cli import main

    rc = main(["bench", "kernels", "--json", "--shapes", "qwen", "--scale", "32", "--repeats", "1",
               "--device", "cpu"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    shape_rows = [r for r in rows if r["kind"] == "shape"]
    assert {(r["n"], r["m"]) for r in shape_rows} == {(16, 112), (112, 112), (112, 592)}
    assert all(r["scale"] == 32 and r["device"] == "cpu" and r["syrk_s"] is None for r in shape_rows)
    assert all(r["standard_ns_s"] > 0 and r["gram_ns_torch_s"] > 0 for r in shape_rows)
    (batch,) = [r for r in rows if r["kind"] == "batch"]
    assert batch["batch"] == 28
    assert batch["batch_speedup"] == pytest.approx(batch["loop_s"] / batch["batched_s"])


def test_bench_kernels_rejects_bad_options(capsys):
    from harness.cli import main

    assert main(["bench", "kernels", "--shapes", "llama"]) == 2
    assert main(["bench", "kernels", "--dtype", "fp16", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown shape set 'llama'; accepted: qwen, wall-oss, squares, all" in err
    assert "fp16 matmuls on the CPU" in err


def test_gpu_check_script_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "DMUON_GPU_CHECK_CPU": "1", "DMUON_GPU_CHECK_RESULTS": str(tmp_path),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = (tmp_path / "gpu_check.log").read_text()
    assert "selfcheck on cpu: 5/5 passed" in log and "all steps passed" in log
    import csv

    with open(tmp_path / "cpu_dryrun_kernels.csv") as f:
        bench = list(csv.DictReader(f))
    assert {r["kind"] for r in bench} == {"shape", "batch"} and all(r["scale"] == "64" for r in bench)
    from dmuon.plan.profile_io import read_profile

    ns = [r for r in read_profile(tmp_path / "cpu_dryrun_profile.csv") if r.op == "ns"]
    assert {(r.rows, r.cols, r.batch, r.method) for r in ns} == {
        (n, m, b, meth) for n, m in [(8, 24), (16, 40)] for b in (1, 2) for meth in ("standard", "gram")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the CUDA tests compile and run the kernels")
def test_kernel_compiles_for_hopper_with_wgmma_and_no_spills(tmp_path):
    """Ahead-of-time compile for sm_90 (no GPU needed): tensor-core wgmma in the PTX, no register spills."""
    code = (
        "from dmuon.kernels.compile_check import compile_variant\n"
        "from dmuon.kernels.configs import TileConfig\n"
        "for op, dtype, even in [('syrk', 'bf16', True), ('symm', 'fp16', False)]:\n"
        "    r = compile_variant(op, dtype, TileConfig(128, 64, 4, 8), even=even, arch=90)\n"
        "    print(r.wgmma, r.mma_sync, int(r.spills), r.shared_bytes, bool(r.ptxas))\n")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=240)
    if res.returncode != 0 and ("ImportError" in res.stderr or "ModuleNotFoundError" in res.stderr):
        pytest.skip(f"this Triton has no ahead-of-time compile API: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr[-3000:]
    for line in res.stdout.split("\n")[:2]:
        wgmma, mma_sync, spills, smem, ptxas_ran = line.split()
        assert int(wgmma) > 0 and int(mma_sync) == 0 and spills == "0" and ptxas_ran == "True"
        assert int(smem) <= 228 * 1024  # fits an H100/H200 SM
