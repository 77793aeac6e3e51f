"""Triton op namespace, drop-in for `torch_ops`: syrk, sym_poly, sym_mul_add on (n, m) or (B, n, m).

Each op validates its inputs, picks a tile config and runs `triton_kernels.sym_product`:
  interpreter (TRITON_INTERPRET=1 at import)  -> the one fixed `configs.interpreter_config()`
  GPU, shape class in the autotune cache       -> the cached winner
  GPU, not cached, autotuning on (default)     -> search now on random inputs of the same shape,
                                                  verify against a float64 reference, cache it
  GPU, DMUON_AUTOTUNE=0                         -> `configs.default_config`
Outputs have the input dtype (fp32 accumulation inside) and are exactly symmetric.
"""

from __future__ import annotations

import torch
import triton

from . import autotune, torch_ops
from .configs import TileConfig, cache_key, candidates, default_config, interpreter_config
from .triton_kernels import INTERPRETED, SUPPORTED_DTYPES, sym_product

NAME = "triton"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# verification tolerance of a tuned config (relative Frobenius error vs float64)
_TOL = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 5e-3}
# representative coefficients for tuning the fused epilogue (Jordan's b, c)
_TUNE_B, _TUNE_C = -4.7750, 2.0315
_TUNE_MAX_ELEMENTS = 1 << 28  # per tuning input (256 Mi elements)


def _as3d(x: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"{what} must be 2-D (n, m) or batched 3-D (B, n, m), got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what} has dtype {x.dtype}; the Triton kernels accept float32, bfloat16, float16")
    return x if x.dim() == 3 else x.unsqueeze(0)


def _square(x: torch.Tensor, what: str) -> torch.Tensor:
    x3 = _as3d(x, what)
    if x3.shape[-1] != x3.shape[-2]:
        raise ValueError(f"{what} must be square (symmetric), got shape {tuple(x.shape)}")
    return x3


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device).replace("|", "/")


def _tune(op: str, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> autotune.Entry:
    """Search the candidate configs for `op` on random inputs of `shape` = (B, n, K).

    The batch is cut so the inputs stay under _TUNE_MAX_ELEMENTS (the float64 reference is 4x that).
    """
    bsz, n, k = shape
    bsz = max(1, min(bsz, _TUNE_MAX_ELEMENTS // (n * k)))
    shape = (bsz, n, k)
    gen = torch.Generator(device=device).manual_seed(0)
    if op == "syrk":
        x = (torch.randn(shape, generator=gen, device=device) / k ** 0.5).to(dtype)
        x64 = x.double()
        ref = x64 @ x64.mT
        del x64

        def run(cfg):
            return sym_product(x, x.mT, None, 1.0, 0.0, cfg)

        def run_torch():
            return torch_ops.syrk(x)
    else:
        g = torch.randn((bsz, n, n), generator=gen, device=device)
        r = ((g + g.mT) / (2 * n ** 0.5)).to(dtype)
        r64 = r.double()
        ref = torch.baddbmm(r64, r64, r64, beta=_TUNE_B, alpha=_TUNE_C)
        del g, r64

        def run(cfg):
            return sym_product(r, r, r, _TUNE_C, _TUNE_B, cfg)

        def run_torch():
            return torch_ops.sym_poly(r, _TUNE_B, _TUNE_C)
    name = DTYPE_NAMES[dtype]
    with torch.cuda.device(device):
        cfg, time_s, err = autotune.search(candidates(name), run, ref, autotune.cuda_event_timer, _TOL[name])
        torch_time_s = autotune.cuda_event_timer(run_torch)
    return autotune.Entry(cfg, time_s, torch_time_s, err, shape)


def config_for(op: str, p: torch.Tensor, k: int) -> TileConfig:
    """The tile config for `op` ("syrk" | "symm") on batched operand `p` with reduction length k."""
    if INTERPRETED:
        return interpreter_config()
    n, name = p.shape[1], DTYPE_NAMES[p.dtype]
    if not autotune.autotune_enabled():
        return default_config(name, n)
    key = cache_key(gpu_name(p.device), op, n, k, name, triton.__version__)
    cache = autotune.get_cache()
    entry = cache.get(key)
    if entry is None:
        entry = _tune(op, (p.shape[0], n, k), p.dtype, p.device)
        cache.put(key, entry)
    return entry.config


def syrk(x: torch.Tensor, *, config: TileConfig | None = None) -> torch.Tensor:
    """x @ x^T, lower tiles only, mirrored: (n, m) -> (n, n) or (B, n, m) -> (B, n, n)."""
    x3 = _as3d(x, "syrk input")
    out = sym_product(x3, x3.mT, None, 1.0, 0.0, config or config_for("syrk", x3, x3.shape[2]))
    return out if x.dim() == 3 else out[0]


def sym_poly(r: torch.Tensor, b: float, c: float, *, config: TileConfig | None = None) -> torch.Tensor:
    """b * r + c * r @ r for symmetric r, with the b * r term fused into the epilogue."""
    r3 = _square(r, "sym_poly input")
    out = sym_product(r3, r3, r3, c, b, config or config_for("symm", r3, r3.shape[2]))
    return out if r.dim() == 3 else out[0]


def sym_mul_add(a_mat: torch.Tensor, b_mat: torch.Tensor, a: float, *,
                config: TileConfig | None = None) -> torch.Tensor:
    """a_mat @ b_mat + a * a_mat for commuting symmetric a_mat, b_mat, with the addend fused."""
    a3, b3 = _square(a_mat, "sym_mul_add first input"), _square(b_mat, "sym_mul_add second input")
    if a_mat.shape != b_mat.shape or a_mat.dtype != b_mat.dtype or a_mat.device != b_mat.device:
        got = [f"{tuple(t.shape)} {t.dtype} {t.device}" for t in (a_mat, b_mat)]
        raise ValueError(f"sym_mul_add inputs must share shape, dtype and device, got {got[0]} and {got[1]}")
    out = sym_product(a3, b3, a3, 1.0, a, config or config_for("symm", a3, a3.shape[2]))
    return out if a_mat.dim() == 3 else out[0]
