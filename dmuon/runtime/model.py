"""What the runtime reads from a model: forward-order layers of its parameters, and the one-time
broadcast that makes every replica start from rank 0's weights (as DDP does).

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
