"""Finding non-finite gradients cheaply: one reduction per run of tensors back to back in one storage, one
host sync per device (`suspect_indices`), then the exact test on the suspects (`nonfinite_names`). Used by
`dmuon.Muon` and the distributed optimizers' non-finite policy."""

from __future__ import annotations

import torch


def _failing(grads, reduce, ok) -> list[int]:
    """Indices i where ok(reduce(grads[i])) is false: reduce gives a 0-d float tensor per tensor, ok tests
    them stacked (one call per device, one host sync per device)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(grads):
        by_device.setdefault(g.device, []).append(i)
    bad = []
    for idx in by_device.values():
        flags = ok(torch.stack([reduce(grads[i]) for i in idx])).cpu()
        bad += [i for i, flag in zip(idx, flags.tolist(), strict=True) if not flag]
    return sorted(bad)


def storage_runs(tensors) -> list[tuple[torch.Tensor, list[int]]]:
    """The tensors as (flat tensor, indices) runs: tensors that lie back to back in one storage (dense,
    same dtype and device, each starting where the previous one ends, e.g. FSDP2's gradient shards of one
    module: views of its reduce-scatter output) become one flat view of the span they cover; any other
    tensor is a run of its own. Runs come in the order of their first member."""
    tensors = list(tensors)
    spans: dict[tuple, list[tuple[int, int, int]]] = {}
    alone = []
    for i, t in enumerate(tensors):
        if t.layout == torch.strided and t.is_contiguous() and t.numel():
            key = (t.device, t.dtype, t.untyped_storage().data_ptr())
            spans.setdefault(key, []).append((t.storage_offset(), t.numel(), i))
        else:
            alone.append(i)
    runs = [(tensors[i], [i]) for i in alone]
    for members in spans.values():
        members.sort()
        start = 0
        for k in range(1, len(members) + 1):
            if k < len(members) and members[k][0] == members[k - 1][0] + members[k - 1][1]:
                continue
            first, last = members[start], members[k - 1]
            idx = [m[2] for m in members[start:k]]
            flat = tensors[first[2]] if k - start == 1 else tensors[first[2]].as_strided(
                (last[0] + last[1] - first[0],), (1,), first[0])
            runs.append((flat, idx))
            start = k
    runs.sort(key=lambda r: min(r[1]))
    return runs


def suspect_indices(grads) -> list[int]:
    """Indices of the tensors whose sum is not finite, the cheap first pass before `nonfinite_names` checks
    those exactly (a finite tensor can overflow its sum, never the other way round): one reduction per
    run of tensors back to back in one storage (`storage_runs`: FSDP2's gradient shards of a module are
    one run; every member of a run whose sum is not finite is a suspect), one finiteness test and one
    host sync per device."""
    runs = storage_runs(grads)[::-1]  # last first: the optimizers list Muon matrices first, and their
    # momentum pass follows this one: it finds the gradients it reads still in cache
    bad = _failing([flat for flat, _ in runs], lambda g: g.sum().float(), torch.isfinite)
    return sorted(i for r in bad for i in runs[r][1])


def nonfinite_names(names, grads) -> list[str]:
    """Names of the gradients that contain NaN or inf (one host sync per device)."""
    names = list(names)
    return [names[i] for i in _failing(list(grads), lambda g: torch.isfinite(g).all(), lambda ok: ok)]
