"""Fitted time curves for the cost table: time of one call as a function of its work, pure Python.

The curve (work w = FLOPs for compute, bytes for memory-bound ops; rate = peak FLOP/s or bandwidth):

    t(w) = t0 + w / rate + a * w + c * w ** (1 - k)        t0, a, c >= 0,  0 < k < 1

i.e. efficiency(w) = w / (rate * (t(w) - t0)) = 1 / (1 + a rate + c rate w**-k): it rises with the
work of the call and saturates at 1 / (1 + a rate) <= 1 (no call beats the datasheet peak); t0 is the
per-call overhead (launches), paid once per call, so a batch of small matrices gains and a batch of
large ones (already at the plateau) does not. t(w) is increasing in w for every fitted parameter set
(each term is non-decreasing and w / rate is strictly increasing), so extrapolation grows, never flat.

The fit minimizes the squared relative error sum((t(w_i) / t_i - 1) ** 2) over the measured points:
for each k on a grid, a 3-variable non-negative least squares solved exactly by trying every active set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

K_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95
MIN_FIT_POINTS = 4


@dataclass(frozen=True)
class Curve:
    """t(w) = t0 + w / rate + a w + c w^(1-k); see the module docstring."""

    rate: float  # peak FLOP/s or bytes/s the efficiency is relative to
    t0_s: float
    a: float
    c: float
    k: float
    n_points: int = 0
    rms_rel_error: float = 0.0  # of the fit over its points

    def time_s(self, work: float) -> float:
        return self.t0_s + self.busy_s(work)

    def busy_s(self, work: float) -> float:
        """Time without the per-call overhead."""
        if work <= 0:
            return 0.0
        return work / self.rate + self.a * work + self.c * work ** (1.0 - self.k)

    def efficiency(self, work: float) -> float:
        """Achieved fraction of `rate` over the whole call, overhead included."""
        t = self.time_s(work)
        return work / (self.rate * t) if t > 0 else 0.0

    def with_rate(self, rate: float) -> Curve:
        """The same efficiency-vs-work curve on a device with another peak (a, c scale with 1/rate)."""
        f = self.rate / rate
        return Curve(rate, self.t0_s, self.a * f, self.c * f, self.k, self.n_points, self.rms_rel_error)


def _solve(ata: list[list[float]], atb: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small dense system; None if singular."""
    n = len(atb)
    m = [row[:] + [atb[i]] for i, row in enumerate(ata)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for j in range(col, n + 1):
                    m[r][j] -= f * m[col][j]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nnls_small(rows: list[list[float]], rhs: list[float]) -> tuple[list[float], float]:
    """min ||A x - b||^2 s.t. x >= 0 for <= 3 columns, by enumerating the active sets."""
    ncol = len(rows[0])
    best_x, best_r = [0.0] * ncol, sum(b * b for b in rhs)
    # Columns are scaled to unit norm first: the raw ones span ~30 orders of magnitude.
    norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(ncol)]
    scaled = [[r[j] / norms[j] for j in range(ncol)] for r in rows]
    for size in range(1, ncol + 1):
        for cols in combinations(range(ncol), size):
            ata = [[sum(r[i] * r[j] for r in scaled) for j in cols] for i in cols]
            atb = [sum(r[i] * b for r, b in zip(scaled, rhs, strict=True)) for i in cols]
            sol = _solve(ata, atb)
            if sol is None or any(v < 0 for v in sol):
                continue
            x = [0.0] * ncol
            for c, v in zip(cols, sol, strict=True):
                x[c] = v / norms[c]
            res = sum(
                (sum(r[j] * x[j] for j in range(ncol)) - b) ** 2 for r, b in zip(rows, rhs, strict=True)
            )
            if res < best_r:
                best_x, best_r = x, res
    return best_x, best_r


def fit_curve(work: Sequence[float], time_s: Sequence[float], rate: float) -> Curve:
    """Fit t(w) to measured (work, time) points relative to `rate`; needs MIN_FIT_POINTS distinct works."""
    pts = [(float(w), float(t)) for w, t in zip(work, time_s, strict=True) if w > 0 and t > 0]
    if len({w for w, _ in pts}) < MIN_FIT_POINTS:
        raise ValueError(
            f"a curve fit needs at least {MIN_FIT_POINTS} points of distinct work, got {len(pts)}"
        )
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    best: tuple[float, Curve] | None = None
    for k in K_GRID:
        # residual_i = (t0 + a w + c w^(1-k) + w / rate) / t_i - 1  -> rows [1, w, w^(1-k)] / t_i
        rows = [[1.0 / t, w / t, w ** (1.0 - k) / t] for w, t in pts]
        rhs = [1.0 - (w / rate) / t for w, t in pts]
        (t0, a, c), res = _nnls_small(rows, rhs)
        if best is None or res < best[0] - 1e-15:
            best = (res, Curve(rate, t0, a, c, k, len(pts), math.sqrt(res / len(pts))))
    assert best is not None
    return best[1]


def anchor_time(points: dict, x: int, model, label: str) -> tuple[float, str]:
    """Time at size x from measured sizes of one family (size -> profile row): log-log interpolation
    between neighbours, else the nearest measured point scaled along the model curve (monotone where the
    model is)."""
    if x in points:  # same class, other dtype
        r = points[x]
        return r.time_s, f"{label}: {r.dtype} point used (same element size and peak): {r.source}"
    lo = max((k for k in points if k < x), default=None)
    hi = min((k for k in points if k > x), default=None)
    if lo is not None and hi is not None:
        f = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
        t = math.exp((1 - f) * math.log(points[lo].time_s) + f * math.log(points[hi].time_s))
        return t, f"{label}: log-log interpolation between measured sizes {lo} and {hi}"
    ref = lo if lo is not None else hi
    t = points[ref].time_s * model(x) / model(ref)
    return t, f"{label}: measured size {ref} scaled along the fitted curve"
