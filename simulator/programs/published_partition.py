"""The public implementation's owner placement, for `system="published"` (switch `owner_cost`; `pack_small`
counts its collectives from it): X-Square-Robot/dmuon `dmuon/_core/partition.py:compute_balanced_assignment`
as `dedicate_params` runs it (before `fully_shard`, so every size is the full parameter's), re-derived from
the parameter list and the (shard, replicate) mesh; docs/simulator.md, "What `--system published` models".

Allocation units (`allocation_units`): the matrices of one layer (the public group key `_extract_layer_id`,
"<prefix>.layers.N"; here `MatrixSpec.layer`) of at least `SMALL_PARAM_THRESHOLD` elements are each a unit,
the layer's smaller ones one merged unit (`merge_small`; off: every matrix its own unit). A unit's cost is
the sum of its matrices' `cost_units` (the public `_matrix_optimizer_cost_units`: a coarse Gram-NS flop count
in GFLOP plus one unit per 4 M elements), its size the sum of their elements.

Placement (`owner_slots`): units in descending (cost, elements), then by layer name and member names; each
goes to the slot (shard s, replicate r) with the least key (already used by a unit of the same layer, its
shard column's cost (HSDP only), the slot's cost, its column's elements (HSDP only), the slot's elements),
ties to the first slot in the order (s, r) for s, then r. A slot is global rank r * shard + s (the HSDP mesh
is (replicate, shard) with the shard group inside a node; FSDP: replicate 1, rank = s).

Name ties: the public sort breaks equal (cost, elements) by the layer id string and the parameters' names;
here by the workload's names ("<component>.<block>", then the matrix names), which order alike where the
public names share a prefix (same-shape q / o, gate / up of one layer; one component's layers as strings,
"lm.10" < "lm.2" as "model.layers.10" < "model.layers.2").

`published_plan` makes the Plan the step programs time: each rank owns its units' matrices, its NS calls
cut per shape class into the largest priced batches (batches of one under `ns_per_matrix`, the public
`_step_muon_params`), priced with the cost table as `build_plan` prices them (`balance.build_work_model`,
`build.make_batches`, `build.make_buckets`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dmuon.errors import InputError
from dmuon.plan.balance import build_work_model, rank_load_s
from dmuon.plan.build import make_batches, make_buckets
from dmuon.plan.types import MatrixSpec, Plan

SMALL_PARAM_THRESHOLD = 5_000_000  # the public partition.py's merge threshold (elements)
NS_STEPS = 5  # the public cost's Newton-Schulz steps (`_matrix_optimizer_cost_units`)
GFLOP = 1_000_000_000  # its compute unit
BYTE_UNIT = 4_000_000  # its byte term: one unit per this many elements
_SLOTS: dict[tuple, tuple[int, ...]] = {}


@dataclass(frozen=True)
class Unit:
    """One allocation unit: matrices that share one owner slot."""

    layer: int
    members: tuple[int, ...]  # matrix indices, in the parameter list's order
    numel: int
    cost: int
    name: str  # the tie-break: the layer's name, then the members' names


def param_shape(m: MatrixSpec) -> tuple[int, ...]:
    """The parameter's logical shape as the public cost reads it: a fused expert parameter (count > 1,
    '.experts.' in its name) is 3-D (count, rows, cols); another fused one (QKV, gate-up, per-head blocks)
    stacks its matrices along the rows, as one nn.Linear holds them."""
    if m.count == 1:
        return (m.rows, m.cols)
    return (m.count, m.rows, m.cols) if ".experts." in m.name else (m.count * m.rows, m.cols)


def cost_units(m: MatrixSpec) -> int:
    """The public owner cost of one Muon matrix (`_matrix_optimizer_cost_units`): five Gram-NS steps of
    small x (rows x cols + 2 x big x small) flops, in whole GFLOP (at least 1), plus its elements in whole
    4 M-element units (at least 1); rows = the first dimension, cols = the product of the others."""
    shape = param_shape(m)
    rows = shape[0]
    cols = m.numel // rows
    small, big = min(rows, cols), max(rows, cols)
    flops = NS_STEPS * small * (rows * cols + 2 * big * small)
    return max(1, flops // GFLOP) + max(1, m.numel // BYTE_UNIT)


def _layer_name(m: MatrixSpec) -> str:
    parts = m.name.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 and parts[1].isdigit() else f"layer{m.layer}"


def allocation_units(matrices, merge_small: bool = True) -> tuple[Unit, ...]:
    """The public partition's allocation units, in its placement (LPT) order (see the module docstring)."""
    by_layer: dict[int, list[int]] = {}
    for i, m in enumerate(matrices):
        by_layer.setdefault(m.layer, []).append(i)
    units = []
    for layer, idx in by_layer.items():
        small = [i for i in idx if merge_small and matrices[i].numel < SMALL_PARAM_THRESHOLD]
        groups = [(i,) for i in idx if i not in small] + ([tuple(small)] if small else [])
        for g in groups:
            units.append(Unit(layer, g, sum(matrices[i].numel for i in g),
                              sum(cost_units(matrices[i]) for i in g),
                              _layer_name(matrices[g[0]]) + "|" + ",".join(matrices[i].name for i in g)))
    return tuple(sorted(units, key=lambda u: (-u.cost, -u.numel, u.name)))


