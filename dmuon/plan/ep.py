"""Plans with expert parallelism: expert matrices are owned where expert parallelism already put them.

Layout (`EPLayout`). N ranks, EP degree ep (N a multiple of ep): rank r is EP rank k = r % ep of EP
group r // ep (the EP groups are blocks of ep consecutive ranks, so an EP group sits inside a node when
ep <= GPUs per node, as MoE training places it). The ranks with the same EP rank k are its replica
group: R = N / ep ranks {k, k + ep, k + 2 ep, ...}, the data-parallel copies of the same experts; their
expert gradients are reduced over that group only.

Experts. A Muon matrix is an expert's when its name holds `experts.<e>.` (the Hugging Face MoE names
and simulator.hf_config's: `mlp.experts.<e>.gate_proj`, `block_sparse_moe.experts.<e>.w1`); layer l's E_l
experts (E_l a multiple of ep) are cut into ep contiguous blocks: expert e lives on EP rank
e // (E_l / ep), as Megatron-style EP and DeepSpeed-MoE place them. Shared experts (`shared_experts`,
`shared_expert`) are dense: every rank holds them.

Owners. An expert matrix's owner is one rank of its EP rank's replica group (no other rank holds it, so
it needs no gather beyond that group): the local experts of EP rank k are balanced over its R replicas
by the chosen balancer (every EP rank holds the same shapes, so one sub-plan serves them all: it is
computed once per distinct (shape, layer) sequence). The dense matrices are then planned over all N
ranks as without EP, around the experts' per-rank load: LPT starts from those loads (`balance.lpt`
initial=); round-robin ignores them; the MILP (which has no initial loads) balances the experts of
each replica group and leaves the dense matrices to LPT around them (a note says so).

Lower bound: the largest sub-plan bound (an EP rank's experts must run on its R replicas), the dense
matrices' own bound over N, and all work over N: each holds for every plan with this placement.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import InputError
from .balance import build_work_model, lpt, round_robin
from .build import BALANCERS, build_plan, make_batches, make_buckets, map_slots
from .types import Batch, MatrixSpec, Plan

EXPERT_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """The expert number in a matrix name (`...experts.<e>....`), None for a dense matrix."""
    m = EXPERT_RE.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class EPLayout:
    """Where expert parallelism of degree `ep` puts ranks (see the module docstring)."""

    world_size: int
    ep: int

    def __post_init__(self) -> None:
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise InputError(f"ep must be a positive integer (1 = no expert parallelism), got {self.ep!r}")
        if self.world_size % self.ep:
            raise InputError(f"ep={self.ep} does not divide the {self.world_size} ranks; accepted: a divisor "
                             f"of the rank count")

    @property
    def replicas(self) -> int:
        return self.world_size // self.ep

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def replica_group(self, ep_rank: int) -> tuple[int, ...]:
        return tuple(range(ep_rank, self.world_size, self.ep))


def expert_placement(matrices: Sequence[MatrixSpec], ep: int) -> list[int | None]:
    """Per matrix: the EP rank holding it (expert matrices), None for dense ones."""
    experts: dict[int, set[int]] = {}
    index = [expert_index(m.name) for m in matrices]
    for m, e in zip(matrices, index, strict=True):
        if e is not None:
            experts.setdefault(m.layer, set()).add(e)
    per_rank: dict[int, int] = {}
    for layer, es in experts.items():
        n = len(es)
        if sorted(es) != list(range(n)):
            raise InputError(f"layer {layer}: experts must be numbered 0..E-1, got {sorted(es)[:8]}...")
        if n % ep:
            raise InputError(f"ep={ep} does not divide the {n} experts of layer {layer}; accepted: a divisor "
                             f"of every MoE layer's expert count")
        per_rank[layer] = n // ep
    return [None if e is None else e // per_rank[m.layer] for m, e in zip(matrices, index, strict=True)]


def build_ep_plan(matrices: Sequence[MatrixSpec], world_size: int, cost, *, ep: int, balancer: str = "lpt",
                  bucket_numel: int = 0, **kw) -> Plan:
    """The plan with expert parallelism of degree `ep` (see the module docstring); `kw`: build_plan's
    method, dtype, batching, max_batch, time_limit_s, seed. ep = 1 is build_plan."""
    if ep == 1:
        return build_plan(matrices, world_size, cost, balancer=balancer, bucket_numel=bucket_numel, **kw)
    if balancer not in BALANCERS:
        from ..errors import choice_error

        raise choice_error("balancer", balancer, BALANCERS)
    for bad in ("max_split", "memory_cap_bytes", "anti_affinity", "links"):
        if kw.get(bad) not in (None, False, 1):
            raise InputError(f"{bad} is not supported with expert parallelism (ep > 1); accepted: leave it "
                             "unset")
        kw.pop(bad, None)
    t_start = time.perf_counter()
    layout = EPLayout(world_size, ep)
    matrices = tuple(matrices)
    where = expert_placement(matrices, ep)
    if all(w is None for w in where):
        raise InputError(f"ep={ep}: the workload has no expert matrices (names with 'experts.<e>.'); "
                         "accepted: ep=1 for a dense model")
    notes: list[str] = []
    owners = [-1] * len(matrices)
    batches: list[Batch] = []
    expert_load = [0.0] * world_size
    sub_bounds, work = [], 0.0
    cache: dict[tuple, tuple[Plan, float]] = {}
    for k in range(ep):
        mine = [i for i, w in enumerate(where) if w == k]
        sig = tuple((matrices[i].rows, matrices[i].cols, matrices[i].layer) for i in mine)
        if sig not in cache:  # every EP rank holds the same shapes: plan them once
            sub = build_plan([replace(matrices[i], name=str(j)) for j, i in enumerate(mine)], layout.replicas,
                             cost, balancer=balancer, **kw)
            model = build_work_model(sub.matrices, layout.replicas, cost, method=kw.get("method", "gram_sym"),
                                     dtype=kw.get("dtype", "bf16"), batching=kw.get("batching", True),
                                     max_batch=kw.get("max_batch", 8))
            cache[sig] = (sub, sum(c.count * c.unit_s for c in model.classes))
            notes += [f"experts (EP rank {k}, {len(mine)} matrices on {layout.replicas} replicas): {n}"
                      for n in sub.notes[:1]]
        sub, sub_work = cache[sig]
        group = layout.replica_group(k)
        for j, i in enumerate(mine):
            owners[i] = group[sub.owners[j]]
        for b in sub.batches:
            batches.append(replace(b, owner=group[b.owner], members=tuple(mine[j] for j in b.members)))
            expert_load[group[b.owner]] += b.time_s
        sub_bounds.append(sub.lower_bound_s)
        work += sub_work
    dense = [i for i, w in enumerate(where) if w is None]
    dense_lb = 0.0
    if dense:
        dmats = tuple(matrices[i] for i in dense)
        model = build_work_model(dmats, world_size, cost, method=kw.get("method", "gram_sym"),
                                 dtype=kw.get("dtype", "bf16"), batching=kw.get("batching", True),
                                 max_batch=kw.get("max_batch", 8))
        if balancer == "round_robin":
            loads, holder_of = round_robin(model)
        else:
            loads = lpt(model, initial=expert_load)
            holder_of = map_slots(model, loads)
            if balancer == "milp":
                notes.append("dense matrices: LPT around the experts' loads (the MILP has no initial loads)")
        for b in make_batches(model, loads, holder_of):
            batches.append(replace(b, members=tuple(dense[j] for j in b.members)))
        for j, i in enumerate(dense):
            owners[i] = holder_of[j]
        dense_lb = model.lower_bound_s
        work += sum(c.count * c.unit_s for c in model.classes)
    per_rank = [0.0] * world_size
    for b in batches:
        per_rank[b.owner] += b.time_s
    ready = {id(b): min(matrices[i].layer for i in b.members) for b in batches}
    batches.sort(key=lambda b: (b.owner, -ready[id(b)], b.rows, b.cols, b.members))
    lb = max(max(sub_bounds), dense_lb, work / world_size)
    notes.insert(0, f"lower bound {lb * 1e3:.3f} ms (experts fixed to their EP rank's replicas)")
    notes.insert(1, f"expert parallelism: ep={ep}, {layout.replicas} replicas per EP rank; "
                    f"{len(matrices) - len(dense)} expert matrices owned in their replica group, "
                    f"{len(dense)} dense matrices over {world_size} ranks")
    makespan = max(per_rank)
    return Plan(world_size=world_size, matrices=matrices, owners=tuple(owners), batches=tuple(batches),
                buckets=make_buckets(matrices, bucket_numel), balancer=balancer,
                method=kw.get("method", "gram_sym"), dtype=kw.get("dtype", "bf16"),
                cost_source=getattr(cost, "name", type(cost).__name__), makespan_s=makespan,
                lower_bound_s=lb, solve_time_s=time.perf_counter() - t_start,
                gap=max(0.0, (makespan - lb) / makespan) if makespan > 0 else 0.0, notes=tuple(notes), ep=ep)
