"""Closed-form collective costs on a two-level topology (NVLink inside a node, NICs across nodes).

Pure arithmetic (no simpy, no torch): the SimPy engine asks this module for one number per collective.
Conventions follow nccl-tests (see the shared reference collectives.md):

    S         the full buffer in bytes: the gathered output of an all-gather, the input of a
              reduce-scatter / all-reduce, the total bytes published by a set of broadcasts (or collected
              by a set of reduces) from several owners, the per-rank send buffer of an all-to-all.
    busbw(S)  achieved bus bandwidth of the intra-node fabric for a buffer of S bytes: the profile's
              measured curve (see BandwidthCurve) for that collective, or for the one it mirrors
              (reduce-scatter, all-reduce, all-to-all: all-gather's; owner reduces: broadcasts').

A group of ranks is a `Group`: `nodes` nodes with `per_node` ranks in each; `share` groups of the same
shape run at the same time on every node and split its NICs (HSDP's inter-node groups: one per local
rank, so share = gpus per node). With n = nodes * per_node ranks, M = nodes, p = per_node:

single node (M = 1), ring / chain:
    all-gather, reduce-scatter  base + (n-1) a_nv  + (n-1)/n S / busbw(S)
    all-reduce                  base + 2(n-1) a_nv + 2(n-1)/n S / busbw(S)
    owner broadcasts / reduces  base + (n-1) a_nv  + max((n-1)/n S, S_max) / busbw_bcast(S)
        (concurrent chains rooted at the owners: the links carry (n-1)/n S in total and the largest
         owner's chain carries its S_max bytes end to end; equal to one broadcast, S/B, for one owner)
    all-to-all                  base + (n-1) a_nv  + (n-1)/n S / busbw(S)
across nodes, B_nic = NIC bandwidth per node x inter efficiency / share:
    flat ring       latency base + (n-M) a_nv + (M-1) a_ib (twice for all-reduce); bandwidth term
                    max(intra term, (n-1)/n S / B_nic): one pipelined ring, bottleneck link wins (each ring
                    link out of a node carries (n-1)/n of the buffer, 2 (n-1)/n for all-reduce: nccl-tests'
                    multi-node busbw is the node's NIC bandwidth)
    hierarchical    two phases in sequence: intra on S (p ranks) then inter on S/p (M ranks, p groups
                    per node: (M-1)/M S / B_nic) (reduce-scatter; all-gather mirrored; all-reduce =
                    intra RS + inter AR on S/p + intra AG; owner broadcasts/reduces: inter then intra)
    all-to-all      the same either way: latency base + (p-1) a_nv + (M-1) a_ib; bandwidth
                    max((p-1)/n S / busbw(S), (M-1)/M p S / B_nic)

NCCL's own choices (`nccl=True`, what FSDP2 / torch.distributed get from NCCL; constants from NCCL's tuner,
src/graph/tuning.cc ncclTopoTuneModel, Simple protocol, named in the profile):
    all-gather, reduce-scatter  always the flat ring above (NCCL has no two-level ring; its tree is for
                    all-reduce only, PAT only for one GPU per node)
    all-reduce      the cheaper of the flat ring and NCCL's double binary tree, as NCCL's tuner picks:
                    tree latency base + 2 ((p-1) t_nv + log2(M) t_ib), tree bandwidth term
                    max(intra ring term, 2 S / (tree_bw_factor B_nic)) (tuner: tree busBw x 0.92, algbw x 0.5)
    protocols       across nodes, each time is the cheapest over Simple and the profile's other protocols
                    (LL, LL128: lower latencies, bandwidth x bw_factor), as NCCL's tuner picks; a single
                    node keeps its measured curve, which holds NCCL's own choice already. Two-level owner
                    broadcasts / reduces: the inter phase (its own NCCL call over one local index's
                    ranks) picks its protocol the same way
owner broadcasts / reduces issued as `owners` separate collectives on one communicator (the runtime's
"reduce" exchange mode: one async reduce / broadcast per owner chunk): NCCL runs them one after another
on its stream, so their latency is paid `owners` times (two-level: the intra phase `owners` times, the
inter phase `owners_per_local` times, the most owners sharing one local index); the bandwidth term is
unchanged (the chunks' bytes add up either way).

Bytes on the wire (`bytes_per_rank`) is the per-rank average sent, the convention of muon.md's table:
(n-1)/n S for all-gather, reduce-scatter, owner broadcasts/reduces and all-to-all; 2(n-1)/n S for
all-reduce.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from dmuon.errors import InputError, choice_error

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all")
_CURVE_OF = {  # which measured efficiency curve prices each kind (reduce-scatter mirrors all-gather, ...)
    "all_gather": "all_gather", "reduce_scatter": "all_gather", "all_reduce": "all_gather",
    "all_to_all": "all_gather", "broadcast": "broadcast", "reduce": "broadcast",
}


@dataclass(frozen=True)
class BandwidthCurve:
    """Achieved intra-node bus bandwidth (bytes/s) vs buffer size, from measured points.

    Between points the bandwidth term t(S) = S / busbw(S) is interpolated linearly in log t vs log S,
    over the running maximum of the points' t (so a collective never gets faster with more bytes, even
    where measured bandwidth jumps); outside the measured sizes busbw is held at the end points' values
    (no extrapolated speed-up)."""

    sizes_bytes: tuple[float, ...]
    busbw_Bps: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes_bytes or len(self.sizes_bytes) != len(self.busbw_Bps):
            raise InputError("a bandwidth curve needs one busbw per size and at least one point")
        xs = self.sizes_bytes
        if list(xs) != sorted(xs) or len(set(xs)) != len(xs):
            raise InputError("bandwidth curve sizes must be strictly increasing")
        if min(self.sizes_bytes) <= 0 or min(self.busbw_Bps) <= 0:
            raise InputError("bandwidth curve sizes and bandwidths must be positive")
        log_t, worst = [], 0.0
        for x, b in zip(xs, self.busbw_Bps, strict=True):
            worst = max(worst, x / b)
            log_t.append(math.log(worst))
        object.__setattr__(self, "_log_x", tuple(math.log(x) for x in xs))
        object.__setattr__(self, "_log_t", tuple(log_t))

    def at(self, size_bytes: float) -> float:
        xs, lx, lt = self.sizes_bytes, self._log_x, self._log_t
        if size_bytes <= xs[0]:
            return xs[0] / math.exp(lt[0])
        if size_bytes >= xs[-1]:
            return xs[-1] / math.exp(lt[-1])
        i = bisect.bisect_right(xs, size_bytes)
        f = (math.log(size_bytes) - lx[i - 1]) / (lx[i] - lx[i - 1])
        return size_bytes / math.exp(lt[i - 1] + f * (lt[i] - lt[i - 1]))

    def scaled(self, factor: float) -> BandwidthCurve:
        return BandwidthCurve(self.sizes_bytes, tuple(b * factor for b in self.busbw_Bps))


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol besides Simple (LL, LL128): latencies (s) and the share of the Simple bandwidth it
    reaches (NCCL's tuner, src/graph/tuning.cc: LL x 0.5, LL128 x 0.92)."""

    name: str
    ring_base_s: float
    ring_intra_s: float
    ring_inter_s: float
    tree_base_s: float
    tree_intra_s: float
    tree_inter_s: float
    bw_factor: float

    def __post_init__(self) -> None:
        if not 0 < self.bw_factor <= 1:
            raise InputError(f"protocol {self.name}: bw_factor must be in (0, 1], got {self.bw_factor}")
        lats = (self.ring_base_s, self.ring_intra_s, self.ring_inter_s, self.tree_base_s, self.tree_intra_s,
                self.tree_inter_s)
        if min(lats) < 0:
            raise InputError(f"protocol {self.name}: latencies must be >= 0")


