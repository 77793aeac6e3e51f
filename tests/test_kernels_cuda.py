"""CUDA checks of the Triton symmetric kernels (skipped without an NVIDIA GPU).

The cases are `dmuon.kernels.selfcheck.CUDA_CASES` (the same ones scripts/gpu_check.sh runs where
pytest is missing): bf16/fp16 within 1e-2 relative of float64, fp32 within 1e-5 (5e-3 under tf32),
outputs exactly symmetric; plus autotuning into a fresh cache and the 'auto' choice.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.fixture(scope="module", autouse=True)
def _fresh_cache(tmp_path_factory):
    """One empty autotune cache for this module: each shape class is tuned (and verified) once."""
    old = os.environ.get("DMUON_CACHE_DIR")
    os.environ["DMUON_CACHE_DIR"] = str(tmp_path_factory.mktemp("autotune"))
    yield
    if old is None:
        os.environ.pop("DMUON_CACHE_DIR")
    else:
        os.environ["DMUON_CACHE_DIR"] = old


def _cases():
    from dmuon.kernels.selfcheck import CUDA_CASES

    return CUDA_CASES


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_cuda_case(case):
    from dmuon.kernels.selfcheck import check_case

    ok, line = check_case(case, "cuda")
    assert ok, line


def test_autotune_writes_a_verified_entry_and_auto_uses_it(tmp_path, monkeypatch):
    import triton

    from dmuon.kernels import autotune, get_ops, torch_ops, triton_ops
    from dmuon.kernels.configs import cache_key

    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    out = triton_ops.syrk(x)
    assert torch.equal(out, out.mT)
    key = cache_key(triton_ops.gpu_name(x.device), "syrk", 2048, 4096, "bf16", triton.__version__)
    stored = autotune.read_cache_file(tmp_path / "autotune.json")
    assert key in stored and stored[key].rel_err <= 2e-2 and stored[key].torch_time_s > 0
    expected = triton_ops if stored[key].time_s < stored[key].torch_time_s else torch_ops
    assert get_ops(x, "auto") is expected
    assert get_ops(torch.randn(64, 256, device="cuda"), "auto") is torch_ops  # small n: cuBLAS


def test_cpu_tensor_with_triton_is_an_error_on_a_gpu_machine():
    from dmuon.errors import InputError
    from dmuon.kernels import get_ops, triton_ops

    if triton_ops.INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set: CPU tensors are allowed")
    with pytest.raises(InputError, match="needs a CUDA tensor"):
        get_ops(torch.zeros(4, 4), "triton")
