"""The dmuon library under bad input and numerical extremes: unsupported dtypes and shapes, mixed devices,
models without Muon matrices, non-finite gradients, and a property test that Newton-Schulz never turns
finite input into NaN / inf (zero, tiny-norm, huge-norm, rank-1 matrices; fp16 / bf16 iterations)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dmuon
from dmuon import orthogonalize
from dmuon.errors import InputError

ROOT = Path(__file__).resolve().parent.parent


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_orthogonalize_refuses_unsupported_dtypes(dtype):
    g = torch.ones(4, 6).to(dtype)
    with pytest.raises(TypeError, match=r"floating-point tensor \(fp16, bf16, fp32, fp64\), got"):
        orthogonalize(g)


@pytest.mark.parametrize("shape, match", [
    ((5,), r"expects a matrix .* got a 1-D tensor of shape \(5,\)"),
    ((), r"got a 0-D tensor"),
    ((0, 4), r"empty tensor of shape \(0, 4\)"),
    ((3, 0, 4), r"empty tensor of shape \(3, 0, 4\)"),
])
def test_orthogonalize_refuses_vectors_and_empty_matrices(shape, match):
    with pytest.raises(InputError, match=match):
        orthogonalize(torch.ones(shape))


def test_muon_refuses_bad_matrices_at_construction():
    for p, what in ((torch.nn.Parameter(torch.ones(5)), r"shape \(5,\)"),
                    (torch.nn.Parameter(torch.ones(0, 5)), r"shape \(0, 5\)"),
                    (torch.nn.Parameter(torch.ones(4, 5).to(torch.float8_e4m3fn)), "float8_e4m3fn")):
        with pytest.raises(InputError, match=f"Muon needs non-empty real floating-point .*{what}"):
            dmuon.Muon([{"params": [p], "use_muon": True}])


def test_muon_refuses_parameters_on_mixed_devices():
    cpu = torch.nn.Parameter(torch.randn(8, 8))
    meta = torch.nn.Parameter(torch.empty(8, 8, device="meta"))
    with pytest.raises(InputError, match=r"single-device optimizer; its parameters are on cpu, meta"):
        dmuon.Muon([cpu, meta])
    opt = dmuon.Muon([cpu])
    with pytest.raises(InputError, match="single-device optimizer"):  # also when a group is added later
        opt.add_param_group({"params": [meta]})


def test_model_without_muon_matrices_falls_back_to_adamw_with_a_warning():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4))
    with pytest.warns(UserWarning, match="no parameter is a hidden matrix routed to Muon; all 3 parameters"):
        opt = dmuon.Muon(model, adamw_lr=1e-2)
    ref = torch.optim.AdamW(
        [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()], lr=1e-2, weight_decay=0.01
    )
    torch.manual_seed(0)
    model[1](model[0](torch.tensor([1, 2, 3]))).square().sum().backward()
    for p, q in zip(model.parameters(), ref.param_groups[0]["params"], strict=True):
        q.grad = p.grad.clone()
    opt.step()
    ref.step()
    for p, q in zip(model.parameters(), ref.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(p, q)  # the fallback is plain AdamW


def test_empty_matrix_in_a_module_is_routed_to_adamw():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 0))
    routes = {r.name: r for r in dmuon.route(model)}
    assert routes["0.weight"].use_muon and not routes["1.weight"].use_muon
    assert "empty matrix" in routes["1.weight"].reason


# ---- non-finite gradients -------------------------------------------------------------------------
def _model_with_grads(bad: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
    model(torch.randn(3, 6)).sum().backward()
    model[2].weight.grad[1, 2] = bad
    return model


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradient_raises_by_default_and_changes_nothing(bad):
    model = _model_with_grads(bad)
    before = [p.detach().clone() for p in model.parameters()]
    opt = dmuon.Muon(model)
    with pytest.raises(FloatingPointError, match=r"non-finite gradient \(NaN or inf\) in 2.weight; pass "
                                                 "nonfinite='skip'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.state


def test_nonfinite_gradient_skip_policy_skips_the_step_and_counts_it():
    model = _model_with_grads(math.nan)
    before = [p.detach().clone() for p in model.parameters()]
    opt = dmuon.Muon(model, nonfinite="skip")
    opt.step()
    assert opt.skipped_steps == 1 and not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for p in model.parameters():  # the next finite step runs normally
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(before[2], model[2].weight)


# ---- Newton-Schulz never turns finite input into NaN / inf -------------------------------------------
SCALES = (0.0, 1e-30, 1e-20, 1e-8, 1e-3, 1.0, 1e3, 1e8, 1e20, 1e30)


@st.composite
def ns_case(draw):
    rows, cols = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    batch = draw(st.sampled_from([(), (2,), (2, 1)]))
    kind = draw(st.sampled_from(["gaussian", "rank1", "zero", "one_entry"]))
    scale = draw(st.sampled_from(SCALES))
    in_dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
    it_dtype = draw(st.sampled_from(["fp32", "bf16", "fp16", None]))
    method = draw(st.sampled_from(["standard", "gram", "auto"]))
    seed = draw(st.integers(0, 2**16))
    return rows, cols, batch, kind, scale, in_dtype, it_dtype, method, seed


def _matrix(rows, cols, batch, kind, scale, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        g = torch.randn(*batch, rows, cols, generator=gen, dtype=torch.float64)
    elif kind == "rank1":
        g = torch.randn(*batch, rows, 1, generator=gen, dtype=torch.float64) @ torch.randn(
            *batch, 1, cols, generator=gen, dtype=torch.float64)
    elif kind == "zero":
        g = torch.zeros(*batch, rows, cols, dtype=torch.float64)
    else:
        g = torch.zeros(*batch, rows, cols, dtype=torch.float64)
        g[..., rows // 2, cols // 2] = 1.0
    return g * scale


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ns_case())
def test_newton_schulz_never_turns_finite_input_into_nan(case):
    rows, cols, batch, kind, scale, in_dtype, it_dtype, method, seed = case
    g = _matrix(rows, cols, batch, kind, scale, seed).to(in_dtype)
    if not torch.isfinite(g).all():  # the scale overflowed the input dtype itself: not a finite input
        return
    out = orthogonalize(g, method=method, dtype=it_dtype, kernels="torch")
    assert out.shape == g.shape and out.dtype == g.dtype
    assert torch.isfinite(out).all(), (case, out)
    if not g.any():
        assert not out.any()  # a zero matrix gives a zero update
    s = torch.linalg.svdvals(out.double().reshape(-1, rows, cols)).max()
    assert s < 1.5  # never larger than an orthogonal factor (NS maps singular values into ~[0.7, 1.2])


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 20), st.integers(2, 20), st.sampled_from([1e3, 1e8, 1e15, 1e20, 1e25, 1e30]),
       st.sampled_from(["standard", "gram"]), st.integers(0, 2**16))
def test_newton_schulz_is_scale_invariant_up_to_huge_norms(rows, cols, scale, method, seed):
    # fp32 entries of 1e20 square to inf: the update used to collapse to zero there. (Below ~1 the
    # 1e-7 in ||G|| + 1e-7 makes the result depend on the scale: that is the reference formula.)
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    ref = orthogonalize(g, method=method, dtype="fp32", kernels="torch")
    big = orthogonalize(g * scale, method=method, dtype="fp32", kernels="torch")
    torch.testing.assert_close(big, ref, rtol=1e-4, atol=1e-5)


def test_huge_fp64_input_is_orthogonalized():
    g = torch.randn(8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 1e300
    out = orthogonalize(g, method="standard", dtype="fp64", kernels="torch")
    s = torch.linalg.svdvals(out)
    assert torch.isfinite(out).all() and s.min() > 0.5 and s.max() < 1.3


# ---- the consistency guard is documented ------------------------------------------------------------
def test_consistency_guard_is_documented():
    text = (ROOT / "docs" / "runtime.md").read_text()
    assert "check_consistency_every" in text
    para = text[text.index("check_consistency_every"):][:600]
    assert "checksum" in para and "every K steps" in para
