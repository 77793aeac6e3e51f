"""What the runtime reads from a model: forward-order layers of its parameters, the check that every rank
of the optimizer's group holds the same parameters (`check_same_model`), and the one-time broadcast that
makes every replica start from rank 0's weights (as DDP does).

Layer rule (`forward_layers`): parameters whose names share the path up to the first numeric component
form one layer (a repeated block: "layers.3.mlp.up.weight" -> "layers.3"); any other parameter's layer is
its module path ("lm_head.weight" -> "lm_head"). Layers are numbered by first appearance in
`named_parameters()` order, i.e. registration order, which is the forward order of common models
(embedding, blocks, head). Only the overlap of communication with compute depends on it, never the
result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..errors import InputError
from .groups import CommGroups


def layer_key(name: str) -> str:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def forward_layers(names: Sequence[str]) -> list[int]:
    """Forward-order layer index of each parameter name (see the module docstring)."""
    index: dict[str, int] = {}
    out = []
    for n in names:
        out.append(index.setdefault(layer_key(n), len(index)))
    return out


@torch.no_grad()
def broadcast_module_state(model: torch.nn.Module, groups: CommGroups, skip=frozenset()) -> None:
    """Copy rank 0's parameters and buffers to every rank (one broadcast per dtype). DTensors (FSDP2
    shards, which differ per rank by design) and the tensors whose id is in `skip` (expert parameters,
    which differ per EP rank) are left alone."""
    from torch.distributed.tensor import DTensor

    if groups.world_size == 1:
        return
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if not isinstance(t, DTensor)]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    seen = set()
    for t in tensors:
        if id(t) in seen or id(t) in skip or t.numel() == 0:
            continue
        seen.add(id(t))
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for ts in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        if groups.backend == "nccl" and flat.device.type != "cuda":
            flat = flat.cuda()
        dist.broadcast(flat, group_src=0, group=groups.group)
        pos = 0
        for t in ts:
            n = t.numel()
            t.copy_(flat[pos:pos + n].view(t.shape).to(t.device))
            pos += n


def check_same_model(routes_by_kind: dict, groups: CommGroups) -> None:
    """Every rank of the optimizer's group must hand it the same parameters (name, global shape, dtype,
    route; `routes_by_kind` = {"Muon": routes, "AdamW": ..., "expert": ...}), in the same order: the plan,
    the buckets and every collective assume it. A pipeline stage's optimizer (process_group = that stage's
    data-parallel group) given another stage's module, or ranks that route a parameter differently, would
    otherwise hang or mix up weights. One all-gather of
    the lists at construction; InputError on every rank naming the first difference."""
    if groups.world_size == 1:
        return
    mine = [(r.name, tuple(r.param.shape), str(r.param.dtype), kind)
            for kind, routes in routes_by_kind.items() for r in routes]
    everyone: list = [None] * groups.world_size
    dist.all_gather_object(everyone, mine, group=groups.group)
    def at(entries, k):
        return "nothing" if k >= len(entries) else " ".join(map(str, entries[k]))

    for r, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        diff = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                    min(len(mine), len(theirs)))
        raise InputError(f"rank {groups.global_rank(r)} of this optimizer's process group has other "
                         f"parameters than rank {groups.global_rank(groups.rank)} ({len(theirs)} vs "
                         f"{len(mine)}; #{diff}: {at(theirs, diff)} vs {at(mine, diff)}); accepted: the same "
                         "module and muon_predicate on every rank of the group (with pipeline parallelism: "
                         "process_group = the stage's data-parallel group, e.g. mesh['dp'].get_group())")