def owner_slots(matrices, shard: int, replicate: int = 1, merge_small: bool = True) -> tuple[int, ...]:
    """The global rank (replicate index x shard + shard index) that owns each matrix under the public LPT
    over shard x replicate slots (cached per input)."""
    for what, v in (("shard", shard), ("replicate", replicate)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"the public partition's {what} size must be a positive integer, got {v!r}")
    matrices = tuple(matrices)
    key = (matrices, shard, replicate, merge_small)
    if key not in _SLOTS:
        _SLOTS[key] = _place(matrices, shard, replicate, merge_small)
    return _SLOTS[key]


def _place(matrices, shard: int, replicate: int, merge_small: bool) -> tuple[int, ...]:
    hsdp = replicate > 1
    slots = [(s, r) for s in range(shard) for r in range(replicate)]
    cost = {sl: 0 for sl in slots}
    numel = {sl: 0 for sl in slots}
    col_cost, col_numel = [0] * shard, [0] * shard
    used: dict[int, set] = {}
    owner = [-1] * len(matrices)
    for u in allocation_units(matrices, merge_small):
        mine = used.setdefault(u.layer, set())
        best = min(slots, key=lambda sl: (sl in mine, col_cost[sl[0]] if hsdp else 0, cost[sl],
                                          col_numel[sl[0]] if hsdp else 0, numel[sl]))
        cost[best] += u.cost
        numel[best] += u.numel
        col_cost[best[0]] += u.cost
        col_numel[best[0]] += u.numel
        mine.add(best)
        for i in u.members:
            owner[i] = best[1] * shard + best[0]
    return tuple(owner)


def published_plan(matrices, shard: int, replicate: int, cost, *, method: str, dtype: str, max_batch: int,
                   bucket_numel: int, owner_momentum: bool = True, orientation=False,
                   merge_small: bool = True) -> Plan:
    """The Plan of the public placement on shard x replicate ranks (see the module docstring)."""
    t0 = time.perf_counter()
    world = shard * replicate
    model = build_work_model(matrices, world, cost, method=method, dtype=dtype, max_batch=max_batch,
                             owner_momentum=owner_momentum, orientation=orientation)
    owners = owner_slots(model.matrices, shard, replicate, merge_small)
    loads: list[dict[int, list[int]]] = [{} for _ in range(world)]
    for s, cls in enumerate(model.classes):
        top = max(cls.times_s)
        held: dict[int, int] = {}
        for i in cls.members:
            held[owners[i]] = held.get(owners[i], 0) + 1
        for r, n in held.items():
            loads[r][s] = [top] * (n // top) + ([n % top] if n % top else [])
    per_rank = [rank_load_s(model, ld) for ld in loads]
    makespan = max(per_rank)
    lb = model.lower_bound_s
    units = allocation_units(model.matrices, merge_small)
    return Plan(world_size=world, matrices=model.matrices, owners=owners,
                batches=make_batches(model, loads, owners), buckets=make_buckets(model.matrices, bucket_numel),
                balancer="published-lpt", method=method, dtype=dtype,
                cost_source=getattr(cost, "name", type(cost).__name__), makespan_s=makespan, lower_bound_s=lb,
                solve_time_s=time.perf_counter() - t0,
                gap=max(0.0, (makespan - lb) / makespan) if makespan > 0 else 0.0,
                notes=(f"owners: the public partition (X-Square-Robot/dmuon compute_balanced_assignment), "
                       f"{len(units)} allocation units on {shard} x {replicate} (shard x replicate) slots",))
