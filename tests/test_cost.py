"""Cost table: measured points, interpolation, extrapolation, borrowing, errors; the curve fit; the CSV."""

from __future__ import annotations

import math
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon.errors import InputError
from dmuon.plan import cost as cost_mod
from dmuon.plan.cost import CostTable, available_profiles
from dmuon.plan.fit import Curve, fit_curve
from dmuon.plan.flops import METHODS, ns_flops
from dmuon.plan.profile_io import ProfileRow, read_profile, write_profile


@pytest.fixture(scope="module")
def a800():
    return CostTable.load("a800")


def test_measured_points_are_returned_exactly(a800):
    rows = [r for r in read_profile(cost_mod.PROFILES_DIR / "a800.csv") if r.op == "ns"]
    assert len(rows) == 26
    for r in rows:
        for shape in ((r.rows, r.cols), (r.cols, r.rows)):  # a matrix and its transpose cost the same
            a = a800.ns_time(*shape, r.batch, r.method, r.dtype)
            assert a.measured and a.time_s == r.time_s and "measured" in a.detail
    a = a800.ns_time(8192, 2048, 1, "gram", "fp16")
    assert a.time_s == pytest.approx(2787e-6, rel=1e-12)


def test_same_width_same_peak_dtype_borrows_the_point_but_says_so(a800):
    fp16 = a800.ns_time(3584, 18944, 1, "gram_sym", "fp16")
    bf16 = a800.ns_time(3584, 18944, 1, "gram_sym", "bf16")
    assert bf16.time_s == fp16.time_s and not bf16.measured and "fp16 point used" in bf16.detail


def _synthetic(times_by_batch: dict[int, float], device="a800") -> CostTable:
    rows = [
        ProfileRow(device, "ns", 1024, 4096, b, "gram", "bf16", t, "test") for b, t in times_by_batch.items()
    ]
    # enough other shapes for a curve fit of its own
    for n in (512, 2048, 3072, 4096):
        f = ns_flops(n, 4 * n, "gram")
        rows.append(ProfileRow(device, "ns", n, 4 * n, 1, "gram", "bf16", 2e-5 + f / 2e14, "test"))
    return CostTable.from_rows("synthetic", rows)


def test_interpolation_between_measured_batches_is_log_linear_and_monotone():
    table = _synthetic({1: 1.0e-3, 2: 1.4e-3, 4: 2.2e-3, 8: 4.0e-3})
    t = [table.ns_time(1024, 4096, b, "gram", "bf16").time_s for b in range(1, 17)]
    assert all(x < y for x, y in zip(t, t[1:], strict=False)), (
        t
    )  # monotone in FLOPs (FLOPs grow with the batch)
    t3 = table.ns_time(1024, 4096, 3, "gram", "bf16")
    expect = math.exp(
        math.log(1.4e-3)
        + (math.log(3) - math.log(2)) / (math.log(4) - math.log(2)) * (math.log(2.2e-3) - math.log(1.4e-3))
    )
    assert not t3.measured and t3.time_s == pytest.approx(expect, rel=1e-12) and "interpolation" in t3.detail
    t16 = table.ns_time(1024, 4096, 16, "gram", "bf16")
    assert t16.time_s > 4.0e-3 and "scaled along the fitted curve" in t16.detail  # never flat


@pytest.mark.parametrize("method", METHODS)
def test_extrapolation_grows_with_flops(a800, method):
    prev = 0.0
    for k in (0.25, 0.5, 1, 2, 4, 8):  # unmeasured shapes far below and above the profile's range
        n, m = int(1000 * k), int(5000 * k)
        a = a800.ns_time(n, m, 1, method, "bf16")
        assert not a.measured and a.time_s > prev
        assert a.time_s >= ns_flops(n, m, method) / a800.peak_flops("bf16")  # never beats the datasheet peak
        prev = a.time_s
    batches = [a800.ns_time(2048, 8192, b, method, "bf16").time_s for b in range(1, 12)]
    assert all(x < y for x, y in zip(batches, batches[1:], strict=False))


