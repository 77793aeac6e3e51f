"""Scenarios of the split-batch runtime tests (helpers only: test_split_runtime.py uses them): DMuon running
plans whose batches have owner groups (`Batch.group`), in the replicated, fsdp2-owner and fsdp2-sharded
layouts, on test_fsdp_cases's model (uneven rows, a float64 block, a 5-row matrix) and against the same
single-device reference.

The test matrices are far too small for a split to pay, so the balancer (rightly) never splits them;
`force_splits` turns a plan into one with groups (the heaviest batches first, each given its owner plus
the next free ranks), which DMuon executes through `plan=`: the runtime is tested independently of the
balancer's choice.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from test_fsdp_cases import full_params, nonfinite_round, setup, train
from test_fsdp_cases import run_cases as fsdp_run_cases


def force_splits(plan, k: int, first: str | None = None, descending: bool = False):
    """`plan` with groups of k ranks on as many batches as the ranks allow (the batch of the matrix named
    `first`, led by the group's lowest rank, then the heaviest first); descending: the first group is
    led by its highest rank and lists the others downwards (plan order unlike the process group's)."""
    used: set[int] = set()
    batches, owners = list(plan.batches), list(plan.owners)
    named = {j for j, b in enumerate(batches) if any(plan.matrices[i].name == first for i in b.members)}
    for j in sorted(range(len(batches)), key=lambda j: (j not in named, -batches[j].time_s, j)):
        b = batches[j]
        if b.owner in used or max(b.rows, b.cols) < k:
            continue
        others = [r for r in range(plan.world_size) if r != b.owner and r not in used][:k - 1]
        if len(others) < k - 1:
            continue
        group = (b.owner, *others)
        if j in named or (descending and not used):  # a chosen lead: the lowest / highest rank
            group = tuple(sorted(group, reverse=descending and not used))
            owners = [group[0] if i in b.members else o for i, o in enumerate(owners)]
        used |= set(group)
        batches[j] = dataclasses.replace(b, owner=group[0], group=group, comm_s=0.0)
    return dataclasses.replace(plan, batches=tuple(batches), owners=tuple(owners))


def force_row_split(plan, shard_ranks: tuple[int, ...]):
    """`plan` with its first batch of square matrices (rows = cols: their Shard(0) rows are blocks of the
    long side) moved to the first of `shard_ranks` and split over them in shard order: the fsdp2-sharded
    layout runs it without any all-to-all (`split_exec.row_split_batches`)."""
    j = next(j for j, b in enumerate(plan.batches) if b.rows == b.cols)
    b = plan.batches[j]
    lead = shard_ranks[0]
    owners = tuple(lead if i in b.members else o for i, o in enumerate(plan.owners))
    batches = list(plan.batches)
    batches[j] = dataclasses.replace(b, owner=lead, group=tuple(shard_ranks), comm_s=0.0)
    return dataclasses.replace(plan, batches=tuple(batches), owners=owners)


def split_setup(case: dict, world: int, k: int | None = None):
    """(model, optimizer) of the case with a plan forced to groups of k (None / 1: the plain plan), or
    with case['rows'] (a tuple of shard ranks) to one row split (`force_row_split`)."""
    k = case.get("k") if k is None else k
    if (not k or k == 1) and not case.get("rows"):
        return setup(case, world)
    _, probe = setup({**case, "opts": {}}, world)
    rows = case.get("rows")
    plan = force_row_split(probe.plan, tuple(rows)) if rows else force_splits(probe.plan, k,
                                                                              case.get("split_first"),
                                                                              case.get("descending", False))
    probe.close()
    return setup({**case, "opts": {**case.get("opts", {}), "plan": plan}}, world)


def run_plain(case: dict, rank: int, world: int) -> dict:
    model, opt = split_setup(case, world)
    train(model, opt, case, range(5), rank, world)
    out = {"params": full_params(model, opt), "layout": opt.layout, "cls": type(opt).__name__,
           "groups": [list(b.group) for b in opt.plan.split_batches],
           "split_bytes": opt.comm_stats.payload_bytes.get("split_blocks", 0),
           "gram_bytes": opt.comm_stats.payload_bytes.get("split_gram", 0),
           "row_splits": [list(b.group) for b in getattr(opt, "_row_splits", [])],
           "momentum": sorted(opt.names[i] for i in range(opt.n_muon)
                              if "momentum_buffer" in opt.state[opt.params[i]]),
           "owners": list(opt.plan.owners), "names": opt.names[:opt.n_muon]}
    opt.close()
    return out


def run_checkpoint(case: dict, rank: int, world: int) -> dict:
    """Steps 0-2 with groups of case['save_k'], save (DCP), 3-4 (straight); a fresh model and optimizer
    with groups of case['load_k'] load it and train 3-4 (resumed)."""
    import dmuon

    model, opt = split_setup(case, world, case["save_k"])
    train(model, opt, case, [0, 1, 2], rank, world)
    dmuon.save_checkpoint(case["dir"], model, opt)
    dist.barrier()
    train(model, opt, case, [3, 4], rank, world)
    straight = full_params(model, opt)
    saved_groups = [list(b.group) for b in opt.plan.split_batches]
    opt.close()
    model2, opt2 = split_setup(case, world, case["load_k"])
    dmuon.load_checkpoint(case["dir"], model2, opt2)
    train(model2, opt2, case, [3, 4], rank, world)
    resumed = full_params(model2, opt2)
    loaded_groups = [list(b.group) for b in opt2.plan.split_batches]
    opt2.close()
    return {"straight": straight, "resumed": resumed, "saved_groups": saved_groups,
            "loaded_groups": loaded_groups}


def run_errors(case: dict, rank: int, world: int) -> dict:
    """Bad split set-ups: their messages (on every rank, before any collective of the split)."""
    from test_fsdp_cases import catcher, make_model

    import dmuon

    out = {}
    catch = catcher(out)

    catch("max_split_too_big", lambda: dmuon.DMuon(make_model({}), profile=None, max_split=2 * world))
    catch("max_split_zero", lambda: dmuon.DMuon(make_model({}), profile=None, max_split=0))
    _, probe = setup({"layout": "replicated"}, world)
    plan = probe.plan
    probe.close()
    b0 = plan.batches[0]
    too_big = dataclasses.replace(plan, batches=(dataclasses.replace(b0, group=tuple(range(world + 1))),
                                                 *plan.batches[1:]))
    catch("group_too_big", lambda: dmuon.DMuon(make_model({}), profile=None, plan=too_big))
    other = dataclasses.replace(plan, world_size=world + 1)
    catch("plan_world", lambda: dmuon.DMuon(make_model({}), profile=None, plan=other))
    return out


def run_nonfinite(case: dict, rank: int, world: int) -> dict:
    """test_fsdp_cases.nonfinite_round with groups: the lead's speculative split NS must be dropped."""
    model, opt = split_setup(case, world)
    err, unchanged = nonfinite_round(model, opt, case, rank, world)
    out = {"error": err, "unchanged": unchanged, "params": full_params(model, opt),
           "split_of_up": [list(g) for g, n in zip(opt.plan.groups, opt.names, strict=False)
                           if n == "blocks.0.up.weight"]}
    opt.close()
    return out


RUNNERS = {"plain": run_plain, "checkpoint": run_checkpoint, "errors": run_errors, "nonfinite": run_nonfinite}


def run_cases(rank: int, world: int, cases: list[dict]) -> dict:
    return fsdp_run_cases(rank, world, cases, RUNNERS)
