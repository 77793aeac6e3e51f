"""Split NS in the plan: what a k-way split of a matrix (or a batch) costs, and where its group lives.

A *split batch* (`dmuon.orthogonalize_distributed`) stacks b same-shape matrices of NS shape n x m
(n <= m) and spreads their long side over a group of k ranks. Each member spends

    time_s = compute_s + comm_s
    compute_s = T(n, w, b) * F_split / F(n, w),   w = max(n, ceil(m / k))
    comm_s    = A * all_reduce(b n (n + 1) / 2 * 4 bytes, group) + 2 * all_gather(small, group)

T = the cost table's NS call (`CostTable.ns_time`); F_split = `flops.ns_flops_parts(n, m, parts=k)`
summed (the widest block's local n x n x ceil(m / k) products plus the replicated n^3 polynomial work);
F(n, w) = the FLOPs of the n x w call. So where the block is at least square (ceil(m / k) >= n) the
compute is exactly the table's time of one n x ceil(m / k) call, which does the same local and
replicated work; below that (a block narrower than n) it is the n x n call scaled down by FLOPs (the
replicated n^3 work dominates there). A = all-reduces per call: 5 (standard forms), 1 + restarts = 2
(Gram forms); fp32 upper triangles (what `orthogonalize_distributed` sends); the two small collectives
are its shape check and normalization all-gather (latency only).

Groups are aligned blocks of k consecutive ranks, k a power of two (k ranks starting at a multiple of
k), and every rank belongs to at most one split batch: then groups never overlap, no rank has to order
collectives of two groups, and a plan's split batches can always be placed by sorting them by k
(descending) and laying them out left to right (`place_groups`). With `gpus_per_node` ranks per node
(ranks r and r' share a node iff r // g == r' // g) a group of k <= g ranks sits inside one node; a
larger one spans k / g nodes and its all-reduce is the two-level form of collectives.md (intra-node
reduce-scatter, inter-node all-reduce of S / p, intra-node all-gather).

`LinkModel` is the alpha-beta model of those collectives, with figures from the shared reference
collectives.md (sources in `LINKS`); any object with the same `all_reduce_s(size_bytes, ranks)` and
`all_gather_s(size_bytes, ranks)` may be passed instead (the simulator's own collectives model, say).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InputError
from .flops import ns_flops, ns_flops_parts

WIRE_BYTES = 4  # fp32 elements on the wire (see dmuon.split_ns)
SMALL_COLLECTIVES = 2  # shape check + normalization all-gather per split call
SMALL_BYTES = 64


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta collectives on g ranks per node (seconds, bytes/s): see the module docstring."""

    name: str
    gpus_per_node: int
    base_latency_s: float  # per collective launch
    intra_alpha_s: float  # per ring step inside a node
    inter_alpha_s: float  # per ring step across nodes
    intra_busbw_Bps: float  # all-reduce / all-gather bus bandwidth inside a node
    inter_Bps_per_rank: float  # NIC bandwidth per rank (node NICs / g)
    source: str = ""

    def _layout(self, ranks) -> tuple[int, int]:
        ranks = tuple(ranks)
        nodes = len({r // self.gpus_per_node for r in ranks})
        return nodes, len(ranks) // nodes

    def all_reduce_s(self, size_bytes: float, ranks) -> float:
        """Ring all-reduce of `size_bytes` over `ranks` (two-level across nodes)."""
        k = len(tuple(ranks))
        if k <= 1:
            return 0.0
        nodes, p = self._layout(ranks)
        t = self.base_latency_s + 2 * (p - 1) * (self.intra_alpha_s + size_bytes / p / self.intra_busbw_Bps)
        if nodes > 1:
            shard = size_bytes / p
            t += 2 * (nodes - 1) * (self.inter_alpha_s + shard / nodes / self.inter_Bps_per_rank)
        return t

    def all_gather_s(self, size_bytes: float, ranks) -> float:
        """Ring all-gather whose gathered output is `size_bytes` (two-level across nodes)."""
        k = len(tuple(ranks))
        if k <= 1:
            return 0.0
        nodes, p = self._layout(ranks)
        t = self.base_latency_s + (p - 1) * (self.intra_alpha_s + size_bytes / k / self.intra_busbw_Bps)
        if nodes > 1:
            t += (nodes - 1) * (self.inter_alpha_s + size_bytes / k / self.inter_Bps_per_rank)
        return t


# NCCL's own latency model (tuner constants, Simple protocol; NVIDIA/nccl src/graph/tuning.cc
# ncclTopoTuneModel, quoted in collectives.md): per launch, per NVLink ring step, per network ring step
NCCL_BASE_S, NCCL_NVLINK_STEP_S, NCCL_NET_STEP_S = 8.4e-6, 3.4e-6, 14.0e-6
_NCCL = "NCCL tuner constants of collectives.md: base 8.4 us, 3.4 us per NVLink step, 14 us per network step"
LINKS = {
    "a800": LinkModel(
        "a800", 8, NCCL_BASE_S, NCCL_NVLINK_STEP_S, NCCL_NET_STEP_S, 64e9, 12.5e9,
        f"collectives.md: 8 x A800 all_gather_into_tensor measured at 64-71 GB/s busbw by the public DMuon "
        f"code (64 taken); 4 x 200 Gb/s HDR per 8-GPU node = 12.5 GB/s per GPU (the low end); {_NCCL}"),
    # H100: the A800 figure above x 470 / 157.5, the ratio of the reference 8-GPU all-reduce busbw of H100
    # (460-480 GB/s) to the A800's expected 150-165 GB/s (collectives.md), the same rule as the simulator's
    # h100 / h200 profiles (curve_scale 2.984 on the A800 curve), so that the runtime's "auto" and the
    # simulator choose on the same bandwidth; nccl-tests' 460 GB/s itself is not what the DMuon code's
    # timing reaches on A800 either (64-71 of ~157 GB/s)
    "h100": LinkModel(
        "h100", 8, NCCL_BASE_S, NCCL_NVLINK_STEP_S, NCCL_NET_STEP_S, 64e9 * 470 / 157.5, 50e9,
        f"the a800 entry's 64 GB/s x 470 / 157.5 (collectives.md: H100 all-reduce busbw 460-480 GB/s vs the "
        f"A800's expected 150-165 GB/s; as the simulator's h100 profile) = 191 GB/s; 8 x 400 Gb/s NDR = "
        f"50 GB/s per GPU; {_NCCL}"),
    "cpu": LinkModel(
        "cpu", 1 << 20, 350e-6, 0.0, 0.0, 0.9e9, 0.9e9,
        "measured once on this 2-core machine: gloo all_reduce over loopback TCP, 2 ranks, median of 7: "
        "0.35 ms for 4 B, 19.5 ms for 16.8 MB (~0.9 GB/s); one node; a rough figure, calibrate for real use"),
}
LINKS["h200"] = LinkModel("h200", *[getattr(LINKS["h100"], f) for f in (
    "gpus_per_node", "base_latency_s", "intra_alpha_s", "inter_alpha_s", "intra_busbw_Bps",
    "inter_Bps_per_rank")], source="as h100 (same NVLink 4 / NDR generation): " + LINKS["h100"].source)


def links_for(cost, links=None):
    """`links` if given, else the LinkModel of the cost table's device (InputError for an unknown one)."""
    if links is not None:
        if not all(callable(getattr(links, f, None)) for f in ("all_reduce_s", "all_gather_s")):
            raise InputError("links must be a dmuon.plan.split.LinkModel or an object with "
                             "all_reduce_s(size_bytes, ranks) and all_gather_s(size_bytes, ranks)")
        return links
    device = str(getattr(cost, "device", None) or getattr(cost, "name", type(cost).__name__)).lower()
    for name, model in LINKS.items():
        if device.startswith(name):
            return model
    raise InputError(f"no link model for device {device!r} to price split NS; accepted: devices "
                     f"{', '.join(LINKS)}, or pass links= (a dmuon.plan.split.LinkModel)")


def split_levels(max_split: int, world_size: int, long_side: int) -> tuple[int, ...]:
    """The group sizes k >= 2 a matrix may use: powers of two <= max_split, world size, long side."""
    out, k = [], 2
    while k <= min(max_split, world_size, long_side):
        out.append(k)
        k *= 2
    return tuple(out)


def check_max_split(max_split) -> int:
    if isinstance(max_split, bool) or not isinstance(max_split, int) or max_split < 1:
        raise InputError(f"max_split must be a positive integer (1 = no splitting; groups use the powers of "
                         f"two up to it), got {max_split!r}")
    return max_split


def all_reduces_per_call(method: str, steps: int = 5, restarts: tuple[int, ...] = (2,)) -> int:
    if method.startswith("standard"):
        return steps
    return 1 + len({r for r in restarts if 0 < r < steps})


@dataclass(frozen=True)
class SplitPrice:
    compute_s: float
    comm_s: float

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


def split_price(cost, n: int, m: int, batch: int, k: int, method: str, dtype: str, links,
                ranks) -> SplitPrice:
    """Per-member seconds of one k-way split call of `batch` n x m matrices on `ranks` (module docstring)."""
    n, m = min(n, m), max(n, m)
    width = max(n, -(-m // k))
    local, replicated = ns_flops_parts(n, m, method, parts=k)
    compute = cost.ns_time(n, width, batch, method, dtype).time_s * (local + replicated) / ns_flops(n, width,
                                                                                                    method)
    ar = all_reduces_per_call(method)
    comm = ar * links.all_reduce_s(batch * n * (n + 1) / 2 * WIRE_BYTES, ranks)
    comm += SMALL_COLLECTIVES * links.all_gather_s(SMALL_BYTES * len(tuple(ranks)), ranks)
    return SplitPrice(compute, comm)


def place_groups(widths) -> list[tuple[int, ...]]:
    """Aligned rank blocks for split batches of the given group sizes (powers of two), laid out largest
    first from rank 0: block j gets ranks [start, start + k) with start a multiple of k. Returned in the
    input's order."""
    order = sorted(range(len(widths)), key=lambda j: (-widths[j], j))
    out: list[tuple[int, ...] | None] = [None] * len(widths)
    start = 0
    for j in order:
        k = widths[j]
        out[j] = tuple(range(start, start + k))
        start += k
    return out  # type: ignore[return-value]


def area_bound(options, world_size: int) -> float:
    """Smallest T with sum_s count(s) area_s(T) <= N T, where area_s(T) = the least rank-seconds per matrix
    over the calls (k ranks, b matrices, t seconds) of class s with t <= T: k t / b. `options` holds one
    (count, [(t, k, b), ...]) per class. A theorem for every plan (each matrix sits in one call, which
    costs its k ranks t each, and no call runs longer than the makespan). Feasibility is monotone in T, so
    the interval between two option times that holds the answer is found by bisection."""
    points = sorted({t for _, opts in options for t, _, _ in opts})

    def area(t: float) -> float:
        total = 0.0
        for count, opts in options:
            fits = [k * u / b for u, k, b in opts if u <= t]
            if not fits:
                return math.inf
            total += count * min(fits)
        return total / world_size

    def feasible(i: int) -> bool:  # some T in [points[i], points[i + 1]) is feasible
        upper = points[i + 1] if i + 1 < len(points) else math.inf
        return max(points[i], area(points[i])) < upper

    lo, hi = 0, len(points) - 1  # the last interval is unbounded above: always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return max(points[lo], area(points[lo]))
