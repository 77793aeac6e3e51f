"""FLOP counts of one orthogonalization (the formulas of muon.md, for any step count and restarts).

Methods:
  standard      quintic Newton-Schulz with dense matmuls
  standard_sym  the same, X X^T and b A + c A^2 computed as symmetric (lower-triangle) products
  gram          Gram Newton-Schulz (iterates in the n x n Gram space) with dense matmuls
  gram_sym      Gram Newton-Schulz with every n x n product symmetric (SYRK-style kernels)
n = min(rows, cols), m = max(rows, cols); a multiply-add counts as 2 FLOPs.
"""

from __future__ import annotations

import math

METHODS = ("standard", "standard_sym", "gram", "gram_sym")
DEFAULT_AUTO_MIN_N = 1025  # published (reference/muon.md): plain cuBLAS wins for n <= 1024
DENSE_COUNTERPART = {"gram_sym": "gram", "standard_sym": "standard"}


def default_auto_min_n(dtype: str) -> float:
    """Smallest n = min(rows, cols) at which kernels='auto' runs the Triton symmetric kernels when nothing
    is measured (dmuon.kernels.autotune): the published default for bf16/fp16; fp32 stays on torch (Triton's
    exact-fp32 dot has no tensor cores)."""
    return math.inf if dtype == "fp32" else DEFAULT_AUTO_MIN_N


def dispatched_method(method: str, rows: int, cols: int, dtype: str) -> str:
    """The NS method kernels='auto' really runs for an unmeasured shape class: a symmetric method runs its
    dense counterpart (torch ops) below `default_auto_min_n`. What the planner and the simulator price,
    so that they price what the runtime executes."""
    dense = DENSE_COUNTERPART.get(method)
    return method if dense is None or min(rows, cols) >= default_auto_min_n(dtype) else dense
DEFAULT_RESTARTS = (2,)


def ns_flops(rows: int, cols: int, method: str = "standard", *, steps: int = 5,
             restarts: tuple[int, ...] = DEFAULT_RESTARTS, batch: int = 1) -> float:
    """FLOPs of orthogonalizing `batch` matrices of shape (rows, cols) with `method`."""
    local, replicated = ns_flops_parts(rows, cols, method, steps=steps, restarts=restarts)
    return batch * (local + replicated)


def ns_flops_parts(rows: int, cols: int, method: str = "standard", *, steps: int = 5,
                   restarts: tuple[int, ...] = DEFAULT_RESTARTS, parts: int = 1) -> tuple[float, float]:
    """(local, replicated) FLOPs of one matrix when its long side is split into `parts` column blocks
    (`dmuon.orthogonalize_distributed`): local = the n x n x (m / parts) products of the widest block
    (X X^T, Q X, B X: proportional to the block width ceil(m / parts)), replicated = the n x n x n
    polynomial work every rank of the group repeats. parts = 1: the two add up to `ns_flops`."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; accepted: {', '.join(METHODS)}")
    if min(rows, cols) <= 0 or steps < 0 or parts <= 0:
        raise ValueError("rows, cols, parts must be positive and steps >= 0, got "
                         f"{(rows, cols, parts, steps)}")
    n, m = float(min(rows, cols)), float(max(rows, cols))
    width = float(-(-int(m) // parts))
    sym = method.endswith("_sym")
    gram_xxt = (1.0 if sym else 2.0) * n * n * width  # X X^T, n x n output
    nnn = (1.0 if sym else 2.0) * n ** 3  # one symmetric n x n x n product
    full_qx = 2.0 * n * n * width  # Q X or B X: general output, never symmetric
    if method.startswith("standard"):
        return steps * (gram_xxt + full_qx), steps * nnn
    restart_set = {r for r in restarts if 0 < r < steps}
    local, products = gram_xxt, 0  # R = X X^T
    for t in range(steps):
        if t in restart_set:
            local += full_qx + gram_xxt  # X <- Q X ; R <- X X^T
        products += 1  # Z = b R + c R^2
        if t != 0 and t not in restart_set:
            products += 1  # Q <- Q Z + a Q  (first step after a (re)start: Q = Z + a I, free)
        if t + 1 < steps and (t + 1) not in restart_set:
            products += 2  # RZ = R Z + a R ; R = Z RZ + a RZ
    local += full_qx  # X <- Q X
    return local, products * nnn
