"""Newton-Schulz of one matrix (or a batch) split over a group of k ranks: exact to rounding.

Public API:
  orthogonalize_distributed(x_local, *, group=None, tall=False, method=, coefficients=, steps=, dtype=,
                            restart=, kernels=, timeout_s=600.0, check=True)
      this rank's block of the polar factor of the matrix whose blocks the group's ranks hold.
  split_sizes(n, k) -> block widths (the first n % k blocks one wider), local_block(G, index, k) -> the
      index-th block of G along its long side (what each rank passes in).

Math (muon.md). Orient the full matrix X as m x n with m <= n (a tall matrix is iterated transposed) and
give rank i the columns X_i (m x n_i). Every iterate is X_t = P_t X_0 with P_t an m x m polynomial in
X_0 X_0^T, so only the m x m products need the whole matrix, and they are sums over the blocks:
X X^T = sum_i X_i X_i^T. Hence
  normalization  ||X||_F^2 = sum_i ||X_i||_F^2: one all-gather of (max|X_i|, sum (X_i / max|X_i|)^2) per
                 matrix, combined as max * sqrt(sum_i ss_i (max_i / max)^2), overflow-safe like
                 `newton_schulz.normalize` (no square of an unscaled entry is ever formed);
  standard form  per step A = allreduce(X_i X_i^T), B = b A + c A^2 (replicated), X_i = a X_i + B X_i
                 (local): `steps` all-reduces;
  Gram form      R = allreduce(X_i X_i^T), the m x m recurrence of Q and R replicated on every rank, at a
                 restart X_i <- Q X_i and a new all-reduced R, finally X_i <- Q X_i (local): 1 + restarts
                 all-reduces.
Each all-reduce carries the upper triangle of the symmetric m x m partial products only (m (m + 1) / 2
elements per matrix; the sum is mirrored back), in the wider of fp32 and the iteration dtype: fp32 for
bf16 / fp16 / fp32 iterations, fp64 for fp64. Summing k bf16 (8-bit mantissa) partials in bf16 would add
k roundings to the Gram matrix the single-device iteration rounds once; fp32 keeps the sum's error at
the level of one rounding of the partials (which the kernels produce in the iteration dtype), and fp16
partials cannot overflow in the sum. The reduced matrix is cast back to the iteration dtype, so the
replicated m x m work runs in the same dtype and through the same kernels (`dmuon.kernels.get_ops`) as
`dmuon.orthogonalize`. method='auto' resolves on the full shape exactly as `dmuon.orthogonalize` does,
so both give the same update.

Checks (check=True): one all-gather of a small integer descriptor per call (rows, block width, batch
shape, dtype, orientation, settings) before any work: mismatched rows or batch across ranks, an empty
block (k larger than the long side), a block of the short side, or different settings raise the same
one-line `InputError` on every rank (never a hang). A rank outside `group` raises at once. Every
collective is issued asynchronously and waited with `timeout_s`, so a peer that never arrives fails
the call instead of hanging it. Type errors (not a floating tensor) are raised locally.
"""

from __future__ import annotations

import datetime
import zlib

import torch
import torch.distributed as dist

from .errors import InputError
from .kernels import get_ops
from .newton_schulz import (
    ITERATION_DTYPES,
    NORM_EPS,
    NSConfig,
    coefficient_schedule,
    iteration_dtype,
    resolve_method,
)

__all__ = ["local_block", "orthogonalize_distributed", "split_sizes"]

_DESCRIPTOR_FIELDS = ("dim", "batch shape", "rows", "block", "tall", "dtype", "settings")


