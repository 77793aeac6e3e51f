"""Tests of dmuon.orthogonalize: Gram NS == standard NS, the polynomial map on singular values,
batching, orientation, orthogonalize_many, dtypes, coefficient schedules, and bad input."""

from __future__ import annotations

import pytest
import torch

import dmuon
from dmuon.errors import InputError
from dmuon.newton_schulz import (
    JORDAN,
    POLAR_EXPRESS_RAW,
    coefficient_schedule,
    iteration_dtype,
    orthogonalize,
    orthogonalize_many,
    resolve_method,
)

SHAPES = [(32, 32), (24, 80), (80, 24), (3, 16, 40), (2, 2, 12, 30), (4, 20, 20)]
COEFFS = ["jordan", "polar_express"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randn(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


# ---- Gram NS == standard NS ----------------------------------------------------------------------
@pytest.mark.parametrize("coefficients", COEFFS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gram_equals_standard_fp64(shape, coefficients):
    G = randn(*shape)
    std = orthogonalize(G, method="standard", coefficients=coefficients, dtype="fp64")
    gram = orthogonalize(G, method="gram", coefficients=coefficients, dtype="fp64")
    assert rel(gram, std) <= 1e-10


@pytest.mark.parametrize("coefficients", COEFFS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gram_equals_standard_fp32(shape, coefficients):
    G = randn(*shape, dtype=torch.float32)
    std = orthogonalize(G, method="standard", coefficients=coefficients)
    gram = orthogonalize(G, method="gram", coefficients=coefficients)
    assert std.dtype == gram.dtype == torch.float32
    assert rel(gram, std) <= 1e-3


@pytest.mark.parametrize("restart", [(), (2,), (1, 3), (7,)])
def test_gram_restart_schedules_agree_in_fp64(restart):
    G = randn(20, 60)
    ref = orthogonalize(G, method="standard", dtype="fp64")
    assert rel(orthogonalize(G, method="gram", dtype="fp64", restart=restart), ref) <= 1e-10


def test_out_of_range_restart_is_no_restart():
    G = randn(20, 60, dtype=torch.float32)
    a = orthogonalize(G, method="gram", restart=(7, 0))
    b = orthogonalize(G, method="gram", restart=())
    assert torch.equal(a, b)
    assert not torch.equal(a, orthogonalize(G, method="gram", restart=(2,)))


# ---- the polynomial map on singular values -------------------------------------------------------
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("coefficients", COEFFS)
def test_singular_values_follow_the_polynomial(method, coefficients):
    G = randn(20, 50, seed=3)
    s = torch.linalg.svdvals(G / (G.norm() + 1e-7))
    for a, b, c in coefficient_schedule(coefficients, 5):
        s = a * s + b * s**3 + c * s**5
    out = orthogonalize(G, method=method, coefficients=coefficients, dtype="fp64")
    got = torch.linalg.svdvals(out)
    assert torch.allclose(torch.sort(got).values, torch.sort(s).values, rtol=0, atol=1e-10)


def test_singular_value_ranges_gaussian_512x2688():
    G = randn(512, 2688, dtype=torch.float32, seed=1)
    spread = {}
    for coefficients, lo, hi in (("polar_express", 0.8, 1.15), ("jordan", 0.6, 1.25)):
        s = torch.linalg.svdvals(orthogonalize(G, method="standard", coefficients=coefficients).double())
        assert lo <= s.min().item() and s.max().item() <= hi, (coefficients, s.min().item(), s.max().item())
        spread[coefficients] = (s.max() - s.min()).item()
    assert spread["polar_express"] < spread["jordan"]


# ---- batching and orientation --------------------------------------------------------------------
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_batched_equals_loop(method):
    G = randn(5, 12, 30, dtype=torch.float32)
    batched = orthogonalize(G, method=method)
    loop = torch.stack([orthogonalize(g, method=method) for g in G])
    assert torch.allclose(batched, loop, rtol=0, atol=1e-6)
    G4 = G.reshape(5, 1, 12, 30)
    assert torch.allclose(orthogonalize(G4, method=method), batched.reshape(5, 1, 12, 30), rtol=0, atol=1e-6)


def test_batch_normalizes_each_matrix():
    G = randn(3, 10, 20, dtype=torch.float32)
    G[1] *= 1000.0
    out = orthogonalize(G)
    for i in range(3):
        assert torch.allclose(out[i], orthogonalize(G[i]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_tall_equals_transposed_wide(method):
    G = randn(70, 25, dtype=torch.float32)
    tall = orthogonalize(G, method=method)
    wide = orthogonalize(G.T.contiguous(), method=method)
    assert tall.shape == (70, 25) and tall.is_contiguous()
    assert torch.allclose(tall, wide.T, rtol=0, atol=1e-6)


def test_zero_matrix_gives_zero():
    for method in ("standard", "gram"):
        out = orthogonalize(torch.zeros(6, 9), method=method)
        assert torch.isfinite(out).all() and torch.equal(out, torch.zeros(6, 9))
        stack = torch.stack([torch.zeros(6, 9), randn(6, 9, dtype=torch.float32)])
        out = orthogonalize(stack, method=method)
        assert torch.equal(out[0], torch.zeros(6, 9)) and out[1].abs().sum() > 0


def test_orthogonalize_many_order_and_values():
    shapes = [(8, 20), (20, 8), (8, 20), (16, 16), (8, 20), (16, 16), (5, 7)]
    mats = [randn(*s, dtype=torch.float32, seed=i) for i, s in enumerate(shapes)]
    mats.append(randn(8, 20, dtype=torch.float64, seed=99))
    one_by_one = [orthogonalize(m) for m in mats]
    for kwargs in ({}, {"max_batch": 2}, {"merge_transposed": True}):
        out = orthogonalize_many(mats, **kwargs)
        assert [o.shape for o in out] == [m.shape for m in mats]
        assert [o.dtype for o in out] == [m.dtype for m in mats]
        for o, ref in zip(out, one_by_one, strict=True):
            assert torch.allclose(o, ref, rtol=0, atol=1e-6)
    assert orthogonalize_many([]) == []


def test_orthogonalize_many_passes_options_through():
    mats = [randn(10, 30, seed=i) for i in range(3)]
    out = orthogonalize_many(mats, method="gram", coefficients="polar_express", dtype="fp64")
    for o, m in zip(out, mats, strict=True):
        ref = orthogonalize(m, method="standard", coefficients="polar_express", dtype="fp64")
        assert rel(o, ref) <= 1e-10


def test_orthogonalize_reshaped_conv_weight():
    W = randn(8, 3, 3, 3, dtype=torch.float32)
    out = dmuon.orthogonalize_reshaped(W)
    assert out.shape == W.shape
    assert torch.equal(out, orthogonalize(W.reshape(8, 27)).reshape(W.shape))
    assert dmuon.as_matrix(W).shape == (8, 27)


# ---- dtypes, methods, coefficients ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_output_dtype_is_input_dtype(dtype):
    G = randn(12, 30).to(dtype)
    out = orthogonalize(G)
    assert out.dtype == dtype and out.shape == G.shape


@pytest.mark.parametrize("method, it_dtype, tol", [("standard", "bf16", 5e-2), ("gram", "fp16", 2e-2),
                                                   ("gram", torch.float16, 2e-2)])
def test_half_precision_iteration_is_close(method, it_dtype, tol):
    G = randn(16, 48, dtype=torch.float32)
    ref = orthogonalize(G, method="standard", dtype="fp64")
    out = orthogonalize(G, method=method, dtype=it_dtype)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert 1e-5 < rel(out, ref) <= tol  # really iterated in half precision, and still close


def test_default_iteration_dtype():
    assert iteration_dtype("standard", torch.device("cpu")) == torch.float32
    assert iteration_dtype("gram", torch.device("cpu")) == torch.float32
    assert iteration_dtype("standard", torch.device("cuda")) == torch.bfloat16
    assert iteration_dtype("gram", torch.device("cuda")) == torch.float16
    assert iteration_dtype("gram", torch.device("cuda"), "fp32") == torch.float32
    G = randn(10, 30)  # fp64 input: default iterates in fp32, so it differs from an fp64 iteration
    assert rel(orthogonalize(G), orthogonalize(G, dtype="fp64")) > 1e-12


def test_auto_method_switch():
    assert resolve_method(64, 64) == "standard"
    assert resolve_method(64, 96) == "standard"  # aspect 1.5: a tie, standard kept
    assert resolve_method(64, 100) == "gram"
    assert resolve_method(512, 2688) == "gram" and resolve_method(2688, 512) == "gram"
    assert resolve_method(64, 100, "standard") == "standard"
    G = randn(20, 60, dtype=torch.float32)
    assert torch.equal(orthogonalize(G), orthogonalize(G, method="gram"))
    S = randn(20, 22, dtype=torch.float32)
    assert torch.equal(orthogonalize(S), orthogonalize(S, method="standard"))


def test_coefficient_schedules():
    assert coefficient_schedule("jordan", 3) == (JORDAN,) * 3
    pe = coefficient_schedule("polar_express", 7)
    a, b, c = POLAR_EXPRESS_RAW[0]
    assert pe[0] == pytest.approx((a / 1.05, b / 1.05**3, c / 1.05**5), rel=1e-15)
    assert len(pe) == 7 and pe[5] == pe[6] == pe[4]
    assert coefficient_schedule("polar_express", 2) == pe[:2]
    assert coefficient_schedule((3.0, -3.2, 1.2), 4) == ((3.0, -3.2, 1.2),) * 4
    assert coefficient_schedule([(2, -1, 0.5), (1.5, -0.5, 0)], 3) == ((2.0, -1.0, 0.5), (1.5, -0.5, 0.0),
                                                                          (1.5, -0.5, 0.0))
    G = randn(10, 30)
    custom = orthogonalize(G, coefficients=[JORDAN] * 5, dtype="fp64")
    assert torch.equal(custom, orthogonalize(G, coefficients="jordan", dtype="fp64"))


def test_nsconfig():
    cfg = dmuon.NSConfig(method="gram", coefficients=[(3.4445, -4.7750, 2.0315)], steps=4, dtype="fp64",
                         restart=[2])
    assert cfg.restart == (2,) and hash(cfg) == hash(cfg)
    G = randn(10, 40)
    assert torch.equal(cfg.orthogonalize(G), orthogonalize(G, **cfg.kwargs()))
    assert cfg.method_for(10, 12) == "gram"
    assert dmuon.NSConfig().method_for(10, 12) == "standard"
    out = cfg.orthogonalize_many([G, G.T])
    assert torch.allclose(out[1], out[0].T, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        dmuon.NSConfig(method="fast")
    with pytest.raises(ValueError, match="unknown kernels 'cuda'; accepted: auto, torch, triton"):
        dmuon.NSConfig(kernels="cuda")


# ---- the Triton ops path (interpreter on CPU) ----------------------------------------------------
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_triton_kernels_path_matches_torch(method):
    G = randn(2, 16, 40, dtype=torch.float32)
    ref = orthogonalize(G, method=method, kernels="torch")
    out = orthogonalize(G, method=method, kernels="triton")
    assert rel(out, ref) <= 1e-4


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, exc, message", [
    (torch.randn(5), ValueError, "got a 1-D tensor"),
    (torch.tensor(1.0), ValueError, "got a 0-D tensor"),
    (torch.zeros(0, 4), ValueError, "empty tensor"),
    (torch.ones(3, 4, dtype=torch.int64), TypeError, "floating-point tensor"),
    (torch.ones(3, 4, dtype=torch.complex64), TypeError, "floating-point tensor"),
    ([[1.0, 2.0]], TypeError, "expects a torch.Tensor, got list"),
])
def test_bad_input(bad, exc, message):
    with pytest.raises(exc, match=message):
        orthogonalize(bad)


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"method": "svd"}, ValueError, "unknown method 'svd'; accepted: 'auto', 'standard', 'gram'"),
    ({"coefficients": "muon"}, ValueError, "accepted: 'jordan', 'polar_express'"),
    ({"coefficients": [(1.0, 2.0)]}, ValueError, "triple of real numbers"),
    ({"coefficients": []}, ValueError, "non-empty sequence"),
    ({"steps": 0}, ValueError, "steps must be a positive integer"),
    ({"steps": 2.5}, ValueError, "steps must be a positive integer"),
    ({"dtype": "fp8"}, ValueError, "accepted: 'bf16', 'fp16', 'fp32', 'fp64'"),
    ({"dtype": torch.int32}, ValueError, "must be bfloat16, float16, float32 or float64"),
    ({"dtype": 32}, TypeError, "dtype must be None, a torch.dtype or a string"),
    ({"restart": (-1,)}, ValueError, "non-negative step indices"),
    ({"restart": "2"}, ValueError, "non-negative step indices"),
    ({"kernels": "cuda"}, ValueError, "unknown kernels 'cuda'; accepted: auto, torch, triton"),
])
def test_bad_options(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        orthogonalize(torch.randn(4, 6), **kwargs)


def test_orthogonalize_many_bad_input():
    with pytest.raises(ValueError, match=r"2-D matrices; item 1 has shape \(2, 3, 4\)"):
        orthogonalize_many([torch.randn(3, 4), torch.randn(2, 3, 4)])
    with pytest.raises(TypeError, match="item 0 is ndarray"):
        orthogonalize_many([torch.randn(3, 4).numpy()])
    with pytest.raises(ValueError, match="max_batch must be a positive integer"):
        orthogonalize_many([torch.randn(3, 4)], max_batch=0)
    with pytest.raises(ValueError, match="at least 2 dims"):
        dmuon.as_matrix(torch.randn(4))


# ---- which orientation the iteration runs in -------------------------------------------------------
@pytest.mark.parametrize("method, kernels", [("standard", "torch"), ("gram", "torch"), ("auto", "torch"),
                                             ("standard", "triton"), ("auto", "auto")])
def test_iterates_tall_as_is_says_what_orthogonalize_does(monkeypatch, method, kernels):
    """The runtime stacks a batch's tall members apart only where `iterates_tall_as_is` says the NS runs
    them untransposed: it must agree with what `orthogonalize` does (the transpose at normalization)."""
    import dmuon.newton_schulz as ns

    seen = []
    real = ns.normalize

    def spy(x, **kw):
        seen.append(kw.get("transpose", False))
        return real(x, **kw)

    monkeypatch.setattr(ns, "normalize", spy)
    answers = set()
    for rows, cols in [(80, 24), (30, 28)]:  # auto: Gram for the first, standard for the second
        seen.clear()
        ns.orthogonalize(randn(rows, cols, dtype=torch.float32), method=method, kernels=kernels)
        as_is = ns.iterates_tall_as_is(cols, rows, "cpu", method=method, kernels=kernels)
        other = ns.iterates_tall_as_is(rows, cols, "cpu", method=method, kernels=kernels)
        assert as_is == (not seen[0]) == other
        answers.add(as_is)
    torch_here = kernels != "triton"  # 'auto' keeps torch on a CPU: both methods iterate tall as it is
    assert answers == {torch_here}


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_out_dtype_keeps_the_iteration_result_with_the_same_bits(method):
    """out_dtype = the iteration dtype: the result as the iteration left it, whose conversion gives the
    default result's bits (what the fsdp2-sharded owners send back); tall and wide inputs alike."""
    import dmuon.newton_schulz as ns

    for shape in [(3, 40, 20), (3, 20, 40)]:
        g = randn(*shape, dtype=torch.float32)
        full = ns.orthogonalize(g, method=method, dtype="bf16")
        kept = ns.orthogonalize(g, method=method, dtype="bf16", out_dtype=torch.bfloat16)
        assert full.dtype == torch.float32 and kept.dtype == torch.bfloat16
        assert torch.equal(kept.float(), full)
    assert ns.lossless_narrower(torch.bfloat16, torch.float32)
    assert not ns.lossless_narrower(torch.bfloat16, torch.float16)
    assert not ns.lossless_narrower(torch.float32, torch.float32)
    with pytest.raises(InputError, match="accepted: 'bf16', 'fp16', 'fp32', 'fp64'"):
        ns.orthogonalize(randn(4, 6, dtype=torch.float32), out_dtype="int8")


def test_normalize_takes_the_plain_formula_on_a_cpu_where_the_norm_is_safe():
    """On a CPU, X / (||X|| + eps) in one division where every norm is finite and >= DIRECT_NORM_MIN;
    overflowing, underflowing and zero matrices go the scaled way (and still give the formula's value)."""
    import dmuon.newton_schulz as ns

    x = randn(3, 20, 30, dtype=torch.float32)
    plain = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + ns.NORM_EPS)
    assert torch.equal(ns.normalize(x), plain)
    assert torch.equal(ns.normalize(x, dtype=torch.bfloat16, transpose=True), plain.mT.bfloat16())
    for factor in (1e25, 1e-25):  # the norm overflows to inf / the squares underflow to (near) zero
        y = x * factor
        assert not bool((torch.isfinite(torch.linalg.vector_norm(y, dim=(-2, -1)))
                         & (torch.linalg.vector_norm(y, dim=(-2, -1)) >= ns.DIRECT_NORM_MIN)).all())
        exact = y.double() / (torch.linalg.vector_norm(y.double(), dim=(-2, -1), keepdim=True) + ns.NORM_EPS)
        torch.testing.assert_close(ns.normalize(y), exact.float(), rtol=1e-5, atol=0)
    z = torch.cat([x, torch.zeros(1, 20, 30)])  # a zero matrix in the batch: scaled way, zero result
    out = ns.normalize(z)
    assert not out[3].any()
    torch.testing.assert_close(out[:3], plain, rtol=1e-6, atol=1e-8)
