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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import InputError
from ..plan.split import LINKS as PLAN_LINKS
from ..plan.split import NCCL_BASE_S, NCCL_NET_STEP_S, NCCL_NVLINK_STEP_S
from .groups import CommGroups

EXCHANGE_MODES = ("reduce", "reduce_scatter")
EXCHANGE_CHOICES = ("auto", *EXCHANGE_MODES)  # "auto": chosen per bucket by `choose_mode` (see units.py)


@dataclass(frozen=True)
class LinkEstimate:
    """What "auto" assumes of the fabric (alpha-beta, SI units): one rank's achieved intra-node bus
    bandwidth, one node's achieved NIC bandwidth (all its NICs, per direction) and NCCL's latencies."""

    intra_Bps: float
    nic_Bps: float
    base_s: float = NCCL_BASE_S
    intra_step_s: float = NCCL_NVLINK_STEP_S
    inter_step_s: float = NCCL_NET_STEP_S
    source: str = ""

    def __post_init__(self) -> None:
        if not (self.intra_Bps > 0 and self.nic_Bps > 0):
            raise InputError(f"link bandwidths must be > 0 bytes/s, got {self.intra_Bps}, {self.nic_Bps}")
        if min(self.base_s, self.intra_step_s, self.inter_step_s) < 0:
            raise InputError("link latencies must be >= 0 s")


def links_from_model(model) -> LinkEstimate:
    """A `dmuon.plan.split.LinkModel` (the plan's fabric table, also what prices split groups) in the
    exchange's terms: a node's NICs = the per-rank share x ranks per node."""
    return LinkEstimate(model.intra_busbw_Bps, model.inter_Bps_per_rank * model.gpus_per_node,
                        model.base_latency_s, model.intra_alpha_s, model.inter_alpha_s, source=model.source)


# The runtime's estimate per GPU: the plan's fabric table (one table for the planner's split groups and
# the exchange choice); gloo (cpu) always takes "reduce" and needs none.
LINKS = {k: links_from_model(v) for k, v in PLAN_LINKS.items() if k != "cpu"}
DEFAULT_LINKS = "h100"  # a GPU not in the table (as dmuon.runtime.planning.default_profile)


def default_links(device_name: str | None = None) -> LinkEstimate:
    """The table entry whose key the device's name contains (default: the current CUDA device)."""
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    name = device_name.lower()
    key = next((k for k in sorted(LINKS, key=len, reverse=True) if k in name), DEFAULT_LINKS)
    return LINKS[key]


def exchange_costs_s(payload_bytes: float, cap_bytes: float, owners: int, owners_per_local: int,
                     n: int, per_node: int, two_level: bool, links: LinkEstimate) -> dict[str, float]:
    """Estimated seconds of one bucket's owner exchange (gradients to owners; publication mirrors it) in
    each mode, on n ranks of per_node per node: "reduce_scatter" moves n x cap bytes (every owner chunk
    padded to the largest, cap) in one collective, "reduce" moves the payload in `owners` collectives
    issued one after another (latency once per owner; two-level: the inter phase once per owner sharing
    a local index, `owners_per_local`). Ring / chain alpha-beta forms of collectives.md; a flat ring
    across nodes is bounded by its slowest link (NVLink or the node's NICs)."""
    if n <= 1:
        return {"reduce_scatter": 0.0, "reduce": 0.0}
    p = max(1, min(per_node, n))
    m = -(-n // p)
    L = links
    padded = n * cap_bytes
    k, k_local = max(1, owners), max(1, min(owners_per_local, owners))
    if m == 1 or p == 1 or not two_level:
        bw = L.intra_Bps if m == 1 else (L.nic_Bps if p == 1 else min(L.intra_Bps, L.nic_Bps))
        lat = L.base_s + (n - m) * L.intra_step_s + (m - 1) * L.inter_step_s
        rs = lat + (n - 1) / n * padded / bw
        red = k * lat + max((n - 1) / n * payload_bytes, cap_bytes) / bw
        return {"reduce_scatter": rs, "reduce": red}
    intra_lat = L.base_s + (p - 1) * L.intra_step_s
    inter_lat = L.base_s + (m - 1) * L.inter_step_s
    # reduce-scatter: intra on the padded buffer, then p inter groups on 1/p of it sharing the node's NICs
    rs = intra_lat + (p - 1) / p * padded / L.intra_Bps + inter_lat + (m - 1) / m * padded / L.nic_Bps
    red = (k * intra_lat + max((p - 1) / p * payload_bytes, cap_bytes) / L.intra_Bps
           + k_local * inter_lat + max((m - 1) / m * payload_bytes, cap_bytes) / L.nic_Bps)
    return {"reduce_scatter": rs, "reduce": red}


def choose_mode(payload_bytes: float, cap_bytes: float, owners: int, owners_per_local: int, n: int,
                per_node: int, two_level: bool, links: LinkEstimate, backend: str = "nccl") -> str:
    """What "auto" picks, runtime and simulator alike. gloo: "reduce" (its reduce-scatter runs an
    all-reduce underneath: measured here, 8 MB over 2 / 4 CPU ranks, reduce-scatter 11.7 / 21.6 ms vs
    per-owner reduces 5.1 / 14.5 ms). Otherwise the mode `exchange_costs_s` prices lower (a tie goes to
    "reduce_scatter", one collective)."""
    if backend == "gloo":
        return "reduce"
    c = exchange_costs_s(payload_bytes, cap_bytes, owners, owners_per_local, n, per_node, two_level, links)
    return "reduce_scatter" if c["reduce_scatter"] <= c["reduce"] else "reduce"


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