def split_sizes(n: int, k: int) -> tuple[int, ...]:
    """Widths of k blocks of n columns: as even as possible, the first n % k blocks one wider."""
    if isinstance(n, bool) or not isinstance(n, int) or isinstance(k, bool) or not isinstance(k, int):
        raise InputError(f"split_sizes takes two integers, got n={n!r}, k={k!r}")
    if not 1 <= k <= n:
        raise InputError(f"cannot split {n} columns into {k} blocks; accepted: 1 <= k <= n "
                         "(every rank of the group needs at least one column)")
    return tuple(n // k + (1 if i < n % k else 0) for i in range(k))


def local_block(G: torch.Tensor, index: int, k: int) -> torch.Tensor:
    """Block `index` of k of G (..., rows, cols) along its long side: columns of a wide (rows <= cols)
    matrix, rows of a tall one (pass `tall=G.shape[-2] > G.shape[-1]` with it). A view, not a copy."""
    rows, cols = G.shape[-2], G.shape[-1]
    tall = rows > cols
    sizes = split_sizes(rows if tall else cols, k)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < k:
        raise InputError(f"block index must be in [0, {k}), got {index!r}")
    start = sum(sizes[:index])
    return G.narrow(-2 if tall else -1, start, sizes[index])


def _settings_code(method: str, cfg: NSConfig, restarts: tuple[int, ...]) -> int:
    text = repr((method, coefficient_schedule(cfg.coefficients, cfg.steps), restarts, str(cfg.dtype)))
    return zlib.crc32(text.encode())


def _wait(work, what: str, timeout_s: float) -> None:
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(f"orthogonalize_distributed: {what} failed or did not finish within "
                           f"{timeout_s:g} s (a peer of the group failed or never called): {e}") from e
    if ok is False:
        raise RuntimeError(f"orthogonalize_distributed: {what} did not finish within {timeout_s:g} s")


def _all_gather(t: torch.Tensor, group, k: int, what: str, timeout_s: float) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(k)]
    _wait(dist.all_gather(out, t, group=group, async_op=True), what, timeout_s)
    return out


class _GramReducer:
    """all-reduce of symmetric (B, m, m) partial products over the group: upper triangle only, in the
    wire dtype (see the module docstring), mirrored back and cast to the iteration dtype."""

    def __init__(self, m: int, device, wire_dtype, group, timeout_s: float):
        iu = torch.triu_indices(m, m, device=device)
        self.m, self.group, self.timeout_s, self.wire = m, group, timeout_s, wire_dtype
        self.upper = iu[0] * m + iu[1]
        self.lower = iu[1] * m + iu[0]
        self.calls = 0

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        b, m = partial.shape[0], self.m
        packed = partial.reshape(b, m * m).index_select(1, self.upper).to(self.wire)
        self.calls += 1
        _wait(dist.all_reduce(packed, group=self.group, async_op=True), f"Gram all-reduce {self.calls}",
              self.timeout_s)
        full = torch.empty(b, m * m, dtype=partial.dtype, device=partial.device)
        packed = packed.to(partial.dtype)
        full.index_copy_(1, self.upper, packed)
        full.index_copy_(1, self.lower, packed)
        return full.reshape(b, m, m)


