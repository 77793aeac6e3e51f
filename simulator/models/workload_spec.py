"""What a workload is: its weight matrices (`ParamSpec`, in forward order) and the `Workload` of them,
as the planner and the simulator see it; `WorkloadError` for one that cannot be used.

The types only: reading a workload (catalog, TOML / CSV file, Hugging Face config.json) is
simulator.models.workload's and simulator.models.hf_config's, which both build these. No torch, no simpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from dmuon.errors import InputError
from dmuon.plan.types import MatrixSpec

OPTIMIZERS = ("muon", "adamw")
MAX_DIM = 2**31 - 1  # rows / cols: larger than any tensor dimension torch accepts
MAX_COUNT = 1_000_000  # matrices per row: each becomes a ParamSpec (a typo must not exhaust memory)


class WorkloadError(InputError):
    """A workload name or file that cannot be used; the message says why and what is accepted."""


@dataclass(frozen=True)
class ParamSpec:
    """One weight matrix of a workload (Muon- or AdamW-managed), in forward order."""

    name: str  # "<component>.<layer-in-component>.<matrix>[.<k>]"
    component: str
    matrix: str
    rows: int
    cols: int
    layer: int  # global forward-order layer index
    optimizer: str  # "muon" | "adamw"
    block: int | None = None  # index of the repeated block within its component; None for singles
    note: str = ""  # the catalog / file row's note (e.g. "tied with lm_head", "ASSUMPTION: ...")
    # times per token the forward pass multiplies by this matrix (simulator.models.compute charges 2 x numel x
    # this FLOPs per token): 1 for dense layers, top_k / experts for a routed expert, 0 for a vector
    # (norm weight, bias) that is no matmul, 2 for a head shared by the model and one MTP module
    matmuls_per_token: float = 1.0
    # the attention width an attention's query projection prices its score and value products with
    # (simulator.models.compute); 0: derived from the matrix name (q_proj: rows), as for catalog workloads
    attn_width: float = 0.0
    # a Muon parameter that holds several matrices (`dmuon.params.decide`: fused experts, fused QKV /
    # gate-up, per-head blocks): `count` matrices of rows x cols, named `pieces` (the runtime's
    # `Route.matrices` names), owned together as the runtime owns the parameter (MatrixSpec.count)
    count: int = 1
    pieces: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count

    def matrix_kinds(self) -> list[str]:
        """The matrix kind of each matrix this parameter holds: its own, or for a fused one each piece's
        ('experts.gate_up_proj' -> 'experts.gate_proj', 'experts.up_proj', ...; 'qkv_proj' -> 'qkv_proj:q',
        ...)."""
        if self.count == 1:
            return [self.matrix]
        if ".experts." in (self.pieces[0] if self.pieces else ""):
            kinds = self.matrix.rsplit(".", 1)[0]
            return [f"{kinds}.{n.rsplit('.', 1)[-1]}" for n in self.pieces]
        return [f"{self.matrix}:{n.split(':')[-1]}" for n in self.pieces]

    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, rows, cols) of each matrix Muon runs for this parameter ([] for AdamW)."""
        if self.optimizer != "muon":
            return []
        return [(n, self.rows, self.cols) for n in (self.pieces or (self.name,))]


