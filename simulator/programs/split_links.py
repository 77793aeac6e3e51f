"""The simulator's collectives behind the planner's links interface, and the shape of an owner group.

A split batch (`dmuon.plan.types.Batch.group`) is run by an aligned block of k ranks. `group_of` gives
its `simulator.fabric.collectives.Group`: the nodes it spans and its ranks per node p; a group spanning nodes
shares each node's NICs with the gpus_per_node / p groups of the same shape that sit beside it (every
aligned block of a plan's split batches runs in the same optimizer phase). `SimulatorLinks` prices the
group's all-reduces and all-gathers with `collective_time_s` on a profile's network, so the plan
(`dmuon.plan.build.build_plan(links=...)`) and the simulator's step programs price a group alike.
"""

from __future__ import annotations

from simulator.fabric.collectives import Group, collective_time_s


def group_of(ranks, gpus_per_node: int) -> Group:
    """The Group of `ranks` (global rank ids; ranks r, r' share a node iff r // g == r' // g)."""
    ranks = tuple(ranks)
    nodes = len({r // gpus_per_node for r in ranks})
    per_node = len(ranks) // nodes
    return Group(nodes, per_node, share=max(1, gpus_per_node // per_node) if nodes > 1 else 1)


class SimulatorLinks:
    """all_reduce_s / all_gather_s of a rank set on `network` (a `simulator.fabric.collectives.Network`)."""

    def __init__(self, network, gpus_per_node: int, *, hierarchical: bool = True, source: str = ""):
        self.net = network
        self.gpus_per_node = gpus_per_node
        self.hierarchical = hierarchical
        self.source = source or "simulator network (measured curves, NICs, NCCL latencies)"

    @classmethod
    def for_profile(cls, profile_name: str) -> SimulatorLinks:
        from simulator.fabric.hardware import load_profile

        prof = load_profile(profile_name)
        return cls(prof.network, prof.gpus_per_node,
                   source=f"simulator profile {prof.name} network (measured curves, NICs, NCCL latencies)")

    def time_s(self, kind: str, size_bytes: float, ranks) -> float:
        ranks = tuple(ranks)
        if len(ranks) <= 1:
            return 0.0
        return collective_time_s(kind, size_bytes, group_of(ranks, self.gpus_per_node), self.net,
                                 hierarchical=self.hierarchical)

    def all_reduce_s(self, size_bytes: float, ranks) -> float:
        return self.time_s("all_reduce", size_bytes, ranks)

    def all_gather_s(self, size_bytes: float, ranks) -> float:
        return self.time_s("all_gather", size_bytes, ranks)


__all__ = ["SimulatorLinks", "group_of"]