@dataclass(frozen=True)
class Network:
    """The fabric: intra-node curves and latencies, inter-node NICs (SI units)."""

    curves: dict[str, BandwidthCurve]  # "all_gather" and "broadcast" required, any other kind optional
    base_latency_s: float  # per collective launch
    intra_alpha_s: float  # per ring step over NVLink
    inter_alpha_s: float  # per ring step over the network
    nic_Bps_per_node: float  # total NIC bandwidth of one node, bytes/s per direction
    inter_efficiency: float  # achieved / nominal for large inter-node messages
    # NCCL tree all-reduce (tuner constants, Simple protocol): per NVLink / network tree hop, bandwidth factor
    tree_intra_alpha_s: float = 4.0e-6
    tree_inter_alpha_s: float = 14.0e-6
    tree_bw_factor: float = 0.92
    protocols: tuple = ()  # Protocol: NCCL's other protocols, tried beside Simple across nodes (nccl=True)
    backend: str = "nccl"  # what the runtime's collectives run on: "nccl" (GPUs) | "gloo" (CPU profiles)

    def __post_init__(self) -> None:
        if not 0 < self.tree_bw_factor <= 1:
            raise InputError(f"tree_bw_factor must be in (0, 1], got {self.tree_bw_factor}")
        for name in ("base_latency_s", "intra_alpha_s", "inter_alpha_s", "tree_intra_alpha_s",
                     "tree_inter_alpha_s"):
            if getattr(self, name) < 0:
                raise InputError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.nic_Bps_per_node > 0:
            raise InputError(f"NIC bandwidth must be > 0 bytes/s, got {self.nic_Bps_per_node}")
        if not 0 < self.inter_efficiency <= 1:
            raise InputError(f"inter_efficiency must be in (0, 1], got {self.inter_efficiency}")
        if self.backend not in ("nccl", "gloo"):
            raise InputError(f"network backend must be 'nccl' or 'gloo', got {self.backend!r}")
        for k in ("all_gather", "broadcast"):
            if k not in self.curves:
                raise InputError(f"network needs a {k!r} bandwidth curve; has {sorted(self.curves)}")

    def busbw(self, kind: str, size_bytes: float) -> float:
        """The kind's own curve where the profile measured one, else the curve it mirrors."""
        curve = self.curves.get(kind) or self.curves[_CURVE_OF[kind]]
        return curve.at(size_bytes)


