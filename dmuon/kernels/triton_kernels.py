"""The Triton kernel behind every symmetric product, and its launcher (imports triton: load lazily).

One kernel computes C = alpha * P @ Q + beta * D for outputs known to be symmetric:
  syrk        X X^T            P = X, Q = X^T (a stride-swapped view), no D
  sym_poly    b R + c R R      P = Q = D = R,  alpha = c, beta = b
  sym_mul_add A B + a A        P = A, Q = B, D = A, alpha = 1, beta = a
The grid runs over the lower-triangle tile pairs (i >= j) only, read from a small tile table in
a grouped order (GROUP tile rows at a time, so the operand rows a wave of programs reads stay in
L2), times the batch. Each program accumulates its tile in fp32, applies the scalar epilogue with
the D tile read right there (no extra pass over memory), and writes the tile and its mirror; on
diagonal tiles only the lower half of the computed tile is used (stored as itself and, transposed,
above the diagonal), so the output is exactly symmetric, bit for bit. Strides are passed through,
so transposed or sliced inputs need no copy. In interpreter mode (TRITON_INTERPRET=1, CPU tests)
tiles are upcast to fp32 before tl.dot, where bf16 would give wrong numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import TileConfig

MAX_GRID_Y = 65535  # CUDA limit of grid dim 1: larger batches are launched in chunks
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _sym_product_kernel(
    p_ptr, q_ptr, d_ptr, c_ptr, tiles_ptr,
    N, K,
    sp_b, sp_n, sp_k,
    sq_b, sq_k, sq_n,
    sd_b, sd_r, sd_c,
    sc_b, sc_r, sc_c,
    alpha, beta,
    HAS_D: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    bid = tl.program_id(1).to(tl.int64)
    ti = tl.load(tiles_ptr + 2 * t)
    tj = tl.load(tiles_ptr + 2 * t + 1)
    rows = ti * BLOCK + tl.arange(0, BLOCK)
    cols = tj * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    p_ptrs = p_ptr + bid * sp_b + rows[:, None] * sp_n + ks[None, :] * sp_k
    q_ptrs = q_ptr + bid * sq_b + ks[:, None] * sq_k + cols[None, :] * sq_n
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN:  # n % BLOCK == 0 and K % BLOCK_K == 0: no masks in the main loop
            a = tl.load(p_ptrs)
            b = tl.load(q_ptrs)
        else:
            k_ok = ks < K - k0 * BLOCK_K
            a = tl.load(p_ptrs, mask=(rows[:, None] < N) & k_ok[None, :], other=0.0)
            b = tl.load(q_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        p_ptrs += BLOCK_K * sp_k
        q_ptrs += BLOCK_K * sq_k
    in_bounds = (rows[:, None] < N) & (cols[None, :] < N)
    out = acc * alpha
    if HAS_D:
        d = tl.load(d_ptr + bid * sd_b + rows[:, None] * sd_r + cols[None, :] * sd_c, mask=in_bounds,
                    other=0.0)
        out += beta * d.to(tl.float32)
    out = out.to(c_ptr.dtype.element_ty)
    c_base = c_ptr + bid * sc_b
    # the tile itself, lower part only (all of it off the diagonal) ...
    lower = rows[:, None] >= cols[None, :]
    tl.store(c_base + rows[:, None] * sc_r + cols[None, :] * sc_c, out, mask=in_bounds & lower)
    # ... and its mirror: element (r, c) of the tile also goes to (c, r), strictly above the diagonal
    out_t = tl.trans(out)
    in_bounds_t = (cols[:, None] < N) & (rows[None, :] < N)
    upper_t = cols[:, None] < rows[None, :]
    tl.store(c_base + cols[:, None] * sc_r + rows[None, :] * sc_c, out_t, mask=in_bounds_t & upper_t)


# decided when the kernel was defined (TRITON_INTERPRET read at decoration time)
INTERPRETED = type(_sym_product_kernel).__name__ == "InterpretedFunction"
_tile_tables: dict[tuple, torch.Tensor] = {}


def lower_tile_order(n_tiles: int, group: int) -> list[tuple[int, int]]:
    """All (i, j) with i >= j of an n_tiles x n_tiles tile grid, in grouped launch order.

    Rows are taken `group` at a time; inside a group the order runs column by column, so programs
    launched together share their column operand tiles (and the group's row tiles) in L2.
    """
    order = []
    for g0 in range(0, n_tiles, group):
        g1 = min(g0 + group, n_tiles)
        for j in range(g1):
            order.extend((i, j) for i in range(max(g0, j), g1))
    return order


def _tile_table(n_tiles: int, group: int, device: torch.device) -> torch.Tensor:
    key = (n_tiles, group, str(device))
    table = _tile_tables.get(key)
    if table is None:
        pairs = lower_tile_order(n_tiles, group)
        table = torch.tensor(pairs, dtype=torch.int32).reshape(-1).to(device)
        _tile_tables[key] = table
    return table


def _fp32_precision() -> str:
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def sym_product(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor | None, alpha: float, beta: float,
                config: TileConfig) -> torch.Tensor:
    """alpha * p @ q + beta * d for a symmetric result: (B, n, K) x (B, K, n) [+ (B, n, n)] -> (B, n, n).

    Only the lower-triangle output tiles are computed; each is written with its mirror. Inputs
    must share dtype and device; any strides are accepted (views need no copy).
    """
    if p.dim() != 3 or q.dim() != 3 or p.shape[0] != q.shape[0] or p.shape[2] != q.shape[1] or p.shape[
            1] != q.shape[2]:
        raise ValueError(f"sym_product needs (B, n, K) and (B, K, n) operands, got {tuple(p.shape)} and "
                         f"{tuple(q.shape)}")
    bsz, n, k = p.shape
    if d is not None and tuple(d.shape) != (bsz, n, n):
        raise ValueError(f"the epilogue addend must have shape {(bsz, n, n)}, got {tuple(d.shape)}")
    out = torch.empty((bsz, n, n), dtype=p.dtype, device=p.device)
    if bsz == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if d is None else out.copy_(beta * d)
    n_tiles = triton.cdiv(n, config.block)
    table = _tile_table(n_tiles, config.group, p.device)
    n_pairs = table.numel() // 2
    dd = d if d is not None else out  # never read when HAS_D is False
    for b0 in range(0, bsz, MAX_GRID_Y):
        b1 = min(b0 + MAX_GRID_Y, bsz)
        pc, qc, dc, oc = p[b0:b1], q[b0:b1], dd[b0:b1], out[b0:b1]
        _sym_product_kernel[(n_pairs, b1 - b0)](
            pc, qc, dc, oc, table, n, k,
            *pc.stride(), *qc.stride(), *dc.stride(), *oc.stride(),
            float(alpha), float(beta),
            HAS_D=d is not None, EVEN=n % config.block == 0 and k % config.block_k == 0,
            UPCAST=INTERPRETED,
            PRECISION=_fp32_precision() if p.dtype == torch.float32 else "tf32",
            BLOCK=config.block, BLOCK_K=config.block_k,
            num_stages=config.num_stages, num_warps=config.num_warps,
        )
    return out
