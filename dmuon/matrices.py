"""How one Muon parameter is cut into the matrices Muon orthogonalizes (`MatrixLayout`).

Most Muon parameters are one matrix. Some hold several, stored side by side in one tensor:
  fused 3-D MoE experts     (E, out, in): E matrices, one per expert (transformers 5's `experts.down_proj`)
  fused expert gate / up    (E, 2I, H): 2E matrices, gate rows [0, I) and up rows [I, 2I) of each expert
  fused dense projections   Phi-3's qkv_proj (rows [q | k | v]) and gate_up_proj (rows [gate | up]); GPT-2's
                            c_attn, a Conv1D stored (in, out): column blocks [q | k | v] of the stored matrix
  per-head attention        (an option) q / k / v row blocks of head_dim rows, o_proj column blocks
Each matrix is orthogonalized alone, as Muon treats the unfused model. The routing rule (`dmuon.params`)
decides the layout; this module only cuts tensors by it.

A layout is `lead` matrices of (R, C) (lead > 1: experts; the parameter is then (lead, R, C)), each cut
along `axis` (0: row blocks, 1: column blocks) into blocks of `sizes`, named `names`. Its matrices come
expert-major: (expert 0 block 0, expert 0 block 1, ..., expert 1 block 0, ...). Matrices are always the
stored orientation (a Conv1D's blocks are (in, out_block), as its whole weight is routed today).
`uniform` layouts (every block one size) have a stack view (count, rows, cols) of any tensor of the
parameter's shape (the parameter, its gradient, its momentum): a plain view for row blocks, a permuted
view for column blocks of one matrix. The distributed optimizers take uniform layouts; `Muon` takes any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InputError

if TYPE_CHECKING:  # torch is imported where tensors are cut (the routing rule and shapes need none)
    import torch


@dataclass(frozen=True)
class MatrixLayout:
    """The matrices of one parameter (see the module docstring)."""

    shape: tuple[int, ...]
    lead: int = 1
    axis: int = 0
    sizes: tuple[int, ...] = ()
    names: tuple[str, ...] = ("",)

    def __post_init__(self) -> None:
        R, C = self.matrix_shape
        side = (R, C)[self.axis]
        sizes = self.sizes or (side,)
        object.__setattr__(self, "sizes", tuple(sizes))
        if sum(sizes) != side or any(s <= 0 for s in sizes) or len(self.names) != len(sizes):
            raise InputError(f"a matrix layout of shape {self.shape} cuts its {('rows', 'cols')[self.axis]} "
                             f"({side}) into {sizes} named {self.names}: the blocks must be positive, one "
                             "name each, and add up to the side")
        if self.lead > 1 and self.axis != 0:
            raise InputError("a stacked (expert) layout cuts rows only")

    @classmethod
    def whole(cls, shape) -> MatrixLayout:
        """One matrix: a 2-D parameter, or a >2-D one viewed (shape[0], rest) as `as_matrix` does."""
        return cls(tuple(shape))

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(R, C) of each of the `lead` matrices before the cut."""
        if self.lead > 1:
            return self.shape[1], math.prod(self.shape[2:])
        return self.shape[0], math.prod(self.shape[1:])

    @property
    def count(self) -> int:
        return self.lead * len(self.sizes)

    @property
    def is_whole(self) -> bool:
        return self.count == 1

    @property
    def uniform(self) -> bool:
        return len(set(self.sizes)) == 1

    def piece_shape(self, k: int = 0) -> tuple[int, int]:
        """(rows, cols) of block k."""
        R, C = self.matrix_shape
        s = self.sizes[k]
        return (s, C) if self.axis == 0 else (R, s)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every matrix's (rows, cols), in order."""
        return [self.piece_shape(k) for _ in range(self.lead) for k in range(len(self.sizes))]

    def matrix_names(self, name: str) -> list[str]:
        """Every matrix's name, from the parameter's name less a trailing '.weight' (the names
        `simulator.models.hf_config` gives its matrices): that name for a whole parameter; expert e of
        `<head>.experts.<tail>` is `<head>.experts.<e>.<block or tail>` (the unfused model's names, e.g.
        `mlp.experts.3.gate_proj`); a block of one matrix is `<name>:<block>` (`qkv_proj:q`, `q_proj:h3`)."""
        base = name.removesuffix(".weight")
        if self.is_whole:
            return [base]
        if self.lead > 1:
            head, sep, tail = base.partition(".experts.")
            if not sep:
                head, tail = base.rsplit(".", 1) if "." in base else ("", base)
            return [f"{head}.experts.{e}.{b or tail}".lstrip(".")
                    for e in range(self.lead) for b in self.names]
        return [f"{base}:{b}" for b in self.names]

    # ---- cutting tensors ---------------------------------------------------------------------------
    def _check(self, t: torch.Tensor) -> None:
        if tuple(t.shape) != self.shape and t.numel() != math.prod(self.shape):
            raise InputError(f"a tensor of shape {tuple(t.shape)} does not hold a parameter of "
                             f"shape {self.shape}")

    def pieces(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every matrix of `t` (a tensor of the parameter's shape or numel) as a 2-D view, in order."""
        import torch

        self._check(t)
        R, C = self.matrix_shape
        base = t.reshape(self.lead, R, C)
        out = []
        for e in range(self.lead):
            out += list(torch.split(base[e], list(self.sizes), dim=self.axis))
        return out

    def stack(self, t: torch.Tensor) -> torch.Tensor:
        """The matrices of `t` as one (count, rows, cols) view (uniform layouts; writes reach `t`)."""
        if not self.uniform:
            raise InputError(f"matrices of shapes {sorted(set(self.shapes))} in one parameter have no "
                             "stack view")
        self._check(t)
        R, C = self.matrix_shape
        p, s = len(self.sizes), self.sizes[0]
        if self.axis == 0:
            return t.view(self.lead * p, s, C) if t.is_contiguous() else t.reshape(self.lead, R, C).unflatten(
                1, (p, s)).flatten(0, 1)
        return t.reshape(R, C).unflatten(1, (p, s)).permute(1, 0, 2)

    def unstack(self, u: torch.Tensor) -> torch.Tensor:
        """The inverse of `stack`: (count, rows, cols) updates as one tensor of the parameter's shape."""
        import torch

        if self.axis == 0:
            return u.reshape(self.shape)
        out = torch.empty(self.shape, dtype=u.dtype, device=u.device)
        self.stack(out).copy_(u)
        return out

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The matrices `parts` (in order, any layout) as one tensor of the parameter's shape."""
        import torch

        if len(parts) != self.count:
            raise InputError(f"{len(parts)} matrices for a layout of {self.count}")
        out = torch.empty(self.shape, dtype=parts[0].dtype, device=parts[0].device)
        for dst, src in zip(self.pieces(out), parts, strict=True):
            dst.copy_(src)
        return out
