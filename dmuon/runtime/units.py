"""Exchange units: one communication bucket's packed buffers and the jobs that move them.

`OwnerUnit` (DMuon): the bucket's gradients are summed onto their owners (`reduce_to_owners`): the
owner of each Muon matrix, or, for AdamW parameters, the rank owning each 1/N slice (ZeRO-style);
after the step the owners' new weights are published to every rank (`publish_from_owners`), which
copies them into its parameters (on the communication thread, so the compute thread only waits where
a module needs its weights).
`AllReduceUnit` (NaiveMuon, replicated AdamW): the summed gradient of every member lands on every rank.
`build_units` makes a distributed optimizer's units from its plan (Muon buckets, AdamW groups).

The compute thread packs (`pack`: gradient, or zeros where a parameter has none this step) and submits;
the communication thread runs the collectives. A unit never repacks a buffer still in flight.
Buffers use the members' promoted dtype on their device (gradient buffers: `comm_dtype` where given, e.g.
bf16 gradients on the wire; the weights an OwnerUnit publishes always travel in the parameters' dtype, so
every replica holds exactly the owner's weights); they are allocated once, or (OwnerUnit with
transient=True, the FSDP2 owner layout) at each launch and dropped as soon as the job is done with them.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch

from .comm import CommWorker, Handle
from .exchange import (
    LinkEstimate,
    OwnerLayout,
    all_reduce_sum,
    choose_mode,
    default_links,
    padded_numel,
    publish_from_owners,
    reduce_to_owners,
)
from .groups import CommGroups


@dataclass
class Member:
    """One parameter in a unit (its global index in the optimizer's parameter list), or a contiguous part
    of one: elements [start, start + numel) of the flattened parameter (an expert matrix of a 3-D expert
    parameter, `dmuon.runtime.ep`; its index is then the plan's)."""

    index: int
    name: str
    param: torch.Tensor
    owner: int = -1  # owning rank (OwnerUnit) or -1 (everyone)
    start: int = 0
    numel: int | None = None  # None: the whole parameter

    def __post_init__(self) -> None:
        if self.numel is None:
            self.numel = self.param.numel()


def merge_copies(copies: list[tuple]) -> list[tuple]:
    """(param, lo, hi, offset) copies between elements [lo, hi) of a flattened parameter and a buffer at
    `offset`, with each copy that continues the previous one in both merged into it (one copy per run of
    consecutive expert slices with one owner instead of one per slice)."""
    out: list[tuple] = []
    for p, lo, hi, off in copies:
        if out and out[-1][0] is p and out[-1][2] == lo and out[-1][3] + (lo - out[-1][1]) == off:
            out[-1] = (p, out[-1][1], hi, out[-1][3])
        else:
            out.append((p, lo, hi, off))
    return out


def _buffer_dtype(members: list[Member]) -> torch.dtype:
    dtype = members[0].param.dtype
    for m in members[1:]:
        dtype = torch.promote_types(dtype, m.param.dtype)
    return dtype


class _Unit:
    kind = ""

    def __init__(self, position: int, members: list[Member], groups: CommGroups, worker: CommWorker,
                 comm_dtype: torch.dtype | None = None):
        self.position = position  # launch order (0 = first ready in backward)
        self.members = members
        self.groups = groups
        self.worker = worker
        self.device = members[0].param.device
        self.dtype = _buffer_dtype(members)
        self.grad_dtype = comm_dtype or self.dtype  # gradients on the wire
        self.reduce_handle: Handle | None = None
        self.has_grad: list[bool] = [False] * len(members)  # at the last pack
        self._offsets: list[int] = []
        self._grad_buf: torch.Tensor | None = None
        self._buf_numel = 0
        self._pack_copies: list[tuple] | None = None  # merged (param, lo, hi, offset), at the first pack
        self.consume_grads = False  # True: a member's .grad is dropped once packed (FSDP2 owner layout)

    @property
    def params(self) -> list[torch.Tensor]:
        return [m.param for m in self.members]

    def _alloc(self, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype or self.dtype, device=self.device)

    def _alloc_grad(self, numel: int) -> torch.Tensor:
        return self._alloc(numel, self.grad_dtype)

    def pack(self) -> None:
        """Copy each member's local gradient (zeros where it has none) into the send buffer."""
        if self.reduce_handle is not None and not self.reduce_handle.done():
            self.reduce_handle.wait()  # a second backward before step(): the buffer is still in flight
        if self._grad_buf is None:
            self._grad_buf = self._alloc_grad(self._buf_numel)
        buf = self._grad_buf
        if self._pack_copies is None:
            self._pack_copies = merge_copies([(m.param, m.start, m.start + m.numel, off)
                                              for m, off in zip(self.members, self._offsets, strict=True)])
        self.has_grad = [m.param.grad is not None for m in self.members]
        for p, lo, hi, off in self._pack_copies:
            view = buf.narrow(0, off, hi - lo)
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1)[lo:hi])
        if self.consume_grads:
            for m in self.members:
                m.param.grad = None

    def wait_reduce(self) -> None:
        if self.reduce_handle is not None:
            self.reduce_handle.wait()

    def buffer_bytes(self, dtype: torch.dtype | None = None) -> int:
        return self._buf_numel * torch.empty(0, dtype=dtype or self.dtype).element_size()

    def sent_bytes(self, factor: float, dtype: torch.dtype | None = None) -> int:
        """Estimated bytes this rank sends for one collective pass over the buffer (in `dtype`, default
        the parameters'): `factor` x size, with factor (N-1)/N for reduce-scatter, all-gather, per-owner
        reduce / broadcast (ring or chain algorithms) and 2 (N-1)/N for all-reduce."""
        n = self.groups.world_size
        return int(self.buffer_bytes(dtype) * factor * (n - 1) / n)