def test_batching_helps_small_matrices_more_than_large(a800):
    def gain(n, m):
        return 8 * a800.ns_time(n, m, 1, "gram", "bf16").time_s / a800.ns_time(n, m, 8, "gram", "bf16").time_s

    assert gain(256, 1024) > gain(7168, 18432) >= 1.0
    assert gain(256, 1024) > 1.3


def test_standard_method_is_calibrated_and_says_so(a800):
    a = a800.ns_time(2048, 16384, 1, "standard", "bf16")
    assert "calibrated" in a.detail and "pi0" in a.detail


@given(
    t0=st.floats(0, 1e-3),
    a=st.floats(0, 1e-14),
    c=st.floats(0, 1e-9),
    k=st.sampled_from((0.05, 0.5, 0.95)),
    w=st.floats(1e6, 1e14),
    factor=st.floats(1.001, 100),
)
@settings(max_examples=60, deadline=None)
def test_curve_is_increasing_and_efficiency_at_most_one(t0, a, c, k, w, factor):
    curve = Curve(3e14, t0, a, c, k)
    assert curve.time_s(w * factor) > curve.time_s(w)
    assert curve.efficiency(w) <= 1.0 + 1e-12


def test_fit_recovers_a_known_curve():
    truth = Curve(3e14, 5e-5, 2e-16, 3e-12, 0.3)
    work = [10 ** (9 + 0.25 * i) for i in range(16)]
    fitted = fit_curve(work, [truth.time_s(w) for w in work], 3e14)
    assert fitted.rms_rel_error < 0.01
    for w in work:
        assert fitted.time_s(w) == pytest.approx(truth.time_s(w), rel=0.02)
    with pytest.raises(ValueError, match="at least 4"):
        fit_curve(work[:3], [1.0, 2.0, 3.0], 1e12)


def test_unknown_names_list_the_accepted_values(a800):
    with pytest.raises(InputError, match=r"unknown profile 'nope'; accepted: .*a800.*cpu"):
        CostTable.load("nope")
    with pytest.raises(
        InputError, match=r"unknown method 'newton'; accepted: standard, standard_sym, gram, gram_sym"
    ):
        a800.ns_time(64, 64, 1, "newton")
    with pytest.raises(InputError, match=r"unknown dtype 'fp8'; accepted: bf16, fp16, fp32"):
        a800.ns_time(64, 64, 1, "gram", "fp8")
    with pytest.raises(InputError, match=r"unknown elementwise op 'sgd'; accepted: muon_momentum, adamw"):
        a800.elementwise_time(100, "sgd")
    with pytest.raises(InputError, match="batch must be a positive integer"):
        a800.ns_time(64, 64, 0)
    with pytest.raises(InputError, match="does not exist"):
        CostTable.load("/no/such/profile.csv")
    assert {"a800", "cpu", "h100", "h200-roofline"} <= set(available_profiles())


def test_unmeasured_h200_is_a_clear_error_until_its_file_exists(tmp_path, monkeypatch):
    for name in ("hardware.csv", "a800.csv", "cpu.csv"):
        shutil.copy(cost_mod.PROFILES_DIR / name, tmp_path / name)
    monkeypatch.setattr(cost_mod, "PROFILES_DIR", tmp_path)
    cost_mod._load_unborrowed.cache_clear()
    try:
        with pytest.raises(
            InputError, match=r"profile 'h200' is not measured yet.*gpu_check\.sh.*h200-roofline"
        ):
            CostTable.load("h200")
        assert "h200" not in available_profiles()
        roof = CostTable.load("h200-roofline")
        assert "borrowed from the a800 profile" in roof.ns_time(4096, 4096, 1, "gram", "bf16").detail
    finally:
        cost_mod._load_unborrowed.cache_clear()


def test_gpu_without_points_borrows_the_nearest_profile(a800):
    h100 = CostTable.load("h100")
    assert h100.name == "h100 datasheet roofline"
    a = h100.ns_time(3584, 18944, 1, "gram_sym", "bf16")
    assert not a.measured and "borrowed from the a800 profile" in a.detail
    assert a.time_s < a800.ns_time(3584, 18944, 1, "gram_sym", "bf16").time_s  # 989 vs 312 TFLOP/s
    e = h100.elementwise_time(10**8, "adamw")
    assert "borrowed from the a800 profile" in e.detail
    assert e.time_s < a800.elementwise_time(10**8, "adamw").time_s  # 3.35 vs 2.04 TB/s


