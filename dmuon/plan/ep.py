"""Plans with expert parallelism: expert matrices are owned where expert parallelism already put them.

Layout (`EPLayout`). N ranks, EP degree ep (N a multiple of ep): rank r is EP rank k = r % ep of EP
group r // ep (the EP groups are blocks of ep consecutive ranks, so an EP group sits inside a node when
ep <= GPUs per node, as MoE training places it). The ranks with the same EP rank k are its replica
group: R = N / ep ranks {k, k + ep, k + 2 ep, ...}, the data-parallel copies of the same experts; their
expert gradients are reduced over that group only.

Experts. A Muon matrix is an expert's when its name holds `experts.<e>.` (the Hugging Face MoE names
and simulator.models.hf_config's: `mlp.experts.<e>.gate_proj`, `block_sparse_moe.experts.<e>.w1`); layer l's E_l
experts (E_l a multiple of ep) are cut into ep contiguous blocks: expert e lives on EP rank
e // (E_l / ep), as Megatron-style EP and DeepSpeed-MoE place them. Shared experts (`shared_experts`,
`shared_expert`) are dense: every rank holds them.

Owners. An expert matrix's owner is one rank of its EP rank's replica group (no other rank holds it, so
it needs no gather beyond that group); the dense matrices go to any rank. Two orders are tried and the
plan with the smaller makespan (then less total work) wins; a note names it:
  experts first   the local experts of EP rank k balanced over its R replicas by the chosen balancer
                  (every EP rank holds the same shapes, so one sub-plan per distinct (shape, layer)
                  sequence serves them all), then the dense matrices over all N ranks by LPT starting
                  from the experts' per-rank loads (`balance.lpt` initial=; round-robin: ignoring them;
                  the MILP has no initial loads, so it balances only the experts here)
  dense first     (lpt, milp) the dense matrices by LPT over all N ranks, then each EP rank's experts by
                  LPT over its replicas starting from the dense loads: LPT's longest-first rule, since
                  the dense matrices (attention, dense MLPs, shared experts) are the large ones and the
                  many small experts fill around them (Kimi-K2-like, 1024 ranks, ep 64: 110.2 ms against
                  151.9 ms experts first; 109.9 ms without EP)

Lower bound: the largest sub-plan bound (an EP rank's experts must run on its R replicas), the dense
matrices' own bound over N, and all work over N: each holds for every plan with this placement.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from ..errors import InputError
from .balance import build_work_model, lpt, round_robin
from .build import BALANCERS, build_plan, make_batches, make_buckets, map_slots
from .types import Batch, MatrixSpec, Plan

EXPERT_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.")


@lru_cache(maxsize=1 << 18)  # a MoE workload's names are read several times per plan and simulation
def expert_index(name: str) -> int | None:
    """The expert number in a matrix name (`...experts.<e>....`), None for a dense matrix. The usual name
    is read with string methods: its first `experts.`, after a dot or at the start, then decimal digits
    (`\\d`: Unicode Nd, as `str.isdecimal`) up to the next dot is EXPERT_RE's leftmost match; any other
    name goes to EXPERT_RE."""
    k = name.find("experts.")
    if k < 0:
        return None
    if k == 0 or name[k - 1] == ".":
        end = name.find(".", k + 8)
        if end > k + 8 and name[k + 8:end].isdecimal():
            return int(name[k + 8:end])
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


_PLACED: dict[int, tuple] = {}  # id(matrices tuple) -> (that tuple, ep, placement): see expert_placement


def expert_placement(matrices: Sequence[MatrixSpec], ep: int) -> list[int | None]:
    """Per matrix: the EP rank holding it (expert matrices), None for dense ones. Kept for the last few
    tuples of matrices (held, so their ids stay theirs; tuples of frozen MatrixSpecs cannot change): one
    simulation places the same tuple three times (the plan, simulator.programs.step_ep's spec and
    programs), ~70,000 matrices for Kimi-K2-like."""
    keep = isinstance(matrices, tuple) and type(ep) is int
    got = _PLACED.get(id(matrices)) if keep else None
    if got is not None and got[0] is matrices and got[1] == ep:
        return list(got[2])
    out = _placement(matrices, ep)
    if keep:
        if len(_PLACED) >= 8:
            _PLACED.clear()
        _PLACED[id(matrices)] = (matrices, ep, tuple(out))
    return out


def _placement(matrices: Sequence[MatrixSpec], ep: int) -> list[int | None]:
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
    mkw = dict(method=kw.get("method", "gram_sym"), dtype=kw.get("dtype", "bf16"),
               batching=kw.get("batching", True), max_batch=kw.get("max_batch", 8))
    local: list[list[int]] = [[] for _ in range(ep)]  # per EP rank its experts, in matrix order (one pass)
    dense: list[int] = []
    for i, w in enumerate(where):
        (dense if w is None else local[w]).append(i)
    dmodel = build_work_model(tuple(matrices[i] for i in dense), world_size, cost, **mkw) if dense else None
    sigs = _shapes(matrices, local)
    first = _experts_first(matrices, local, dense, dmodel, layout, cost, balancer, kw, mkw, sigs)
    candidates = [first]
    if dense and balancer != "round_robin":
        candidates.append(_dense_first(matrices, local, dense, dmodel, layout, cost, mkw, sigs))
    keyed = [(max(ld), sum(ld), n) for n, ld in enumerate(_loads(c[1], world_size) for c in candidates)]
    owners, batches, notes = candidates[min(keyed)[2]][:3]
    sub_bounds, work = first[3], first[4]
    dense_lb = dmodel.lower_bound_s if dmodel is not None else 0.0
    if dmodel is not None:
        work += sum(c.count * c.unit_s for c in dmodel.classes)
    per_rank = _loads(batches, world_size)
    ready = {id(b): min(matrices[i].layer for i in b.members) for b in batches}
    batches.sort(key=lambda b: (b.owner, -ready[id(b)], b.rows, b.cols, b.members))
    lb = max(max(sub_bounds), dense_lb, work / world_size)
    notes = list(notes)
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


def _loads(batches, world_size: int) -> list[float]:
    out = [0.0] * world_size
    for b in batches:
        out[b.owner] += b.time_s
    return out


def _place(model, loads, holder_of, index, group=None) -> tuple[list[Batch], dict[int, int]]:
    """Batches and owners of a sub-model's matrices (index: sub-model position -> matrix index; group:
    sub-model rank -> global rank, None = the same)."""
    at = range(model.world_size) if group is None else group
    return _moved(make_batches(model, loads, holder_of), holder_of, index, at)


def _moved(batches, holder_of, index, at) -> tuple[list[Batch], dict[int, int]]:
    """`_place`'s output from a sub-model's batches and holders: each batch with its owner and members
    moved to global ranks (`at`: sub-model rank -> rank) and matrix indices (a new Batch with the same
    fields otherwise; EP sub-plans have no split groups)."""
    out = []
    new = object.__new__
    for b in batches:
        if b.group:
            raise AssertionError("an EP sub-plan batch has a split group")
        # replace(b, owner=..., members=...) without the frozen dataclass's per-field __init__ (Batch checks
        # nothing): its fields copied in order, two of them set
        c = new(Batch)
        c.__dict__.update(b.__dict__, owner=at[b.owner], members=tuple([index[j] for j in b.members]))
        out.append(c)
    return out, {index[j]: at[h] for j, h in enumerate(holder_of)}


def _shapes(matrices, local) -> list[tuple]:
    """Per EP rank its experts' (rows, cols, layer) sequence: EP ranks with the same one share sub-plans."""
    return [tuple([(matrices[i].rows, matrices[i].cols, matrices[i].layer) for i in mine]) for mine in local]