def _mm_add(a_mat: torch.Tensor, x: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.baddbmm(x, a_mat, x, beta=beta, alpha=1.0)  # a_mat @ x + beta x


def _standard(x, triples, ops, reduce):
    for a, b, c in triples:
        gram = reduce(ops.syrk(x))  # A = sum_i X_i X_i^T
        x = _mm_add(ops.sym_poly(gram, b, c), x, a)  # X_i = a X_i + (b A + c A^2) X_i
    return x


def _gram(x, triples, ops, restarts, reduce):
    steps = len(triples)
    r = reduce(ops.syrk(x))
    q = None  # the identity (fresh start)
    for t, (a, b, c) in enumerate(triples):
        if t in restarts:
            x = q @ x
            r = reduce(ops.syrk(x))
            q = None
        z = ops.sym_poly(r, b, c)
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = ops.sym_mul_add(q, z, a)
        if t + 1 < steps and (t + 1) not in restarts:
            r = ops.sym_mul_add(ops.sym_mul_add(r, z, a), z, a)  # (aI + Z)^2 R
    return q @ x


def _group_info(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("orthogonalize_distributed needs torch.distributed initialized "
                         "(dist.init_process_group); accepted: group=None (the world) or a process group")
    if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise InputError(f"rank {dist.get_rank()} is not a member of the process group it passed; "
                         "accepted: a group this rank belongs to (dist.new_group(ranks) on a rank in ranks) "
                         "or None for the world")
    if dist.get_rank(group) < 0:
        raise InputError(f"rank {dist.get_rank()} is not a member of the process group it passed; "
                         "accepted: a group this rank belongs to, or None for the world")
    return dist.get_world_size(group)


def _check_tensor(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"orthogonalize_distributed expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ITERATION_DTYPES:
        raise TypeError(f"orthogonalize_distributed expects a bf16, fp16, fp32 or fp64 tensor, got {x.dtype}")


def _check_descriptors(descs: list[list[int]], k: int, tall: bool) -> None:
    """The same verdict on every rank, from every rank's descriptor (see the module docstring)."""
    side, other = ("rows", "columns") if tall else ("columns", "rows")
    if any(d[0] < 2 for d in descs):
        bad = [i for i, d in enumerate(descs) if d[0] < 2]
        raise InputError(f"orthogonalize_distributed: group ranks {bad} passed a tensor with fewer than 2 "
                         "dims; accepted: a block (..., rows, cols) on every rank")
    for name in ("dim", "tall", "dtype", "settings", "batch shape", "rows"):
        values = [d[_DESCRIPTOR_FIELDS.index(name)] for d in descs]
        if len(set(values)) > 1:
            what = {"rows": f"the short side ({other} of the blocks)", "tall": "tall=",
                    "dim": "the number of dims",
                    "settings": "the NS settings (method, coefficients, steps, restart, dtype)",
                    }.get(name, name)
            shown = values if name not in ("batch shape", "settings") else "differ"
            raise InputError(f"orthogonalize_distributed: the group's ranks disagree on {what} ({shown}); "
                             "accepted: the same on every rank, only the block width may differ")
    widths = [d[3] for d in descs]
    if min(widths) < 1:
        empty = [i for i, w in enumerate(widths) if w < 1]
        raise InputError(f"orthogonalize_distributed: a {k}-way split of {sum(widths)} {side} leaves group "
                         f"ranks {empty} with none; accepted: every rank holds >= 1 of the long side's "
                         f"{side}, so k <= {sum(widths)} (see split_sizes)")
    if sum(widths) < descs[0][2]:
        raise InputError(f"orthogonalize_distributed: the blocks split the short side ({sum(widths)} {side} "
                         f"in all, {descs[0][2]} {other}); accepted: blocks of the long side (tall=True "
                         "for row blocks of a tall matrix)")


def orthogonalize_distributed(x_local: torch.Tensor, *, group=None, tall: bool = False, method: str = "auto",
                              coefficients="jordan", steps: int = 5, dtype=None, restart=(2,),
                              kernels: str = "auto", timeout_s: float = 600.0,
                              check: bool = True) -> torch.Tensor:
    """This rank's block of the approximate polar factor of the matrix split over `group`'s ranks.

    x_local: this rank's block of the full matrix G (or of each matrix of a stack (..., rows, cols)):
        tall=False: columns, (..., m, n_i), G = cat over the group's ranks (in group rank order) on dim -1,
                    with m <= n = sum n_i;
        tall=True:  rows of a tall G, (..., n_i, m), G = cat on dim -2, with m <= n.
        Uneven blocks are fine (any n_i >= 1; `split_sizes` gives even ones).
    group: a torch.distributed process group holding this rank (None: the world); k = its size.
    method, coefficients, steps, dtype, restart, kernels: as `dmuon.orthogonalize`; the result equals
        `dmuon.orthogonalize(G, ...)`'s block to rounding. dtype None: bf16 (standard) / fp16 (gram) on
        CUDA, fp32 elsewhere.
    timeout_s: limit of every collective's wait; a timeout raises RuntimeError.
    check: exchange a small shape descriptor first (one extra all-gather) so that bad input raises an
        InputError on every rank; False skips it where the caller guarantees the shapes.
    Returns a tensor of x_local's shape and dtype. Collectives per call: [check] + 1 normalization
    all-gather + (steps for 'standard' | 1 + restarts for 'gram') Gram all-reduces of m (m + 1) / 2 values
    per matrix (see the module docstring for what dtype goes over the wire and why).
    """
    if not isinstance(tall, bool) or not isinstance(check, bool):
        raise InputError(f"tall and check must be True or False, got tall={tall!r}, check={check!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InputError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    cfg = NSConfig(method=method, coefficients=coefficients, steps=steps, dtype=dtype, restart=restart,
                   kernels=kernels)
    _check_tensor(x_local)
    k = _group_info(group)
    restarts = tuple(r for r in cfg.restart if 0 < r < steps)
    dim = x_local.dim()
    lead = tuple(x_local.shape[:-2]) if dim >= 2 else ()
    if dim >= 2:
        m, width = (x_local.shape[-1], x_local.shape[-2]) if tall else (x_local.shape[-2], x_local.shape[-1])
    else:
        m, width = 0, 0
    device = x_local.device
    if check:
        desc = torch.tensor([dim, zlib.crc32(repr(lead).encode()), m, width, int(tall),
                             ITERATION_DTYPES.index(x_local.dtype), _settings_code(method, cfg, restarts)],
                            dtype=torch.int64, device=device)
        descs = [d.tolist() for d in _all_gather(desc, group, k, "shape check", timeout_s)]
        _check_descriptors(descs, k, tall)
    elif dim < 2:
        raise InputError(f"orthogonalize_distributed expects a block (..., rows, cols), got shape "
                         f"{tuple(x_local.shape)}")

    x = x_local.reshape(-1, *x_local.shape[-2:])
    if tall:
        x = x.mT  # (B, m, n_i)
    batch = x.shape[0]
    norm_dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(norm_dtype)
    # normalization: one all-gather of (max |X_i|, sum (X_i / max)^2, n_i) per matrix
    amax = xf.abs().amax(dim=(-2, -1))
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    ss = (xf / safe[:, None, None]).square().sum(dim=(-2, -1))
    stats = torch.cat([amax, ss, torch.tensor([float(width)], dtype=norm_dtype, device=device)])
    parts = torch.stack(_all_gather(stats, group, k, "normalization all-gather", timeout_s))  # (k, 2B+1)
    amaxes, sss = parts[:, :batch], parts[:, batch:2 * batch]
    n_total = int(parts[:, -1].sum().item())
    g_max = amaxes.amax(dim=0)
    g_safe = torch.where(g_max > 0, g_max, torch.ones_like(g_max))
    norm_scaled = ((amaxes / g_safe).square() * sss).sum(dim=0).sqrt()  # ||X|| / max
    xf = (xf / g_safe[:, None, None]) / (norm_scaled + NORM_EPS / g_safe)[:, None, None]

    rows, cols = (n_total, m) if tall else (m, n_total)
    resolved = resolve_method(rows, cols, cfg.method, steps=steps, restart=restarts)
    it_dtype = iteration_dtype(resolved, device, cfg.dtype)
    x = xf.to(it_dtype).contiguous()
    reduce = _GramReducer(m, device, torch.promote_types(it_dtype, torch.float32), group, timeout_s)
    ops = get_ops(x, cfg.kernels)
    triples = coefficient_schedule(cfg.coefficients, steps)
    if resolved == "gram":
        x = _gram(x, triples, ops, set(restarts), reduce)
    else:
        x = _standard(x, triples, ops, reduce)
    if tall:
        x = x.mT
    return x.to(x_local.dtype).reshape(x_local.shape).contiguous()