@dataclass(frozen=True)
class Group:
    """Shape of a process group: `nodes` x `per_node` ranks; `share` such groups split each node's NICs."""

    nodes: int
    per_node: int
    share: int = 1

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node", "share"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InputError(f"group {name} must be a positive integer, got {v!r}")

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


def bytes_per_rank(kind: str, size_bytes: float, n: int) -> float:
    """Average bytes each of the n ranks sends (muon.md's convention)."""
    if kind not in KINDS:
        raise choice_error("collective", kind, KINDS)
    if n <= 1:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * (n - 1) / n * size_bytes


def _intra(kind: str, size: float, n: int, net: Network, max_share: float) -> tuple[float, float]:
    """(latency, bandwidth time) of one single-node phase over n ranks."""
    if n <= 1 or size <= 0:
        return 0.0, 0.0
    bw = net.busbw(kind, size)
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    lat = net.base_latency_s + steps * net.intra_alpha_s
    if kind == "all_reduce":
        return lat, 2.0 * (n - 1) / n * size / bw
    if kind in ("broadcast", "reduce"):
        return lat, max((n - 1) / n * size, min(max_share, size)) / bw
    return lat, (n - 1) / n * size / bw


def _inter_bw_s(kind: str, size: float, m: int, nic_Bps: float, max_share: float) -> float:
    if m <= 1 or size <= 0:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (m - 1) / m * size / nic_Bps
    if kind in ("broadcast", "reduce"):
        return max((m - 1) / m * size, min(max_share, size)) / nic_Bps
    return (m - 1) / m * size / nic_Bps


def _simple(net: Network) -> Protocol:
    return Protocol("Simple", net.base_latency_s, net.intra_alpha_s, net.inter_alpha_s, net.base_latency_s,
                    net.tree_intra_alpha_s, net.tree_inter_alpha_s, 1.0)


def _flat_ring_s(kind: str, size: float, group: Group, net: Network, nic: float, max_share: float, k: int,
                 q: Protocol, coalesced: bool = False) -> float:
    """One flat ring (chain for broadcast / reduce) over every rank, protocol q; k collectives in a row
    (coalesced: in one NCCL group, the launch latency once, each one's ring steps)."""
    n, m, p = group.size, group.nodes, group.per_node
    twice = 2 if kind == "all_reduce" else 1
    lat = q.ring_base_s + twice * ((n - m) * q.ring_intra_s + (m - 1) * q.ring_inter_s)
    intra_bw = _intra(kind, size, n, net, max_share)[1] if p > 1 else 0.0
    inter_bw = _inter_bw_s(kind, size, n, nic, max_share)  # every ring link out of a node carries (n-1)/n
    if coalesced:
        return lat + (lat - q.ring_base_s) * (k - 1) + max(intra_bw, inter_bw) / q.bw_factor
    return lat * k + max(intra_bw, inter_bw) / q.bw_factor


def _tree_all_reduce_s(size: float, group: Group, net: Network, nic: float, q: Protocol) -> float:
    """NCCL's double binary tree all-reduce across nodes (see the module docstring), protocol q."""
    m, p = group.nodes, group.per_node
    lat = q.tree_base_s + 2 * ((p - 1) * q.tree_intra_s + math.ceil(math.log2(m)) * q.tree_inter_s)
    intra_bw = _intra("all_reduce", size, p, net, 0.0)[1] if p > 1 else 0.0
    return lat + max(intra_bw, 2.0 * size / (net.tree_bw_factor * nic)) / q.bw_factor