def test_cpu_prices_gram_sym_as_the_torch_gram_it_runs_and_says_so():
    # kernels='auto' keeps fp32 on torch (no measured Triton win), so gram_sym runs dense gram
    cpu = CostTable.load("cpu")
    a, g = cpu.ns_time(224, 1184, 1, "gram_sym", "fp32"), cpu.ns_time(224, 1184, 1, "gram", "fp32")
    assert g.measured and a.time_s == g.time_s and "gram_sym runs as gram" in a.detail


@pytest.mark.parametrize("n, dense", [(256, True), (1024, True), (1025, False), (2048, False)])
def test_symmetric_methods_priced_as_what_auto_dispatch_runs(a800, n, dense):
    # published (muon.md): plain cuBLAS wins for n <= 1024, so kernels='auto' runs torch there
    from dmuon.plan.flops import DEFAULT_AUTO_MIN_N, dispatched_method

    assert DEFAULT_AUTO_MIN_N == 1025
    for sym, plain in (("gram_sym", "gram"), ("standard_sym", "standard")):
        assert (dispatched_method(sym, n, 4096, "bf16") == plain) == dense
        assert dispatched_method(sym, 4096, n, "fp32") == plain  # fp32: torch until measured
        s, p = a800.ns_time(n, 4096, 2, sym, "bf16"), a800.ns_time(n, 4096, 2, plain, "bf16")
        assert (s.time_s == p.time_s) == dense
        assert (f"{sym} runs as {plain}" in s.detail) == dense
    assert dispatched_method("gram", 64, 64, "bf16") == "gram"


def test_elementwise_points_interpolation_and_model(a800):
    rows = [r for r in read_profile(cost_mod.PROFILES_DIR / "a800.csv") if r.op == "adamw"]
    for r in rows:
        assert a800.elementwise_time(r.numel, "adamw", r.dtype).time_s == r.time_s
    m = [a800.elementwise_time(10**e, "muon_momentum").time_s for e in range(4, 11)]
    assert all(x < y for x, y in zip(m, m[1:], strict=False))
    # no muon_momentum points on the A800: priced by the curve fitted to the AdamW points, and says so
    assert "shared fit to 4 elementwise points" in a800.elementwise_time(10**6, "muon_momentum").detail


def test_a_pass_split_over_tensors_costs_the_measured_extra_per_tensor():
    one = [ProfileRow("cpu", "adamw", n, 1, 1, "", "fp32", t, "test")
           for n, t in ((1 << 16, 1e-5), (1 << 20, 1e-4), (1 << 22, 4e-4))]
    # the same 4M elements in 8 and in 64 tensors: 10 us and 12 us per extra tensor; the slope through
    # the origin weighs the 64-tensor split by 63 / 7 over the 8-tensor one
    split = [ProfileRow("cpu", "adamw", 1 << 22, 1, 8, "", "fp32", 4e-4 + 7 * 10e-6, "test"),
             ProfileRow("cpu", "adamw", 1 << 22, 1, 64, "", "fp32", 4e-4 + 63 * 12e-6, "test")]
    table = CostTable.from_rows("split", one + split)
    per = (7 * 7 * 10e-6 + 63 * 63 * 12e-6) / (7 * 7 + 63 * 63)
    assert table.per_tensor_time("adamw") == pytest.approx(per) and 11.9e-6 < per < 12e-6
    assert table.elementwise_time(1 << 22, "adamw").time_s == 4e-4  # the one-tensor row is kept as is
    a = table.elementwise_time(1 << 20, "adamw", tensors=39)
    assert a.time_s == pytest.approx(1e-4 + 38 * per) and "38 extra tensors" in a.detail and not a.measured
    assert table.per_tensor_time("grad_prep") == 0.0  # no split rows: no extra cost
    faster = CostTable.from_rows("faster", one + [ProfileRow("cpu", "adamw", 1 << 22, 1, 8, "", "fp32", 3e-4,
                                                             "test")])
    assert faster.per_tensor_time("adamw") == 0.0  # noise below the one-tensor time: never negative
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InputError, match="tensors must be a positive integer"):
            table.elementwise_time(1 << 20, "adamw", tensors=bad)


