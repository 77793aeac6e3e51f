"""What the owner exchange costs, without torch: the alpha-beta estimate of each exchange mode and the
choice "auto" makes (`choose_mode`), shared by the runtime (`dmuon.runtime.exchange`, `units.auto_mode`)
and the simulator (`simulator.programs.step_comm`), which must not import torch to price a step. The modes
themselves are described in `dmuon.runtime.exchange`; the fabric estimate per GPU (`LINKS`) is the
plan's one table (`dmuon.plan.split.LINKS`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from .split import LINKS as PLAN_LINKS
from .split import NCCL_BASE_S, NCCL_NET_STEP_S, NCCL_NVLINK_STEP_S

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
