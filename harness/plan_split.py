"""`harness plan --max-split K`: what the plan's owner groups look like, and which collectives price them.

  --links dmuon      the planner's own alpha-beta model (`dmuon.plan.split.LINKS`, collectives.md figures)
  --links simulator  the simulator profile's network (`simulator.programs.split_links.SimulatorLinks`: the
                     profile's measured intra-node curves, NICs and latencies), so plan and simulator price
                     a group's all-reduces alike (the simulator plans with the same links)
"""

from __future__ import annotations

LINK_CHOICES = ("dmuon", "simulator")


def resolve_links(links: str, profile: str):
    """None (the planner's default for the cost table's device) or the simulator's network."""
    from dmuon.errors import choice_error

    if links not in LINK_CHOICES:
        raise choice_error("links", links, LINK_CHOICES)
    if links == "dmuon":
        return None
    from simulator.fabric.hardware import profile_names

    if profile not in profile_names():
        from dmuon.errors import InputError

        raise InputError(f"--links simulator needs a simulator profile named like the cost profile; "
                         f"{profile!r} is none of {', '.join(profile_names())}")
    from simulator.programs.split_links import SimulatorLinks

    return SimulatorLinks.for_profile(profile)


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
