"""What one member of a split batch runs, in order: the compute between the group's collectives.

`dmuon.orthogonalize_distributed` on a k-way split of a (b, n, m) stack (n <= m; the member holds a block
of w = ceil(m / k) columns) issues, per call: two small all-gathers (shape check, Frobenius
normalization), then
  standard forms  per step: A = allreduce(X_i X_i^T) (local n x n x w), then B = b A + c A^2
                  (replicated n^3) and X_i = a X_i + B X_i (local): `steps` all-reduces;
  Gram forms      R = allreduce(X_i X_i^T); the n x n recurrence of Q and R (replicated); at each restart
                  X_i <- Q X_i, R = allreduce(X_i X_i^T); at the end X_i <- Q X_i: 1 + restarts all-reduces.
`segments` splits the call's FLOPs (`dmuon.plan.flops.ns_flops_parts(parts=k)`: the widest block's
local products plus the replicated n^3 work) at those all-reduces, with the same product counts, so the
segments add up to the FLOPs the plan's pricing (`dmuon.plan.split.split_price`) times; the simulator
gives each segment its FLOP share of the plan's compute time. The all-reduces carry the upper triangles
of the b symmetric n x n partial products in fp32 (`split.WIRE_BYTES`), as the plan prices them.
"""

from __future__ import annotations

from dmuon.plan.flops import DEFAULT_RESTARTS, ns_flops_parts
from dmuon.plan.split import SMALL_BYTES, SMALL_COLLECTIVES, WIRE_BYTES, all_reduces_per_call


def segments(n: int, m: int, k: int, method: str, *, steps: int = 5,
             restarts: tuple[int, ...] = DEFAULT_RESTARTS) -> list[float]:
    """FLOPs of one matrix's share of each compute segment of a member (len = all-reduces + 1)."""
    n, m = min(n, m), max(n, m)
    width = float(-(-m // k))
    sym = method.endswith("_sym")
    xxt = (1.0 if sym else 2.0) * n * n * width
    nnn = (1.0 if sym else 2.0) * float(n) ** 3
    qx = 2.0 * n * n * width
    if method.startswith("standard"):
        # A_1 | B_1, X_1, A_2 | ... | B_s, X_s
        return [xxt] + [nnn + qx + (xxt if s + 1 < steps else 0.0) for s in range(steps)]
    restart_set = {r for r in restarts if 0 < r < steps}
    segs, cur = [xxt], 0.0  # R = X X^T, then the all-reduce
    for t in range(steps):
        if t in restart_set:
            segs.append(cur + qx + xxt)  # X <- Q X ; R <- X X^T, then the all-reduce
            cur = 0.0
        cur += nnn  # Z = b R + c R^2
        if t != 0 and t not in restart_set:
            cur += nnn  # Q <- Q Z + a Q
        if t + 1 < steps and (t + 1) not in restart_set:
            cur += 2 * nnn  # RZ, R
    segs.append(cur + qx)  # X <- Q X
    return segs


def split_calls(rows: int, cols: int, batch: int, k: int, method: str) -> dict:
    """The member's program of one split call: compute shares (fractions summing to 1) between the
    all-reduces, the all-reduce bytes and the small all-gathers (count, bytes of the gathered output)."""
    segs = segments(rows, cols, k, method)
    total = sum(segs)
    n = min(rows, cols)
    assert len(segs) == all_reduces_per_call(method) + 1
    local, replicated = ns_flops_parts(rows, cols, method, parts=k)
    assert abs(total - (local + replicated)) <= 1e-9 * total
    return {
        "fractions": [s / total for s in segs],
        "all_reduce_bytes": batch * n * (n + 1) / 2 * WIRE_BYTES,
        "small": (SMALL_COLLECTIVES, SMALL_BYTES * k),
    }


__all__ = ["segments", "split_calls"]
