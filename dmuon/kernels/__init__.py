"""Symmetric-product ops for Newton-Schulz: one small namespace, two implementations.

`get_ops(x, kernels=...)` returns a module-like object with `syrk`, `sym_poly`, `sym_mul_add` and
`NAME`: the torch reference (`torch_ops`) or the Triton symmetric kernels (`triton_ops`).
  kernels="torch"  -> torch ops (dense matmuls), everywhere
  kernels="triton" -> Triton symmetric kernels: CUDA tensors, or CPU tensors under the Triton
                      interpreter (TRITON_INTERPRET=1 set before the kernels are first imported)
  kernels="auto"   -> Triton for CUDA tensors (compute capability >= 8.0, triton installed) where
                      measured faster (autotune cache) or, unmeasured, for bf16/fp16 with
                      n = min(rows, cols) > 1024; torch everywhere else (always on the CPU)
Triton is imported only when the Triton ops are chosen: `import dmuon` works without it.
"""

from __future__ import annotations

import importlib.util

from dmuon.errors import InputError, choice_error

from . import torch_ops

KERNEL_CHOICES = ("auto", "torch", "triton")
_TRITON_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")


def triton_available() -> bool:
    """Whether the triton package can be imported here (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _triton_ops(x):
    """The Triton op set for `x`, or an InputError saying why it cannot run here."""
    if not triton_available():
        raise InputError("kernels='triton' needs the triton package, which is not installed here; "
                         "use kernels='torch' or 'auto'")
    if str(getattr(x, "dtype", "")) not in _TRITON_DTYPES:
        raise InputError(f"kernels='triton' accepts float32, bfloat16 and float16 tensors, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}; use kernels='torch' for others")
    from . import triton_ops

    if not getattr(x, "is_cuda", False) and not triton_ops.INTERPRETED:
        where = getattr(x, "device", "?")
        raise InputError(f"kernels='triton' needs a CUDA tensor (got one on {where}); on a CPU the Triton "
                         "interpreter runs them only when TRITON_INTERPRET=1 is set before the kernels are "
                         "first imported (tests); use kernels='torch' or 'auto'")
    return triton_ops


def _auto_prefers_triton(x) -> bool:
    import torch

    if not getattr(x, "is_cuda", False) or not triton_available() or str(x.dtype) not in _TRITON_DTYPES:
        return False
    if x.dim() < 2 or torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    import triton

    from . import autotune
    from .configs import DTYPES, cache_key

    n, m = sorted(x.shape[-2:])
    dtype = DTYPES[("torch.bfloat16", "torch.float16", "torch.float32").index(str(x.dtype))]
    gpu = torch.cuda.get_device_name(x.device).replace("|", "/")
    key = cache_key(gpu, "syrk", n, m, dtype, triton.__version__)
    return autotune.prefers_triton(autotune.get_cache().entries, key, n, gpu, dtype, triton.__version__)


def get_ops(x, kernels: str = "auto"):
    """The op set to use for tensors like `x` (the matrix, or batch of matrices, to orthogonalize)."""
    if kernels not in KERNEL_CHOICES:
        raise choice_error("kernels", kernels, KERNEL_CHOICES)
    if kernels == "torch":
        return torch_ops
    if kernels == "triton":
        return _triton_ops(x)
    if _auto_prefers_triton(x):
        from . import triton_ops

        return triton_ops
    return torch_ops


__all__ = ["KERNEL_CHOICES", "get_ops", "torch_ops", "triton_available"]