@dataclass(frozen=True)
class Workload:
    """A model as the planner and the simulator see it: its weight matrices, in forward order."""

    name: str
    params: tuple[ParamSpec, ...]
    notes: tuple[str, ...] = ()
    source: str = "catalog"

    @cached_property
    def muon_matrices(self) -> tuple[MatrixSpec, ...]:
        """The Muon-managed matrices as planner input (name, shape, layer); built once per workload (frozen,
        as are its MatrixSpecs). MatrixSpec validates its shape, layer and count, not its name: the first
        matrix of each (rows, cols, layer, count) of plain ints is built (and checked) by MatrixSpec, the
        others copy its fields with their own name (MoE workloads repeat one shape per layer ~1,000 times)."""
        out = []
        done: dict[tuple, MatrixSpec] = {}
        new = object.__new__
        for p in self.params:
            if p.optimizer != "muon":
                continue
            key = (p.rows, p.cols, p.layer, p.count)  # plain ints only: True or 1.0 equals 1 as a key
            plain = type(p.rows) is int and type(p.cols) is int and type(p.layer) is int and type(p.count) is int
            first = done.get(key) if plain else None
            if first is None:
                first = done[key] = MatrixSpec(p.name, p.rows, p.cols, p.layer, p.count)
                out.append(first)
                continue
            m = new(MatrixSpec)
            m.__dict__.update(first.__dict__, name=p.name)
            out.append(m)
        return tuple(out)

    def experts_apart(self) -> Workload:
        """This workload with every expert matrix its own ParamSpec (named `...experts.<e>....`), as expert
        parallelism places them (`dmuon.plan.ep`: each EP rank holds its experts; the simulator's EP
        programs); everything else as it is. Built once per workload (the simulator's spec and memory model
        both ask; Kimi-K2-like has ~70,000 expert matrices), so its `muon_matrices` are built once too."""
        got = self.__dict__.get("_experts_apart")
        if got is not None:
            return got
        out = []
        new = object.__new__
        for p in self.params:
            if p.count == 1 or ".experts." not in p.name:
                out.append(p)
                continue
            for n, kind in zip(p.pieces, p.matrix_kinds(), strict=True):
                # replace(p, name=n, matrix=kind, count=1, pieces=()) without its per-field __init__ (ParamSpec
                # validates nothing): its fields copied, four of them set
                q = new(ParamSpec)
                q.__dict__.update(p.__dict__, name=n, matrix=kind, count=1, pieces=())
                out.append(q)
        got = replace(self, params=tuple(out))
        self.__dict__["_experts_apart"] = got  # a cache beside the frozen fields (as cached_property does)
        return got

    @property
    def adamw_params(self) -> tuple[ParamSpec, ...]:
        return tuple(p for p in self.params if p.optimizer == "adamw")

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def n_muon_params(self) -> int:
        return sum(p.numel for p in self.params if p.optimizer == "muon")

    @property
    def n_layers(self) -> int:
        return 1 + max(p.layer for p in self.params)

    def scaled(self, width_scale: float = 1.0, blocks: int | None = None, multiple: int = 8) -> Workload:
        """A smaller (or larger) model of the same structure, e.g. to run for real on a CPU.

        Every dimension is multiplied by `width_scale` and rounded to a multiple of `multiple` (at least
        `multiple`); `blocks` keeps only the first `blocks` repeated blocks of each component (singles such
        as embeddings and heads stay). Layers are renumbered in forward order.
        """
        if isinstance(width_scale, bool) or not isinstance(width_scale, (int, float)) or not (
                0 < width_scale < math.inf):
            raise WorkloadError(f"width_scale must be a finite number > 0, got {width_scale!r}")
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks <= 0):
            raise WorkloadError(f"blocks must be a positive integer, got {blocks!r}")

        def dim(d: int) -> int:  # a vector's 1 (norm weights, biases) stays 1
            return 1 if d == 1 else max(multiple, multiple * round(d * width_scale / multiple))

        kept = [p for p in self.params if blocks is None or p.block is None or p.block < blocks]
        renumber = {old: new for new, old in enumerate(sorted({p.layer for p in kept}))}
        params = tuple(replace(p, rows=dim(p.rows), cols=dim(p.cols), layer=renumber[p.layer]) for p in kept)
        label = f"{self.name} x{width_scale:g}" + (f", {blocks} blocks" if blocks is not None else "")
        return Workload(name=label, params=params, notes=self.notes, source=self.source)

    def layer_params(self) -> list[tuple[ParamSpec, ...]]:
        """Parameters grouped by layer index, in forward order."""
        groups: list[list[ParamSpec]] = [[] for _ in range(self.n_layers)]
        for p in self.params:
            groups[p.layer].append(p)
        return [tuple(g) for g in groups]


__all__ = ["MAX_COUNT", "MAX_DIM", "OPTIMIZERS", "ParamSpec", "Workload", "WorkloadError"]
