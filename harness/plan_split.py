"""`harness plan --max-split K`: what the plan's owner groups look like, and which collectives price them.

  --links dmuon      the planner's own alpha-beta model (`dmuon.plan.split.LINKS`, collectives.md figures)
  --links simulator  the simulator profile's network (`simulator.collectives.collective_time_s` with the
                     profile's measured intra-node curves, NICs and latencies), so plan and simulator price
                     a group's all-reduces alike
"""

from __future__ import annotations

LINK_CHOICES = ("dmuon", "simulator")


class SimulatorLinks:
    """The simulator profile's collectives behind the planner's links interface (all_reduce_s, all_gather_s).

    A group of k ranks is an aligned block; p = its ranks per node, and the gpus_per_node / p groups of
    the same shape on one node share that node's NICs (they all run at once in a step)."""

    def __init__(self, profile_name: str):
        from simulator.hardware import load_profile

        prof = load_profile(profile_name)
        self.net = prof.network
        self.gpus_per_node = prof.gpus_per_node
        self.source = f"simulator profile {prof.name} network (measured curves, NICs, NCCL latencies)"

    def _group(self, ranks):
        from simulator.collectives import Group

        ranks = tuple(ranks)
        nodes = len({r // self.gpus_per_node for r in ranks})
        per_node = len(ranks) // nodes
        return Group(nodes, per_node, share=max(1, self.gpus_per_node // per_node) if nodes > 1 else 1)

    def _time(self, kind: str, size_bytes: float, ranks) -> float:
        from simulator.collectives import collective_time_s

        ranks = tuple(ranks)
        return collective_time_s(kind, size_bytes, self._group(ranks), self.net) if len(ranks) > 1 else 0.0

    def all_reduce_s(self, size_bytes: float, ranks) -> float:
        return self._time("all_reduce", size_bytes, ranks)

    def all_gather_s(self, size_bytes: float, ranks) -> float:
        return self._time("all_gather", size_bytes, ranks)


def resolve_links(links: str, profile: str):
    """None (the planner's default for the cost table's device) or the simulator's network."""
    from dmuon.errors import choice_error

    if links not in LINK_CHOICES:
        raise choice_error("links", links, LINK_CHOICES)
    if links == "dmuon":
        return None
    from simulator.hardware import profile_names

    if profile not in profile_names():
        from dmuon.errors import InputError

        raise InputError(f"--links simulator needs a simulator profile named like the cost profile; "
                         f"{profile!r} is none of {', '.join(profile_names())}")
    return SimulatorLinks(profile)


def print_groups(plan, con) -> None:
    """The plan's split batches: group, shape, matrices, time and the collectives' share."""
    from rich.table import Table

    split = plan.split_batches
    if not split:
        return
    t = Table(title=f"{len(split)} split batches (owner groups; each rank in at most one)"
              + ("" if len(split) <= 24 else ", the 24 longest"))
    for col in ("group", "NS shape", "matrices", "method", "time ms", "collectives ms"):
        t.add_column(col, justify="left" if col in ("group", "method") else "right")
    for b in sorted(split, key=lambda b: (-b.time_s, b.owner))[:24]:
        t.add_row(f"{b.group[0]}-{b.group[-1]} ({len(b.group)})", f"{b.rows}x{b.cols}", str(b.size), b.method,
                  f"{b.time_s * 1e3:.3f}", f"{b.comm_s * 1e3:.3f}")
    con.print(t)


def summary_fields(plan) -> dict:
    """Extra `harness plan --json` keys of a plan built with max_split > 1."""
    return {
        "max_split": plan.max_split,
        "split_batches": [
            {"group": list(b.group), "members": [plan.matrices[i].name for i in b.members],
             "time_s": b.time_s, "comm_s": b.comm_s, "method": b.method} for b in plan.split_batches
        ],
    }


def nosplit_fields(plan, nosplit) -> dict:
    """Compare-row keys: the MILP without splits against the split-aware bound of `plan`."""
    return {
        "milp_split_batches": len(plan.split_batches),
        "milp_nosplit_makespan_s": nosplit.makespan_s,
        "milp_nosplit_efficiency": plan.lower_bound_s / nosplit.makespan_s,
        "milp_nosplit_proven_efficiency": plan.makespan_s * (1 - plan.gap) / nosplit.makespan_s,
        "split_speedup": nosplit.makespan_s / plan.makespan_s,
    }
