"""Symmetric-product ops for Newton-Schulz: one small namespace, two implementations.

`get_ops(tensor)` returns a module-like object with `syrk`, `sym_poly`, `sym_mul_add` and `NAME`:
the torch reference (`torch_ops`) everywhere, Triton symmetric kernels on CUDA when available.
"""

from __future__ import annotations

from . import torch_ops


def get_ops(x, *, symmetric: bool = True):
    """The op set to use for tensors like `x`. `symmetric=False` forces the torch (dense) ops."""
    return torch_ops


__all__ = ["get_ops", "torch_ops"]
