"""Plans with tensor parallelism (TP): how each TP-sharded Muon matrix is orthogonalized, priced (no torch).

Layout. N = dp x tp ranks; global rank r = d * tp + t (TP innermost, as torchtitan's ("dp", "tp") mesh
and Megatron place it): TP group d = ranks [d tp, (d + 1) tp), which sits inside a node when tp <= GPUs
per node. A TP-sharded matrix (rows x cols) is cut into tp equal blocks along `shard_dim` (0: a
column-parallel layer's output rows, 1: a row-parallel layer's input columns); TP rank t holds block t.

Modes (per TP-sharded matrix; n = min(rows, cols), m = max(rows, cols), b = the gather's wire bytes
per element, 2 for bf16, 4 for fp32):
  group      the TP group runs the distributed Gram NS (`dmuon.orthogonalize_distributed`) on its blocks
             in place, no gather: A all-reduces of the n x n Gram's upper triangle, fp32 (A = 1 + restarts
             = 2 for the Gram forms, 5 for the standard ones; `split.all_reduces_per_call`). Possible only
             where the blocks cut the long side (shard_dim 0 of a tall matrix, 1 of a wide one, either of
             a square one): then each block is a block of the long side (tall=True for row blocks).
             bytes (all ranks together, ring all-reduce) = A x 2 (tp - 1) x n (n + 1) / 2 x 4
  gather     one owner rank of the TP group gathers the blocks, runs the whole NS, scatters the blocks
             back. bytes = 2 x (tp - 1) / tp x rows x cols x b (every other rank sends its block, gets
             its block back)
  duplicated every TP rank all-gathers the matrix and runs the whole NS (NaiveMuon's mode; priced for
             comparison): bytes = (tp - 1) x rows x cols x b.
So group moves fewer bytes iff A x (n + 1) x 4 / 2 < m x b / tp, i.e. m > tp x A x (n + 1) x 2 / b:
m > tp (n + 1) at A = 2 and an fp32 gather; m > 2 tp (n + 1) with a bf16 gather. Square and 3.5:1 MLP
matrices at tp 8 never qualify (Llama-3.1-70B: every TP matrix is gathered); very wide ones (a vocabulary
projection) do.

Time. group: `split.split_price(cost, n, m, 1, tp, method, dtype, links, ranks)` (compute of the local
n x m/tp products plus the replicated n x n work, and the collectives), what every TP rank spends.
gather: the owner's NS of the whole matrix (`cost.ns_time`) plus a gather and a scatter, each priced as
`links.all_gather_s(rows x cols x b, ranks)` (the owner's link carries (tp - 1) / tp of the matrix). The
mode "auto" picks the one of fewer rank-seconds, tp x group (every TP rank is busy) against gather (the
owner), the currency the DP share balances; a tie goes to group (no gather). "group" / "gather" force
one (group
falls back to gather, with a note, where the blocks cut the short side).

DP share. Each matrix is orthogonalized by one TP group only, the data-parallel copies do not repeat it:
greedy longest-first (LPT) over TP groups d = 0 .. dp - 1 on the per-rank loads: a group-mode matrix
charges its time to every rank of the TP group with the least loaded busiest rank, a gather-mode matrix
charges its owner's NS to the least loaded rank (any TP group, any TP rank; among equals the one whose TP
group is least loaded, so gathers spread over the groups' links). Matrices that are not
TP-sharded (shard_dim None: replicated under TP) go the same LPT way over all N ranks as one owner each.

Public API (signatures kept stable; the simulator prices DMuon's TP modes with them):
  megatron_shard_dim(name) -> 0 | 1 | None        the Megatron / torchtitan TP placement of a matrix name
  price_tp_modes(rows, cols, shard_dim, tp, cost, *, method="gram_sym", dtype="bf16", links=None,
                 ranks=None, wire_bytes=2) -> TPModePrice
  build_tp_plan(matrices, world_size, cost, *, tp, shard_dims=None, mode="auto", method="gram_sym",
                dtype="bf16", links=None, wire_bytes=2, bucket_numel=0) -> Plan   (Plan.tp, Plan.tp_choices)
  tp_summary(plan) -> dict                         counts, bytes and seconds per mode
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InputError, choice_error
from .flops import METHODS
from .split import WIRE_BYTES, all_reduces_per_call, links_for, split_price
from .types import Batch, MatrixSpec, Plan, TPChoice

TP_MODES = ("group", "gather")
TP_MODE_CHOICES = ("auto", *TP_MODES)

# Megatron-LM / torchtitan TP plans: column-parallel (output rows sharded) and row-parallel (input columns)
_COLWISE = re.compile(r"(?:^|[._])(q_proj|k_proj|v_proj|qkv_proj|wq|wk|wv|wqkv|query_key_value|c_attn|"
                      r"gate_proj|up_proj|gate_up_proj|w1|w3|c_fc|fc1|dense_h_to_4h|linear_fc1|linear_qkv)"
                      r"(?:\.|$)")
_ROWWISE = re.compile(r"(?:^|[._])(o_proj|wo|out_proj|down_proj|w2|c_proj|fc2|dense_4h_to_h|dense|"
                      r"linear_fc2|linear_proj)(?:\.|$)")


def megatron_shard_dim(name: str) -> int | None:
    """0 for a column-parallel matrix (attention q/k/v, MLP gate/up), 1 for a row-parallel one (attention
    output, MLP down), None for one TP leaves whole (by the Hugging Face / Megatron / torchtitan names)."""
    if _ROWWISE.search(name):
        return 1
    if _COLWISE.search(name):
        return 0
    return None


def _check_tp(tp, world_size: int | None = None) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InputError(f"tp must be a positive integer (1 = no tensor parallelism), got {tp!r}")
    if world_size is not None and world_size % tp:
        raise InputError(f"tp={tp} does not divide the {world_size} ranks; accepted: a divisor of the rank "
                         f"count")
    return tp


def check_tp_shape(name: str, rows: int, cols: int, shard_dim: int | None, tp: int) -> None:
    """One-line InputError unless tp divides the sharded dimension (what the runtime and the plan accept)."""
    if shard_dim is None or tp == 1:
        return
    if shard_dim not in (0, 1):
        raise InputError(f"{name}: shard_dim must be 0, 1 or None, got {shard_dim!r}")
    size = (rows, cols)[shard_dim]
    if size % tp:
        raise InputError(f"{name}: tp={tp} does not divide dim {shard_dim} ({size}) of its {rows}x{cols} "
                         f"matrix; accepted: a TP degree dividing the sharded dimension")


@dataclass(frozen=True)
class TPModePrice:
    """What each mode costs for one TP-sharded matrix (seconds per TP rank that runs it, bytes summed over
    the TP group's ranks); see the module docstring."""

    group_ok: bool  # the blocks cut the long side (group mode possible)
    tall: bool  # group mode's orientation: row blocks (shard_dim 0; orthogonalize_distributed tall=True)
    group_s: float  # every TP rank's time in group mode (inf where not possible)
    group_comm_s: float
    group_bytes: float
    gather_s: float  # the owner's time: gather + NS + scatter
    gather_comm_s: float
    gather_bytes: float
    ns_s: float  # the whole matrix's NS on one rank (gather's and duplicated's compute)
    duplicated_s: float  # every TP rank: all-gather + NS (NaiveMuon)
    duplicated_bytes: float

    def best(self, tp: int) -> str:
        """The mode of fewer rank-seconds (what the DP share balances): tp x group_s against gather_s."""
        return "group" if self.group_ok and tp * self.group_s <= self.gather_s else "gather"


def price_tp_modes(rows: int, cols: int, shard_dim: int, tp: int, cost, *, method: str = "gram_sym",
                   dtype: str = "bf16", links=None, ranks=None, wire_bytes: int = 2) -> TPModePrice:
    """Both modes (and duplicated) of one rows x cols matrix sharded tp ways along shard_dim (module
    docstring). cost: a CostTable (ns_time); links: a split.LinkModel or an object with all_reduce_s /
    all_gather_s (default: the cost table's device); ranks: the TP group's global ranks (default 0..tp-1,
    one node); wire_bytes: the gather's bytes per element (2 = bf16 on the wire, 4 = fp32)."""
    _check_tp(tp)
    check_tp_shape(f"{rows}x{cols}", rows, cols, shard_dim, tp)
    if wire_bytes not in (2, 4):
        raise InputError(f"wire_bytes must be 2 (bf16) or 4 (fp32), got {wire_bytes!r}")
    links = links_for(cost, links)
    ranks = tuple(range(tp)) if ranks is None else tuple(ranks)
    n, m = min(rows, cols), max(rows, cols)
    group_ok = tp > 1 and (rows == cols or shard_dim == (0 if rows > cols else 1))
    tall = shard_dim == 0  # group mode's blocks are rows (orthogonalize_distributed tall=True)
    ns = cost.ns_time(n, m, 1, method, dtype).time_s
    size = rows * cols * wire_bytes
    move = links.all_gather_s(size, ranks)
    gather_bytes = 2 * (tp - 1) / tp * size
    if group_ok:
        sp = split_price(cost, n, m, 1, tp, method, dtype, links, ranks)
        group_s, group_comm = sp.time_s, sp.comm_s
        group_bytes = all_reduces_per_call(method) * 2 * (tp - 1) * n * (n + 1) / 2 * WIRE_BYTES
    else:
        group_s = group_comm = group_bytes = float("inf")
    return TPModePrice(group_ok=group_ok, tall=tall, group_s=group_s, group_comm_s=group_comm,
                       group_bytes=group_bytes, gather_s=ns + 2 * move, gather_comm_s=2 * move,
                       gather_bytes=gather_bytes, ns_s=ns, duplicated_s=ns + move,
                       duplicated_bytes=(tp - 1) * size)


def build_tp_plan(matrices: Sequence[MatrixSpec], world_size: int, cost, *, tp: int,
                  shard_dims: Sequence[int | None] | None = None, mode: str = "auto",
                  method: str = "gram_sym", dtype: str = "bf16", links=None, wire_bytes: int = 2,
                  bucket_numel: int = 0, method_for=None) -> Plan:
    """The plan for `matrices` on world_size = dp x tp ranks (module docstring). shard_dims: per matrix
    0 / 1 / None (default: `megatron_shard_dim` of each name); mode: auto | group | gather. Every
    TP-sharded matrix gets a `TPChoice` (Plan.tp_choices, in matrix order; None for a whole matrix).
    method "auto": each matrix is priced with `method_for(rows, cols)` (the runtime passes what its NS
    config runs), else with the cheapest of `flops.METHODS`; Batch.method says which."""
    from .build import make_buckets

    t_start = time.perf_counter()
    _check_tp(tp, world_size)
    if mode not in TP_MODE_CHOICES:
        raise choice_error("TP mode", mode, TP_MODE_CHOICES)
    matrices = tuple(matrices)
    if shard_dims is None:
        shard_dims = [megatron_shard_dim(m.name) for m in matrices]
    shard_dims = list(shard_dims)
    if len(shard_dims) != len(matrices):
        raise InputError(f"shard_dims has {len(shard_dims)} entries for {len(matrices)} matrices; accepted: "
                         "one per matrix (0, 1 or None)")
    if tp == 1:
        shard_dims = [None] * len(matrices)
    for m, s in zip(matrices, shard_dims, strict=True):
        check_tp_shape(m.name, m.rows, m.cols, s, tp)
        if s is not None and m.count != 1:
            raise InputError(f"{m.name}: a TP-sharded parameter must hold one matrix (count 1), got count "
                             f"{m.count}; accepted: TP on plain 2-D weights")
    links_model = links_for(cost, links) if tp > 1 else None

    def method_of(rows: int, cols: int) -> str:
        if method != "auto":
            return method
        if method_for is not None:
            return method_for(rows, cols)
        n, m = min(rows, cols), max(rows, cols)
        return min(METHODS, key=lambda k: (cost.ns_time(n, m, 1, k, dtype).time_s, k))
    dp = world_size // tp
    loads = [0.0] * world_size
    group_load = [0.0] * dp
    jobs = []  # (time, index, kind, price)
    meths = [method_of(m.rows, m.cols) for m in matrices]
    for i, (mat, s) in enumerate(zip(matrices, shard_dims, strict=True)):
        if s is None:
            t = cost.ns_time(min(mat.rows, mat.cols), max(mat.rows, mat.cols), mat.count, meths[i],
                             dtype).time_s
            jobs.append((t, i, "whole", None))
            continue
        price = price_tp_modes(mat.rows, mat.cols, s, tp, cost, method=meths[i], dtype=dtype,
                               links=links_model, wire_bytes=wire_bytes)
        kind = price.best(tp) if mode == "auto" else ("gather" if mode == "gather" or not price.group_ok
                                                     else "group")
        jobs.append((price.group_s if kind == "group" else price.gather_s, i, kind, price))
    owners = [0] * len(matrices)
    choices: list[TPChoice | None] = [None] * len(matrices)
    batches = []
    forced = 0
    pick = _LeastLoaded(loads, group_load, tp)
    for t, i, kind, price in sorted(jobs, key=lambda j: (-j[0], j[1])):
        mat = matrices[i]
        if kind == "group":  # the TP group whose busiest rank is least loaded
            d = pick.group()
            ranks = tuple(range(d * tp, (d + 1) * tp))
            for r in ranks:
                loads[r] += t
            group_load[d] += tp * t
            owner = ranks[0]
        else:  # the least loaded rank; among equals, the one of the least loaded TP group (spreads the
            # gathers over the TP groups' links)
            owner = pick.rank()
            loads[owner] += t
            group_load[owner // tp] += t
        pick.changed(owner // tp)
        owners[i] = owner
        if price is not None:
            forced += mode == "group" and not price.group_ok
            choices[i] = TPChoice(mode=kind, shard_dim=shard_dims[i], dp_index=owner // tp,
                                  owner=owner % tp if kind == "gather" else 0, tall=price.tall,
                                  time_s=t, group_bytes=price.group_bytes, gather_bytes=price.gather_bytes,
                                  group_s=price.group_s, gather_s=price.gather_s)
        batches.append(Batch(owner=owner, rows=min(mat.rows, mat.cols), cols=max(mat.rows, mat.cols),
                             members=(i,), time_s=t, method=meths[i] if method == "auto" else ""))
    batches.sort(key=lambda b: (b.owner, -matrices[b.members[0]].layer, b.members))
    work = sum(j[0] * (tp if j[2] == "group" else 1) for j in jobs)
    lb = max([work / world_size] + [j[0] for j in jobs])
    makespan = max(loads) if loads else 0.0
    summary = _summary(choices)
    notes = [f"lower bound {lb * 1e3:.3f} ms (all rank-seconds over {world_size} ranks, longest matrix)",
             f"tensor parallelism: tp={tp}, dp={dp}; {summary['group']['count']} matrices by TP-group NS, "
             f"{summary['gather']['count']} gathered to one owner, "
             f"{sum(s is None for s in shard_dims)} whole"]
    if forced:
        notes.append(f"mode='group': {forced} matrices sharded along their short side were gathered instead")
    return Plan(world_size=world_size, matrices=matrices, owners=tuple(owners), batches=tuple(batches),
                buckets=make_buckets(matrices, bucket_numel), balancer="lpt", method=method, dtype=dtype,
                cost_source=getattr(cost, "name", type(cost).__name__), makespan_s=makespan,
                lower_bound_s=lb, solve_time_s=time.perf_counter() - t_start,
                gap=max(0.0, (makespan - lb) / makespan) if makespan > 0 else 0.0, notes=tuple(notes),
                tp=tp, tp_choices=tuple(choices) if tp > 1 else ())


class _LeastLoaded:
    """The LPT's choices in O(log n) each instead of a scan over every rank (a plan over 16,384 ranks):
    `rank()` = min(range(world), key=(loads[r], group_load[r // tp], r)), `group()` =
    min(range(dp), key=(max of the group's loads, d)), the same answers as those scans (keys are unique
    and only grow, so each heap holds every current key, and stale entries, smaller, are dropped on
    top). Call `changed(d)` after TP group d's loads or group load change."""

    def __init__(self, loads: list[float], group_load: list[float], tp: int):
        import heapq

        self.loads, self.group_load, self.tp, self.hq = loads, group_load, tp, heapq
        self.ranks = [self._rank_key(r) for r in range(len(loads))]
        self.groups = [self._group_key(d) for d in range(len(group_load))]
        heapq.heapify(self.ranks)
        heapq.heapify(self.groups)

    def _rank_key(self, r: int) -> tuple:
        return (self.loads[r], self.group_load[r // self.tp], r)

    def _group_key(self, d: int) -> tuple:
        return (max(self.loads[d * self.tp:(d + 1) * self.tp]), d)

    def _top(self, heap: list, key) -> int:
        while heap[0] != key(heap[0][-1]):
            self.hq.heappop(heap)
        return heap[0][-1]

    def rank(self) -> int:
        return self._top(self.ranks, self._rank_key)

    def group(self) -> int:
        return self._top(self.groups, self._group_key)

    def changed(self, d: int) -> None:
        for r in range(d * self.tp, (d + 1) * self.tp):
            self.hq.heappush(self.ranks, self._rank_key(r))
        self.hq.heappush(self.groups, self._group_key(d))


def _summary(choices) -> dict:
    out = {k: {"count": 0, "bytes": 0.0, "group_bytes": 0.0, "gather_bytes": 0.0, "seconds": 0.0}
           for k in TP_MODES}
    for c in choices:
        if c is None:
            continue
        s = out[c.mode]
        s["count"] += 1
        s["bytes"] += c.group_bytes if c.mode == "group" else c.gather_bytes
        s["group_bytes"] += c.group_bytes
        s["gather_bytes"] += c.gather_bytes
        s["seconds"] += c.time_s
    return out


def tp_summary(plan: Plan) -> dict:
    """Per mode (group, gather): matrices, the bytes the chosen mode moves, what group and gather would
    each move for those matrices, and their seconds; plus 'all_gather_bytes': every TP matrix gathered."""
    out = _summary(plan.tp_choices)
    out["all_gather_bytes"] = sum(c.gather_bytes for c in plan.tp_choices if c is not None)
    out["tp"] = plan.tp
    return out