def _experts_first(matrices, local, dense, dmodel, layout, cost, balancer, kw, mkw, sigs=None):
    """Each EP rank's experts by `balancer` over its replicas (one sub-plan per distinct shape sequence),
    then the dense matrices by LPT around their loads (round-robin: ignoring them). Returns owners,
    batches, notes, the sub-plans' bounds and their work. sigs: `_shapes` (computed where not given)."""
    notes: list[str] = []
    owners = [-1] * len(matrices)
    batches: list[Batch] = []
    expert_load = [0.0] * layout.world_size
    sub_bounds, work = [], 0.0
    cache: dict[tuple, tuple[Plan, float]] = {}
    for k, (mine, sig) in enumerate(zip(local, sigs or _shapes(matrices, local), strict=True)):
        if sig not in cache:  # every EP rank holds the same shapes: plan them once
            sub = build_plan([replace(matrices[i], name=str(j)) for j, i in enumerate(mine)], layout.replicas,
                             cost, balancer=balancer, **kw)
            model = build_work_model(sub.matrices, layout.replicas, cost, **mkw)
            cache[sig] = (sub, sum(c.count * c.unit_s for c in model.classes))
            notes += [f"experts (EP rank {k}, {len(mine)} matrices on {layout.replicas} replicas): {n}"
                      for n in sub.notes[:1]]
        sub, sub_work = cache[sig]
        more, who = _moved(sub.batches, sub.owners, mine, layout.replica_group(k))
        for i, o in who.items():
            owners[i] = o
        for b in more:
            expert_load[b.owner] += b.time_s
        batches += more
        sub_bounds.append(sub.lower_bound_s)
        work += sub_work
    if dense:
        if balancer == "round_robin":
            loads, holder_of = round_robin(dmodel)
        else:
            loads = lpt(dmodel, initial=expert_load)
            holder_of = map_slots(dmodel, loads)
        more, who = _place(dmodel, loads, holder_of, dense)
        batches += more
        for i, o in who.items():
            owners[i] = o
        notes.append("experts balanced first, dense matrices by LPT around their loads"
                     + (" (the MILP has no initial loads)" if balancer == "milp" else ""))
    return owners, batches, notes, sub_bounds, work


