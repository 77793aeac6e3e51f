"""The plan's data types: pure data, no torch.

A `Plan` is computed once from matrix shapes and a cost table (see `dmuon.plan.build`), then
executed by the real runtime (`dmuon.runtime`) and timed by the simulator (`simulator`). Neither
executor re-derives owners, batches or buckets: they read them from here.

Indices: every reference to a matrix is its index into `Plan.matrices`.

Owner groups (split NS, `dmuon.orthogonalize_distributed`). A batch may be run by a group of k ranks
(`Batch.group`, an aligned block of k consecutive ranks, k a power of two) that split its matrices'
long side; `Batch.owner` is the group's lead (its first rank) and `Plan.owners[i]` stays the lead owner
of matrix i, so code that knows only owners keeps working; `Plan.groups[i]` is the whole group (a
1-tuple for unsplit matrices). Where the layout runs the momentum on the owner (`owner_momentum`,
the default), a batch's `time_s` includes the owner's momentum pass over its members
(`Batch.momentum_s`), so loads and the makespan price the owner's whole per-batch work.
A split batch's `time_s` is what every member spends (compute + the
group's collectives, `comm_s` of it). Every rank is in at most one split batch, so groups never overlap
and no rank orders the collectives of two groups. `Plan.loads_s` charges a split batch to every member;
`batches_of(rank)` lists every batch the rank takes part in.

JSON: a plan without groups serializes exactly as before (format_version 1, no group keys); one with
groups writes format_version 2 with "group" / "comm_s" on its split batches and "max_split"; a plan with
tensor parallelism (`dmuon.plan.tp`, tp > 1) writes format_version 3 with "tp" and "tp_choices" (one
`TPChoice` or null per matrix); all three load.

Tensor parallelism (tp > 1): `tp_choices[i]` says how TP-sharded matrix i is orthogonalized (mode
"group": its TP group's distributed Gram NS, "gather": gathered to one TP rank), by which TP group
(`dp_index`), and what both modes would move (bytes) and cost (seconds); `owners[i]` is the TP group's
lead (group) or the owner (gather); its Batch (one matrix) has no `group`, so split NS code never sees it
(and `loads_s` charges a group-mode matrix to the lead only; the plan's makespan charges every member).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

PLAN_FORMAT_VERSION = 1  # plans without groups (written as before)
GROUPS_FORMAT_VERSION = 2  # plans with split batches
TP_FORMAT_VERSION = 3  # plans with tensor parallelism (tp > 1)


@dataclass(frozen=True)
class MatrixSpec:
    """One Muon-managed weight matrix, as the planner sees it.

    rows, cols: the parameter's 2-D shape (out_features, in_features for nn.Linear).
    layer: forward-order index of the block the matrix belongs to (0 = first used in forward);
        communication buckets follow this order so their exchange can overlap compute.
    name: unique name (a module parameter name, or "<component>.<layer>.<matrix>" for workloads).
    count: how many matrices of (rows, cols) this entry holds: one parameter that holds several
        (`dmuon.matrices.MatrixLayout`: fused experts, fused QKV / gate-up, per-head blocks), owned by one
        rank and orthogonalized each alone in the owner's batched call (a batch of b entries is one call
        of b x count matrices); 1 (the default) = one matrix.
    """

    name: str
    rows: int
    cols: int
    layer: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        for attr in ("rows", "cols"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"MatrixSpec {self.name!r}: {attr} must be a positive integer, got {v!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"MatrixSpec {self.name!r}: count must be a positive integer, "
                             f"got {self.count!r}")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"MatrixSpec {self.name!r}: layer must be a non-negative integer, "
                             f"got {self.layer!r}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class Batch:
    """A stack of same-shape matrices that one owner orthogonalizes in one batched call."""

    owner: int
    rows: int
    cols: int
    members: tuple[int, ...]  # matrix indices
    time_s: float  # cost-table time of this batched call
    method: str = ""  # NS method of this call; "" = the plan's method (differs only for method "auto")
    group: tuple[int, ...] = ()  # the ranks that split this batch (owner first); () = the owner alone
    comm_s: float = 0.0  # the group's collectives, included in time_s (0 without a group)
    momentum_s: float = 0.0  # the owner's momentum pass over the members, included in time_s
    # (`balance.momentum_time`; 0 where the plan's layout runs the momentum on shards: owner_momentum)

    @property
    def ns_s(self) -> float:
        """The orthogonalization call alone (compute + the group's collectives)."""
        return self.time_s - self.momentum_s

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that run this batch: the group, or the owner alone."""
        return self.group or (self.owner,)


@dataclass(frozen=True)
class TPChoice:
    """How one TP-sharded matrix is orthogonalized (`dmuon.plan.tp`): mode "group" (the TP group's
    distributed Gram NS in place) or "gather" (to TP rank `owner` of the group, NS, scatter back)."""

    mode: str
    shard_dim: int  # 0: column-parallel (rows cut), 1: row-parallel (columns cut)
    dp_index: int  # the TP group (data-parallel index) that runs it
    owner: int  # gather: the TP rank that runs the NS (0 for group)
    tall: bool  # rows > cols: group mode passes tall=True (row blocks)
    time_s: float  # the chosen mode's seconds
    group_bytes: float  # bytes group mode moves (inf where the blocks cut the short side)
    gather_bytes: float  # bytes gather-to-owner moves
    group_s: float
    gather_s: float


@dataclass(frozen=True)
class Bucket:
    """A communication unit: matrices whose gradient delivery / weight publication go together.

    Buckets are listed in forward layer order; backward produces them in reverse order.
    """

    index: int
    members: tuple[int, ...]  # matrix indices, in forward order

    def numel(self, matrices: tuple[MatrixSpec, ...]) -> int:
        return sum(matrices[i].numel for i in self.members)


@dataclass(frozen=True)
class Plan:
    """Owners, batches and buckets for one model on one process group."""

    world_size: int
    matrices: tuple[MatrixSpec, ...]
    owners: tuple[int, ...]  # owners[i] = rank that runs matrix i's orthogonalization
    batches: tuple[Batch, ...]
    buckets: tuple[Bucket, ...]
    balancer: str
    method: str  # orthogonalization method the costs assume: "standard" | "standard_sym" | "gram" |
    # "gram_sym" | "auto" (cheapest per batch: see Batch.method)
    dtype: str  # iteration dtype the costs assume: "bf16" | "fp16" | "fp32"
    cost_source: str  # which cost table / profile priced the work
    makespan_s: float
    lower_bound_s: float
    solve_time_s: float
    gap: float = 0.0  # proven relative optimality gap (MILP); 0 for exact or not applicable
    notes: tuple[str, ...] = field(default_factory=tuple)
    max_split: int = 1  # the largest group the balancer could use (1 = no splitting)
    ep: int = 1  # expert-parallel degree the plan places experts for (dmuon.plan.ep; 1 = none)
    tp: int = 1  # tensor-parallel degree (dmuon.plan.tp; 1 = none)
    tp_choices: tuple[TPChoice | None, ...] = ()  # per matrix when tp > 1 (None: not TP-sharded)

    # ---- derived views -------------------------------------------------------------------
    @property
    def loads_s(self) -> tuple[float, ...]:
        """Owner seconds per rank: its batches' times (NS + owner momentum; a split batch counts on every
        member)."""
        return self._loads(lambda b: b.time_s)

    @property
    def ns_loads_s(self) -> tuple[float, ...]:
        """Orthogonalization seconds per rank: `loads_s` less the batches' momentum (`Batch.ns_s`)."""
        return self._loads(lambda b: b.ns_s)

    def _loads(self, seconds) -> tuple[float, ...]:
        loads = [0.0] * self.world_size
        for b in self.batches:
            for r in b.ranks:
                loads[r] += seconds(b)
        return tuple(loads)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """groups[i] = the ranks that orthogonalize matrix i (lead first; (owners[i],) when unsplit)."""
        out = [(o,) for o in self.owners]
        for b in self.batches:
            if b.group:
                for i in b.members:
                    out[i] = b.group
        return tuple(out)

    @property
    def split_batches(self) -> tuple[Batch, ...]:
        return tuple(b for b in self.batches if b.group)

    @property
    def efficiency(self) -> float:
        return self.lower_bound_s / self.makespan_s if self.makespan_s > 0 else 1.0

    def batches_of(self, rank: int) -> tuple[Batch, ...]:
        """The batches `rank` runs, whole or as a member of their group, in plan order."""
        return tuple(b for b in self.batches if rank in b.ranks)

    def owned_by(self, rank: int) -> tuple[int, ...]:
        return tuple(i for i, o in enumerate(self.owners) if o == rank)

    # ---- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        grouped = any(b.group for b in self.batches)
        for b in d["batches"]:
            if not b["group"]:
                del b["group"], b["comm_s"]
            if not b["momentum_s"]:
                del b["momentum_s"]  # plans priced on NS seconds alone serialize as before
        if not grouped and self.max_split == 1:
            del d["max_split"]
        if self.ep == 1:
            del d["ep"]  # plans without expert parallelism serialize as before
        d["format_version"] = GROUPS_FORMAT_VERSION if grouped else PLAN_FORMAT_VERSION
        if self.tp == 1:
            del d["tp"], d["tp_choices"]  # plans without tensor parallelism serialize as before
        else:
            d["format_version"] = TP_FORMAT_VERSION
            for c in d["tp_choices"]:  # JSON has no infinity: a group mode that is not possible is null
                if c is not None and c["group_bytes"] == float("inf"):
                    c["group_bytes"] = c["group_s"] = None
        return d

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        d = dict(d)
        version = d.pop("format_version", PLAN_FORMAT_VERSION)
        if version not in (PLAN_FORMAT_VERSION, GROUPS_FORMAT_VERSION, TP_FORMAT_VERSION):
            raise ValueError(f"plan format version {version} is not supported (expected "
                             f"{PLAN_FORMAT_VERSION}, {GROUPS_FORMAT_VERSION} or {TP_FORMAT_VERSION})")
        inf = float("inf")
        d["tp_choices"] = tuple(
            None if c is None else TPChoice(**{k: inf if v is None and k in ("group_bytes", "group_s")
                                               else v for k, v in c.items()})
            for c in d.get("tp_choices", ()))
        d["matrices"] = tuple(MatrixSpec(**m) for m in d["matrices"])
        d["owners"] = tuple(d["owners"])
        d["batches"] = tuple(
            Batch(owner=b["owner"], rows=b["rows"], cols=b["cols"], members=tuple(b["members"]),
                  time_s=b["time_s"], method=b.get("method", ""), group=tuple(b.get("group", ())),
                  comm_s=b.get("comm_s", 0.0), momentum_s=b.get("momentum_s", 0.0)) for b in d["batches"]
        )
        d["buckets"] = tuple(Bucket(index=b["index"], members=tuple(b["members"])) for b in d["buckets"])
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
