"""Owner-aligned packed buffers and the collectives that move them (flat or two-level).

`OwnerLayout` places a list of tensors (one communication bucket) in one flat buffer in which each
rank owns one contiguous chunk: either the tensors it owns (Muon matrices, one owner each), or an even
1/N slice of the concatenated tensors (AdamW parameters, ZeRO-style). Two exchange modes:

  "reduce"          chunks unpadded, in rank order. Gradients: one reduce per owner chunk to its owner;
                    weights: one broadcast per chunk from its owner. No padding, N collectives per bucket.
  "reduce_scatter"  every chunk padded to the largest one (C elements), so one reduce-scatter delivers
                    each owner its chunk and one all-gather publishes them: 1 collective per bucket and
                    (N C - sum chunk) elements of padding.
  "auto" (units.auto_mode) takes, per bucket, the mode `choose_mode` prices lower: padding's extra bytes
  over the bandwidth against one latency per owner (`exchange_costs_s`, NCCL's latency constants and a
  per-GPU bandwidth estimate, `LINKS`: the plan's fabric table); the simulator chooses with the same
  function.

Two-level (`CommGroups.two_level`, g ranks per node): "reduce" runs an intra-node reduce to the rank
with the owner's local index, then an inter-node reduce among the ranks with that local index (mirror
for broadcast); "reduce_scatter" orders chunks local-major (slot = local * n_nodes + node) so an
intra-node reduce-scatter followed by an inter-node reduce-scatter lands each chunk on its owner
(all-gathers in the mirror order). All-reduce (`all_reduce_sum`) is flat, or intra reduce-scatter ->
inter all-reduce -> intra all-gather.

These functions issue blocking collectives: call them from the communication thread (`comm.py`).
They depend only on flat buffers and owners, not on how parameters are stored (replicated or sharded).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..plan.exchange_cost import (  # noqa: F401  (re-exported: the runtime's names for the cost model)
    DEFAULT_LINKS,
    EXCHANGE_CHOICES,
    EXCHANGE_MODES,
    LINKS,
    LinkEstimate,
    choose_mode,
    exchange_costs_s,
    links_from_model,
)
from .groups import CommGroups


def default_links(device_name: str | None = None) -> LinkEstimate:
    """The table entry whose key the device's name contains (default: the current CUDA device)."""
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    name = device_name.lower()
    key = next((k for k in sorted(LINKS, key=len, reverse=True) if k in name), DEFAULT_LINKS)
    return LINKS[key]


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class OwnerLayout:
    """Where each tensor of a bucket sits in the flat buffer, and which rank owns which part of it.

    owners given: tensor k belongs wholly to rank owners[k] (Muon matrices). owners None: the tensors are
    laid end to end and the buffer is split evenly, chunk o to rank o (ZeRO-style shards; a tensor can
    straddle chunks). `pieces[o]` lists what rank o owns as (k, lo, hi, offset): elements [lo, hi) of
    tensor k, at buffer offset `offset`. See the module docstring for the two modes.
    """

    def __init__(self, numels: Sequence[int], owners: Sequence[int] | None, groups: CommGroups, mode: str):
        if mode not in EXCHANGE_MODES:
            raise ValueError(f"unknown exchange mode {mode!r}; accepted: {', '.join(EXCHANGE_MODES)}")
        n = groups.world_size
        self.mode, self.world_size = mode, n
        self.numels = [int(x) for x in numels]
        rs = mode == "reduce_scatter"
        if rs and groups.two_level:
            self.slot = [groups.local_of(o) * groups.n_nodes + groups.node_of(o) for o in range(n)]
        else:
            self.slot = list(range(n))
        self.pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n)]
        if owners is None:
            self._even(n, rs)
        else:
            self._by_owner(list(owners), n, rs)

    def _by_owner(self, owners: list[int], n: int, rs: bool) -> None:
        self.chunk_numel = [0] * n
        within = []
        for numel, o in zip(self.numels, owners, strict=True):
            within.append(self.chunk_numel[o])
            self.chunk_numel[o] += numel
        self.chunk_cap = max(self.chunk_numel)
        if rs:
            self.chunk_start = [self.slot[o] * self.chunk_cap for o in range(n)]
            self.total = n * self.chunk_cap
        else:
            self.chunk_start, pos = [0] * n, 0
            for o in range(n):
                self.chunk_start[o], pos = pos, pos + self.chunk_numel[o]
            self.total = pos
        self.offsets = [self.chunk_start[o] + w for o, w in zip(owners, within, strict=True)]
        for k, o in enumerate(owners):
            self.pieces[o].append((k, 0, self.numels[k], self.offsets[k]))

    def _even(self, n: int, rs: bool) -> None:
        payload = sum(self.numels)
        cap = max(1, -(-payload // n))
        self.chunk_cap = cap
        self.total = n * cap if rs else payload
        self.chunk_start = [self.slot[o] * cap for o in range(n)]
        self.chunk_numel = [max(0, min(payload, s + cap) - s) for s in self.chunk_start]
        self.offsets, pos = [], 0
        for x in self.numels:
            self.offsets.append(pos)
            pos += x
        for o in range(n):
            a, b = self.chunk_start[o], self.chunk_start[o] + self.chunk_numel[o]
            for k, (off, x) in enumerate(zip(self.offsets, self.numels, strict=True)):
                lo, hi = max(a, off), min(b, off + x)
                if lo < hi:
                    self.pieces[o].append((k, lo - off, hi - off, lo))

    @property
    def payload(self) -> int:
        """Elements that carry data (the rest is padding)."""
        return sum(self.numels)


def _wait_all(works) -> None:
    for w in works:
        if w is not None:
            w.wait()


def reduce_to_owners(buf: torch.Tensor, layout: OwnerLayout, groups: CommGroups,
                     out: torch.Tensor | None = None, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """Sum `buf` over all ranks into each owner's chunk. Returns a tensor whose first
    `layout.chunk_numel[rank]` elements are this rank's summed chunk (a view of `buf` in "reduce" mode,
    `out` (C elements) in "reduce_scatter" mode; two-level needs `tmp` of n_nodes * C elements)."""
    me = groups.rank
    if layout.mode == "reduce":
        chunks = [(o, buf.narrow(0, layout.chunk_start[o], layout.chunk_numel[o]))
                  for o in range(layout.world_size) if layout.chunk_numel[o] > 0]
        if not groups.two_level:
            _wait_all([dist.reduce(c, group_dst=o, group=groups.group, async_op=True) for o, c in chunks])
        else:
            _wait_all([dist.reduce(c, group_dst=groups.local_of(o), group=groups.intra, async_op=True)
                       for o, c in chunks])
            mine = groups.local_of(me)
            _wait_all([dist.reduce(c, group_dst=groups.node_of(o), group=groups.inter, async_op=True)
                       for o, c in chunks if groups.local_of(o) == mine])
        return buf.narrow(0, layout.chunk_start[me], layout.chunk_numel[me])
    if not groups.two_level:
        _reduce_scatter(out, buf, group=groups.group)
    else:
        _reduce_scatter(tmp, buf, group=groups.intra)
        _reduce_scatter(out, tmp, group=groups.inter)
    return out


def publish_from_owners(buf: torch.Tensor, layout: OwnerLayout, groups: CommGroups,
                        mine: torch.Tensor | None = None, tmp: torch.Tensor | None = None) -> None:
    """Every owner's chunk to every rank: afterwards `buf` holds all chunks. The owner's data must be in
    its chunk of `buf` ("reduce" mode) or in `mine` (C elements, "reduce_scatter" mode)."""
    if layout.mode == "reduce":
        chunks = [(o, buf.narrow(0, layout.chunk_start[o], layout.chunk_numel[o]))
                  for o in range(layout.world_size) if layout.chunk_numel[o] > 0]
        if not groups.two_level:
            _wait_all([dist.broadcast(c, group_src=o, group=groups.group, async_op=True) for o, c in chunks])
        else:
            me = groups.local_of(groups.rank)
            _wait_all([dist.broadcast(c, group_src=groups.node_of(o), group=groups.inter, async_op=True)
                       for o, c in chunks if groups.local_of(o) == me])
            _wait_all([dist.broadcast(c, group_src=groups.local_of(o), group=groups.intra, async_op=True)
                       for o, c in chunks])
        return
    if not groups.two_level:
        _all_gather(buf, mine, group=groups.group)
    else:
        _all_gather(tmp, mine, group=groups.inter)
        _all_gather(buf, tmp, group=groups.intra)


def all_reduce_sum(buf: torch.Tensor, groups: CommGroups, tmp: torch.Tensor | None = None) -> None:
    """In-place sum over all ranks. Two-level needs buf.numel() divisible by node_size and `tmp` of
    buf.numel() / node_size elements."""
    if not groups.two_level:
        dist.all_reduce(buf, group=groups.group)
        return
    _reduce_scatter(tmp, buf, group=groups.intra)
    dist.all_reduce(tmp, group=groups.inter)
    _all_gather(buf, tmp, group=groups.intra)


def padded_numel(numel: int, groups: CommGroups) -> int:
    """`numel` rounded up to what `all_reduce_sum` accepts."""
    g = groups.node_size if groups.two_level else 1
    return -(-numel // g) * g