def test_shipped_a800_profile_is_what_the_derive_script_writes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "derive", cost_mod.PROFILES_DIR.parents[2] / "scripts" / "derive_a800_profile.py"
    )
    derive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(derive)
    out = tmp_path / "a800.csv"
    assert derive.main(["--out", str(out), "--no-plans"]) == 0
    assert out.read_text() == (cost_mod.PROFILES_DIR / "a800.csv").read_text()


def test_profile_csv_round_trip_and_bad_rows(tmp_path):
    rows = [
        ProfileRow("cpu", "ns", 64, 256, 2, "gram", "fp32", 1.5e-3, "here"),
        ProfileRow("cpu", "adamw", 4096, 1, 1, "", "fp32", 2e-5, "here"),
        ProfileRow("cpu", "model_scale", 1, 1, 1, "standard", "", 1.25, "calibration"),
    ]
    path = tmp_path / "p.csv"
    write_profile(path, rows)
    assert read_profile(path) == rows
    assert not list(tmp_path.glob(".*tmp"))  # the temp file was renamed, not left behind
    path.write_text("device,op,rows,cols,batch,method,dtype,time_s,source\ncpu,fft,1,1,1,,fp32,1,x\n")
    with pytest.raises(InputError, match=r"p\.csv:2: unknown op 'fft'; accepted: ns, muon_momentum"):
        read_profile(path)
    path.write_text("device,op,rows,cols,batch,method,dtype,time_s,source\ncpu,ns,1,1,1,gram,fp32,-1,x\n")
    with pytest.raises(InputError, match="time_s must be a positive finite number"):
        read_profile(path)
    path.write_text("device,op\ncpu,ns\n")
    with pytest.raises(InputError, match="missing column"):
        read_profile(path)


def _fp32_only_cpu_table(name: str) -> CostTable:
    from dmuon.plan.cost import PROFILES_DIR
    from dmuon.plan.profile_io import read_profile

    rows = [r for r in read_profile(PROFILES_DIR / "cpu.csv") if r.dtype == "fp32"]
    return CostTable.from_rows(name, rows)


def test_a_dtype_the_profile_lacks_is_priced_as_modelled_and_warned_once():
    import warnings

    table = _fp32_only_cpu_table("cpu-fp32-only-a")
    fp32 = table.ns_time(224, 1184, 4, "gram", "fp32")
    with pytest.warns(RuntimeWarning, match="no bf16 measurements.*priced at the measured fp32 peak"):
        bf16 = table.ns_time(224, 1184, 4, "gram", "bf16")
    assert not bf16.measured and "modelled" in bf16.detail
    assert bf16.time_s == pytest.approx(fp32.time_s, rel=0.3)  # the fp32 roofline, not the fp32 point
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per table and dtype
        table.ns_time(224, 1184, 8, "gram", "bf16")
    assert "bf16" in table.assumed_dtypes()


def test_assumed_peak_scales_the_roofline():
    table = _fp32_only_cpu_table("cpu-fp32-only-b")
    base = table.peak_flops("fp32")
    with pytest.warns(RuntimeWarning, match="measured ratio 2.5"):
        table.assume_peak("bf16", 2.5 * base, "fp32 peak x 2.5 (measured ratio 2.5)")
    slow = table.ns_time(512, 2048, 1, "standard", "fp32")
    fast = table.ns_time(512, 2048, 1, "standard", "bf16")
    assert not fast.measured and "measured ratio 2.5" in fast.detail
    assert 1.5 < slow.time_s / fast.time_s <= 2.5  # compute-bound share scales by the peak; overhead does not
    assert any("bf16: modelled" in line for line in table.describe())
    with pytest.raises(InputError, match="measured fp32"):
        table.assume_peak("fp32", base, "x")
    with pytest.raises(InputError, match="positive finite"):
        table.assume_peak("fp16", float("nan"), "x")