class AllReduceUnit(_Unit):
    """Members' gradients summed on every rank (DDP-style bucket)."""

    kind = "all_reduce"

    def __init__(self, position: int, members: list[Member], groups: CommGroups, worker: CommWorker,
                 comm_dtype: torch.dtype | None = None):
        super().__init__(position, members, groups, worker, comm_dtype)
        pos = 0
        for m in members:
            self._offsets.append(pos)
            pos += m.numel
        total = padded_numel(pos, groups)
        self._buf_numel = total
        self._grad_buf = self._alloc_grad(total)
        g = groups.node_size if groups.two_level else 1
        self._tmp = self._alloc_grad(total // g) if groups.two_level else None

    def launch_reduce(self, name: str) -> Handle:
        self.pack()
        buf, groups, tmp = self._grad_buf, self.groups, self._tmp
        self.reduce_handle = self.worker.submit(name, lambda: all_reduce_sum(buf, groups, tmp),
                                                kind="grad_all_reduce",
                                                bytes_=self.sent_bytes(2, self.grad_dtype))
        return self.reduce_handle

    def grad(self, k: int) -> torch.Tensor:
        """Summed gradient of member k (flat view into the buffer; valid after wait_reduce)."""
        return self._grad_buf.narrow(0, self._offsets[k], self.members[k].numel)

    def scale_(self, factor: float) -> None:
        self._grad_buf.mul_(factor)

    def local_pieces(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """(k, lo, hi, summed gradient) of what this rank updates: every member, whole."""
        return [(k, 0, m.numel, self.grad(k)) for k, m in enumerate(self.members)]

    def readable(self) -> torch.Tensor:
        """The part of the summed buffer this rank reads (for a one-pass non-finite check)."""
        return self._grad_buf


def auto_mode(numels, owners, groups: CommGroups, links: LinkEstimate | None = None,
              elem_bytes: int = 2, per_node: int | None = None) -> str:
    """The exchange mode "auto" picks for one bucket: `exchange.choose_mode` (gloo: "reduce"; NCCL: the
    cheaper of one padded reduce-scatter and one reduce per owner, priced with `links`, default the
    GPU's entry of exchange.LINKS). Ranks per node: node_size if given, else `per_node`, else torchrun's
    LOCAL_WORLD_SIZE (else one node)."""
    padded = OwnerLayout(numels, owners, groups, "reduce_scatter")
    n = groups.world_size
    if groups.node_size:
        p = groups.node_size
    else:
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        p = per_node or (int(env) if env.isdigit() else n)
        p = p if 0 < p <= n and n % p == 0 else n
    held = [o for o in range(n) if padded.chunk_numel[o] > 0]
    per_local = Counter(o % p for o in held)
    return choose_mode(padded.payload * elem_bytes, padded.chunk_cap * elem_bytes, len(held),
                       max(per_local.values(), default=1), n, p, groups.two_level,
                       links or default_links(), groups.backend)


class OwnerUnit(_Unit):
    """Members' gradients summed onto their owners; owners' new weights published to everyone.

    sharded=False: each member has one owner (`Member.owner`, Muon matrices). sharded=True: the members
    are split evenly over the ranks, ZeRO-style (AdamW parameters); a rank owns pieces of them.
    mode: "reduce_scatter" | "reduce" (see exchange.py) or "auto" (`auto_mode`).
    `pieces` lists this rank's pieces as (k, lo, hi): elements [lo, hi) of member k's flattened tensor.
    transient: buffers allocated per launch and dropped after use (memory only while in flight).
    pub_worker / pub_groups: run publications on another communication thread and process group
    (memory='free', whose publications are triggered from forward and backward hooks).
    per_node: ranks of `groups` per node, for mode "auto" (see `auto_mode`).
    """

    kind = "owner"

    def __init__(self, position: int, members: list[Member], groups: CommGroups, worker: CommWorker,
                 mode: str, sharded: bool = False, transient: bool = False,
                 pub_worker: CommWorker | None = None, pub_groups: CommGroups | None = None,
                 comm_dtype: torch.dtype | None = None, per_node: int | None = None):
        super().__init__(position, members, groups, worker, comm_dtype)
        self.sharded = sharded
        self.transient = transient
        self.pub_worker = pub_worker or worker
        self.pub_groups = pub_groups or groups
        self._before_copy = None
        numels = [m.numel for m in members]
        owners = None if sharded else [m.owner for m in members]
        if mode == "auto":
            mode = auto_mode(numels, owners, groups, elem_bytes=members[0].param.element_size(),
                             per_node=per_node)
        self.layout = OwnerLayout(numels, owners, groups, mode)
        self._offsets = list(self.layout.offsets)
        self._buf_numel = self.layout.total
        self._rs = mode == "reduce_scatter"
        self._grad_buf = self._pub_buf = self._out = self._mine = self._tmp = self._rtmp = None
        if not transient:
            self._alloc_buffers()
        self._reduced: torch.Tensor | None = None
        self.publish_handle: Handle | None = None
        me = groups.rank
        self._chunk_start = self.layout.chunk_start[me]
        self._my_pieces = self.layout.pieces[me]  # (k, lo, hi, buffer offset)
        self.pieces = [(k, lo, hi) for k, lo, hi, _ in self._my_pieces]
        self.owned = sorted({k for k, *_ in self._my_pieces if not sharded})
        # what the publication job copies into parameters: every piece that is not this rank's
        mine = {(k, lo) for k, lo, _, _ in self._my_pieces}
        def copy(k, lo, hi, off):  # piece -> (param, lo, hi, offset) in the flattened parameter
            return members[k].param, members[k].start + lo, members[k].start + hi, off

        self._others = merge_copies([copy(*piece) for o in range(groups.world_size)
                                     for piece in self.layout.pieces[o] if o != me and piece[:2] not in mine])
        self._mine_copies = merge_copies([copy(*piece) for piece in self._my_pieces])  # into the send chunk

    def _alloc_buffers(self) -> None:
        cap = self.layout.chunk_cap
        if self._grad_buf is None:
            self._grad_buf = self._alloc_grad(self.layout.total)
        if self._pub_buf is None:
            self._pub_buf = self._alloc(self.layout.total)
        if self._rs:
            self._out = self._out if self._out is not None else self._alloc_grad(cap)
            self._mine = self._mine if self._mine is not None else self._alloc(cap)
            if self.groups.two_level and self._tmp is None:
                self._tmp = self._alloc(cap * self.groups.n_nodes)
                same = self.grad_dtype == self.dtype  # the reduce's staging buffer, in the wire dtype
                self._rtmp = self._tmp if same else self._alloc_grad(cap * self.groups.n_nodes)

    def retarget(self, targets: dict[int, torch.Tensor], before_copy) -> None:
        """Publication copies into `targets[id(param)]` (an alias of the parameter's storage) instead of
        the parameter, after calling `before_copy()` on the communication thread (memory='free')."""
        self._others = [(targets.get(id(p), p), lo, hi, off) for p, lo, hi, off in self._others]
        self._before_copy = before_copy

    def launch_reduce(self, name: str) -> Handle:
        self.pack()
        self._reduced = None
        buf, layout, groups = self._grad_buf, self.layout, self.groups
        if self.transient:
            cap, nodes = layout.chunk_cap, groups.n_nodes
            out = self._alloc_grad(cap) if self._rs else None
            tmp = self._alloc_grad(cap * nodes) if self._rs and groups.two_level else None
            self._grad_buf = None  # the job holds it until the collective is done
        else:
            out, tmp = self._out, self._rtmp
        transient = self.transient

        def job():
            summed = reduce_to_owners(buf, layout, groups, out=out, tmp=tmp)
            return summed.clone() if transient and out is None else summed

        self.reduce_handle = self.worker.submit(name, job, kind="grad_to_owner",
                                                bytes_=self.sent_bytes(1, self.grad_dtype))
        return self.reduce_handle

    def _summed(self) -> torch.Tensor:
        if self._reduced is None:
            self._reduced = self.reduce_handle.wait()
        return self._reduced

    def piece_grad(self, j: int) -> torch.Tensor:
        """Summed gradient of this rank's piece j (flat; valid after wait_reduce)."""
        k, lo, hi, off = self._my_pieces[j]
        return self._summed().narrow(0, off - self._chunk_start, hi - lo)

    def grad(self, k: int, count: int = 1) -> torch.Tensor:
        """Summed gradient of an owned (whole) member k (flat), or of the owned members k .. k + count - 1
        as one flat view (consecutive members of one owner lie end to end in its chunk)."""
        numel = sum(m.numel for m in self.members[k:k + count])
        return self._summed().narrow(0, self.layout.offsets[k] - self._chunk_start, numel)

    def scale_(self, factor: float) -> None:
        """Scale this rank's summed chunk (the only part it reads)."""
        self.readable().mul_(factor)

    def readable(self) -> torch.Tensor:
        return self._summed().narrow(0, 0, self.layout.chunk_numel[self.groups.rank])

    def local_pieces(self) -> list[tuple[int, int, int, torch.Tensor]]:
        """(k, lo, hi, summed gradient) of this rank's pieces."""
        return [(k, lo, hi, self.piece_grad(j)) for j, (k, lo, hi) in enumerate(self.pieces)]

    def wait_reduce(self) -> None:
        if self.reduce_handle is not None:
            self._reduced = self.reduce_handle.wait()

    def launch_publish(self, name: str) -> Handle | None:
        """Copy this rank's (already updated) pieces into its send chunk and publish; the job copies
        every other rank's pieces into the parameters. One rank alone has nothing to publish: None."""
        if self.pub_groups.world_size == 1:
            self._reduced = None
            return None
        if self.transient:  # every element is written by the collectives: no need to zero
            cap, groups = self.layout.chunk_cap, self.pub_groups
            buf = torch.empty(self.layout.total, dtype=self.dtype, device=self.device)
            mine = self._alloc(cap) if self._rs else None
            tmp = self._alloc(cap * groups.n_nodes) if self._rs and groups.two_level else None
        else:
            buf, mine, tmp, groups = self._pub_buf, self._mine, self._tmp, self.pub_groups
        if self.layout.mode == "reduce":
            chunk, base = buf, 0
        else:
            chunk, base = mine, self._chunk_start
        for p, lo, hi, off in self._mine_copies:
            chunk.narrow(0, off - base, hi - lo).copy_(p.detach().reshape(-1)[lo:hi])
        layout, others, before_copy = self.layout, self._others, self._before_copy

        def job():
            publish_from_owners(buf, layout, groups, mine=mine, tmp=tmp)
            if before_copy is not None:
                before_copy()
            for p, lo, hi, off in others:
                p.detach().view(-1)[lo:hi].copy_(buf.narrow(0, off, hi - lo))

        self._reduced = None
        self.publish_handle = self.pub_worker.submit(name, job, kind="weight_publish",
                                                     bytes_=self.sent_bytes(1))
        return self.publish_handle

    def wait_publish(self) -> None:
        h = self.publish_handle
        if h is not None:
            h.wait()
            self.publish_handle = None


SMALL_ADAMW = 1 << 16  # AdamW parameters up to this many elements ride in their layer's Muon bucket


def build_units(opt, exchange: str, bucket_numel: int) -> list:
    """Exchange units in launch order (reverse forward layer). Muon matrices: the plan's buckets.
    AdamW parameters of at most SMALL_ADAMW elements ride in the bucket of their layer (DMuon: owned
    by the rank owning the fewest elements of that bucket); the others form one unit per layer (a
    small one joins the unit launched just before it; with bucket_numel, units grow to that size);
    DMuon shards those evenly over the ranks (shard_adamw)."""
    entries = []  # [min layer, members, kind]
    by_layer = {}
    if opt.plan is not None and opt._muon_units:
        for b in opt.plan.buckets:
            members = [Member(i, opt.names[i], opt.params[i], opt.plan.owners[i]) for i in b.members]
            e = [min(opt.layers[i] for i in b.members), members, "muon"]
            entries.append(e)
            for i in b.members:
                by_layer.setdefault(opt.layers[i], e)
    groups: list[list[int]] = []
    for i in range(opt.n_muon, len(opt.params)):
        if opt.local[i]:
            continue
        e = by_layer.get(opt.layers[i])
        if e is not None and opt.params[i].numel() <= SMALL_ADAMW:
            load = [0] * opt.world_size
            for m in e[1]:
                load[m.owner] += m.param.numel()
            e[1].append(Member(i, opt.names[i], opt.params[i], load.index(min(load))))
        elif groups and opt.layers[groups[-1][-1]] == opt.layers[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    merged: list[list[int]] = []  # built in launch order (reverse forward): a small group joins the
    for g in reversed(groups):    # group launched just before it
        size = sum(opt.params[i].numel() for i in g)
        last = sum(opt.params[i].numel() for i in merged[-1]) if merged else 0
        if merged and (size <= SMALL_ADAMW or (bucket_numel and last < bucket_numel)):
            merged[-1] = g + merged[-1]
        else:
            merged.append(list(g))
    for g in merged:
        members = [Member(i, opt.names[i], opt.params[i]) for i in g]
        entries.append([min(opt.layers[i] for i in g), members, "adamw"])
    entries.sort(key=lambda e: (-e[0], e[2] != "muon"))
    units = []
    for pos, (_, members, kind) in enumerate(entries):
        if not opt.owner_centric or (kind == "adamw" and not opt.shard_adamw):
            units.append(AllReduceUnit(pos, members, opt.groups, opt._worker, opt.comm_dtype))
        else:
            fsdp = opt.layout == "fsdp2-owner"  # memory matters: buffers only while in flight
            units.append(OwnerUnit(pos, members, opt.groups, opt._worker, exchange,
                                   sharded=kind == "adamw", transient=fsdp,
                                   pub_worker=opt._pub_worker, pub_groups=opt._pub_groups,
                                   comm_dtype=opt.comm_dtype))
            units[-1].consume_grads = fsdp
    return units