def collective_time_s(kind: str, size_bytes: float, group: Group, net: Network, *,
                      hierarchical: bool = True, max_share_bytes: float = 0.0, nccl: bool = False,
                      owners: int = 1, owners_per_local: int = 1, coalesced: bool = False) -> float:
    """Seconds one collective takes once every participant has arrived (see the module docstring).
    coalesced: the owners' collectives issued as one NCCL group (`ncclGroupStart` / `ncclGroupEnd`, as
    `dist._coalescing_manager`): NCCL documents aggregated operations as paying the launch latency once,
    so the base latency counts once and each collective's ring steps still count (flat or one node).

    max_share_bytes: for owner broadcasts / reduces, the largest single owner's bytes (0: balanced).
    nccl: the algorithm NCCL itself picks (flat ring for all-gather / reduce-scatter, ring or tree for
    all-reduce; `hierarchical` then only applies to owner broadcasts / reduces). owners, owners_per_local:
    owner broadcasts / reduces issued as that many collectives (their latencies add up)."""
    if kind not in KINDS:
        raise choice_error("collective", kind, KINDS)
    if size_bytes < 0:
        raise InputError(f"collective size must be >= 0 bytes, got {size_bytes}")
    n, m, p = group.size, group.nodes, group.per_node
    if n <= 1 or size_bytes == 0:
        return 0.0
    owner_kind = kind in ("broadcast", "reduce")
    k = max(1, owners) if owner_kind else 1
    k_local = max(1, min(owners_per_local, k)) if owner_kind else 1
    if m == 1:
        lat, bw = _intra(kind, size_bytes, n, net, max_share_bytes)
        if coalesced:
            return lat + (lat - net.base_latency_s) * (k - 1) + bw
        return lat * k + bw
    nic = net.nic_Bps_per_node * net.inter_efficiency / group.share
    if kind == "all_to_all":
        lat = net.base_latency_s + (p - 1) * net.intra_alpha_s + (m - 1) * net.inter_alpha_s
        intra_bw = (p - 1) / n * size_bytes / net.busbw(kind, size_bytes) if p > 1 else 0.0
        inter_bw = (m - 1) / m * p * size_bytes / nic
        return lat + max(intra_bw, inter_bw)
    if nccl and not owner_kind:
        hierarchical = False
    if not hierarchical or p == 1:
        protocols = (_simple(net), *(net.protocols if nccl else ()))
        best = min(_flat_ring_s(kind, size_bytes, group, net, nic, max_share_bytes, k, q, coalesced)
                   for q in protocols)
        if nccl and kind == "all_reduce":
            best = min(best, *(_tree_all_reduce_s(size_bytes, group, net, nic, q) for q in protocols))
        return best
    # two-level: intra phase(s) on S, inter phase on S / p among the m ranks of one local index
    inter_lat = net.base_latency_s + (m - 1) * net.inter_alpha_s * (2 if kind == "all_reduce" else 1)
    if kind == "all_reduce":
        rs_lat, rs_bw = _intra("reduce_scatter", size_bytes, p, net, 0.0)
        ag_lat, ag_bw = _intra("all_gather", size_bytes, p, net, 0.0)
        inter_bw = _inter_bw_s("all_reduce", size_bytes / p, m, nic / p, 0.0)
        return rs_lat + rs_bw + inter_lat + inter_bw + ag_lat + ag_bw
    if owner_kind:
        # owners' data crosses the network once per node (inter, whole S over the node's NICs), then
        # spreads inside the node (intra); reduces mirror this
        # the inter phase is its own NCCL call over the m ranks of one local index: NCCL's tuner picks its
        # protocol (nccl=True), as for a flat ring; the intra phase keeps the measured single-node curve
        intra_lat, intra_bw = _intra(kind, size_bytes, p, net, max_share_bytes)
        inter_bw = _inter_bw_s(kind, size_bytes, m, nic, max_share_bytes)
        if coalesced:  # one group per phase: its launch latency once, every collective's ring steps
            inter = min(q.ring_base_s + (m - 1) * q.ring_inter_s * k_local + inter_bw / q.bw_factor
                        for q in (_simple(net), *(net.protocols if nccl else ())))
            return intra_lat + (intra_lat - net.base_latency_s) * (k - 1) + intra_bw + inter
        inter = min((q.ring_base_s + (m - 1) * q.ring_inter_s) * k_local + inter_bw / q.bw_factor
                    for q in (_simple(net), *(net.protocols if nccl else ())))
        return intra_lat * k + intra_bw + inter
    intra_lat, intra_bw = _intra(kind, size_bytes, p, net, 0.0)
    inter_bw = _inter_bw_s(kind, size_bytes / p, m, nic / p, 0.0)
    return intra_lat + intra_bw + inter_lat + inter_bw