def _dense_first(matrices, local, dense, dmodel, layout, cost, mkw, sigs=None):
    """The dense matrices by LPT over every rank, then each EP rank's experts by LPT over its replicas
    around the dense loads (longest jobs first: the dense matrices are the large ones)."""
    owners = [-1] * len(matrices)
    loads = lpt(dmodel)
    batches, who = _place(dmodel, loads, map_slots(dmodel, loads), dense)
    for i, o in who.items():
        owners[i] = o
    dense_load = _loads(batches, layout.world_size)
    models: dict[tuple, object] = {}
    # (shapes, initial loads) -> the sub-model's holders and batches: LPT, the slot mapping and the batches
    # are functions of the model and the initial loads, and replica groups often start from equal loads
    # (Kimi-K2-like, ep 64: 7 distinct of 64 at 256 to 65,536 GPUs), so equal inputs are solved once
    solved: dict[tuple, tuple] = {}
    for k, (mine, sig) in enumerate(zip(local, sigs or _shapes(matrices, local), strict=True)):
        if sig not in models:
            models[sig] = build_work_model([replace(matrices[i], name=str(j)) for j, i in enumerate(mine)],
                                           layout.replicas, cost, **mkw)
        model, group = models[sig], layout.replica_group(k)
        initial = tuple([dense_load[g] for g in group])
        got = solved.get((sig, initial))
        if got is None:
            loads = lpt(model, initial=list(initial))
            holder_of = map_slots(model, loads)
            got = solved[(sig, initial)] = (holder_of, make_batches(model, loads, holder_of))
        more, who = _moved(got[1], got[0], mine, group)
        batches += more
        for i, o in who.items():
            owners[i] = o
    return owners, batches, ["dense matrices balanced first by LPT, each EP rank's experts by LPT around "
                             "them"]


def dense_part(plan: Plan, n_dense: int, bucket_numel: int = 0) -> Plan | None:
    """The part of an EP plan over its first `n_dense` matrices, the dense ones (the runtime lists them
    first): their owners and batches (no batch mixes dense and expert matrices) and their own buckets;
    None without dense matrices. The makespan and bounds stay the whole plan's."""
    if n_dense == 0:
        return None
    batches = tuple(b for b in plan.batches if b.members[0] < n_dense)
    if any(j >= n_dense for b in batches for j in b.members):
        raise InputError("an EP plan batch mixes dense and expert matrices; accepted: a plan of "
                         "dmuon.plan.ep.build_ep_plan with the dense matrices listed first")
    matrices = plan.matrices[:n_dense]
    return replace(plan, matrices=matrices, owners=plan.owners[:n_dense], batches=batches,
                   buckets=make_buckets(matrices, bucket_numel))
