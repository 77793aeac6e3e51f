"""Tile configurations of the symmetric Triton kernels and the autotune cache keys (pure Python).

A `TileConfig` is one point of the search space: square output tiles (the lower-triangle grid
needs BLOCK_M == BLOCK_N), the K step, software-pipelining depth, warps per program and the
row-group size of the L2-friendly tile order. `candidates()` lists the small set searched on a
GPU; `interpreter_config()` is the single fixed config of the Triton interpreter (CPU tests);
`default_config()` is used on a GPU when autotuning is switched off.

Cache keys: (GPU name, op class, n bucket, m bucket, dtype, Triton version), as one string.
Op classes: "syrk" (X X^T, K = m) and "symm" (symmetric n x n x n products with a fused epilogue:
sym_poly and sym_mul_add, K = n). Buckets are powers of two, so one tuning covers a shape class.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

OP_CLASSES = ("syrk", "symm")
DTYPES = ("bf16", "fp16", "fp32")
MIN_BUCKET = 16


@dataclass(frozen=True)
class TileConfig:
    """One kernel launch configuration (all fields are Triton compile-time constants)."""

    block: int  # BLOCK_M = BLOCK_N: output tile edge
    block_k: int  # reduction step
    num_stages: int  # software-pipelining depth
    num_warps: int
    group: int = 8  # tile rows per group in the launch order (L2 reuse)

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TileConfig.{f.name} must be a positive int, got {v!r}")
        if self.block < 16 or self.block & (self.block - 1) or self.block_k < 16 or self.block_k & (
                self.block_k - 1):
            raise ValueError(f"block and block_k must be powers of two >= 16 (tl.dot), got {self}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TileConfig:
        """Parse a dict written by `to_dict`; raises ValueError on missing or bad fields."""
        try:
            return cls(**{f.name: d[f.name] for f in fields(cls)})
        except KeyError as e:
            raise ValueError(f"tile config is missing field {e.args[0]!r}: {d!r}") from None
        except TypeError as e:
            raise ValueError(f"bad tile config {d!r}: {e}") from None

    def label(self) -> str:
        return f"{self.block}x{self.block}x{self.block_k}/s{self.num_stages}/w{self.num_warps}/g{self.group}"


# Searched on a GPU. Large square tiles with deep pipelines for Hopper/Ampere (the goal shapes are
# n >= 2048), plus a smaller one for small n / many small batched matrices. Kept short: every
# config is one Triton compile per (op, dtype, alignment) variant, paid once per machine.
_HALF_CANDIDATES = (
    TileConfig(128, 64, 3, 8),
    TileConfig(128, 64, 4, 8),
    TileConfig(128, 64, 4, 4),
    TileConfig(64, 64, 4, 4),
)
_FP32_CANDIDATES = (  # tf32 / ieee fp32: twice the bytes per element -> shorter K steps
    TileConfig(128, 32, 3, 8),
    TileConfig(128, 32, 4, 8),
    TileConfig(64, 32, 4, 4),
)


def candidates(dtype: str) -> tuple[TileConfig, ...]:
    """The configs searched on a GPU for `dtype` (bf16 | fp16 | fp32)."""
    check_dtype(dtype)
    return _FP32_CANDIDATES if dtype == "fp32" else _HALF_CANDIDATES


def default_config(dtype: str, n: int) -> TileConfig:
    """The config used on a GPU without a search (autotuning off)."""
    check_dtype(dtype)
    if n <= 512:
        return TileConfig(64, 32, 4, 4)
    return TileConfig(128, 32, 3, 8) if dtype == "fp32" else TileConfig(128, 64, 4, 8)


def interpreter_config() -> TileConfig:
    """The one config of the Triton interpreter: the smallest tiles tl.dot takes (fast, many tiles)."""
    return TileConfig(16, 16, 1, 1, group=2)


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")


def bucket(x: int) -> int:
    """The shape-class bucket of a dimension: the smallest power of two >= x (at least 16)."""
    if not isinstance(x, int) or x <= 0:
        raise ValueError(f"a dimension must be a positive int, got {x!r}")
    return max(MIN_BUCKET, 1 << (x - 1).bit_length())


def cache_key(gpu: str, op: str, n: int, m: int, dtype: str, triton_version: str) -> str:
    """The autotune cache key of one shape class: 'gpu|op|n<bucket>|m<bucket>|dtype|triton<ver>'.

    n is the output edge (rows of X), m the reduction length (cols of X for syrk, n for symm).
    """
    if op not in OP_CLASSES:
        raise ValueError(f"unknown op class {op!r}; accepted: {', '.join(OP_CLASSES)}")
    check_dtype(dtype)
    if not gpu or "|" in gpu:
        raise ValueError(f"gpu name must be non-empty and contain no '|', got {gpu!r}")
    return f"{gpu}|{op}|n{bucket(n)}|m{bucket(m)}|{dtype}|triton{triton_version}"


def parse_key(key: str) -> dict:
    """Inverse of `cache_key` (bucketed dims as ints); raises ValueError on a malformed key."""
    parts = key.split("|")
    if len(parts) != 6 or not parts[2].startswith("n") or not parts[3].startswith("m") or not parts[
            5].startswith("triton"):
        raise ValueError(f"malformed autotune cache key {key!r}")
    try:
        nb, mb = int(parts[2][1:]), int(parts[3][1:])
    except ValueError:
        raise ValueError(f"malformed autotune cache key {key!r}") from None
    return {"gpu": parts[0], "op": parts[1], "n_bucket": nb, "m_bucket": mb, "dtype": parts[4],
            "triton": parts[5][len("triton"):]}
