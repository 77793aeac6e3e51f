"""Reliability guards of the distributed optimizers: agreed per-parameter flags (has a gradient
somewhere, non-finite somewhere), replica checksums, and the checks on the model they accept.

- `agree_flags`: one small all-reduce (MAX) of two flags per parameter, so every rank takes the same
  decision: skip parameters no rank has a gradient for (like single-device optimizers skip grad None),
  and raise / skip the step on a non-finite gradient, naming the parameters on every rank.
- `parse_comm_dtype`, `check_int`: the optimizers' argument checks.
- `check_replicas`: a 2 x int64 checksum of each parameter's bits, all-gathered; any difference raises
  `ReplicaDivergenceError` naming the parameters and the ranks that differ from rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from .comm import CommWorker
from .exchange import _all_gather
from .groups import CommGroups

COMM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_comm_dtype(value) -> torch.dtype | None:
    """None (gradients travel in the parameters' dtype), a name in COMM_DTYPES or one of its torch dtypes."""
    if value is None:
        return None
    if isinstance(value, str) and value in COMM_DTYPES:
        return COMM_DTYPES[value]
    if isinstance(value, torch.dtype) and value in COMM_DTYPES.values():
        return value
    raise InputError(f"comm_dtype must be None (the parameters' dtype), 'bf16', 'fp16' or 'fp32' (or those "
                     f"torch dtypes), got {value!r}")


def check_int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InputError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or inf on some rank; raised on every rank with the same parameter names."""


class ReplicaDivergenceError(RuntimeError):
    """Parameters that must be identical on every rank differ."""


def check_devices(named_params) -> torch.device:
    """The one device every parameter lives on, or an InputError naming two that differ."""
    first = None
    for name, p in named_params:
        if first is None:
            first = (name, p.device)
        elif p.device != first[1]:
            raise InputError(f"parameters on different devices: {first[0]} is on {first[1]} but {name} is on "
                             f"{p.device}; the distributed optimizers need every parameter on one device "
                             "(move the model with .to(device) first)")
    if first is None:
        raise InputError("the model has no trainable parameters")
    return first[1]


def submit_flags(worker: CommWorker, groups: CommGroups, has_grad: torch.Tensor, nonfinite: torch.Tensor):
    """Start the all-reduce (MAX over ranks) of the two bool vectors (one entry per parameter); pass the
    returned handle to `read_flags`."""
    flags = torch.cat([has_grad, nonfinite]).to(torch.float32)
    device = torch.device("cuda", torch.cuda.current_device()) if groups.backend == "nccl" else "cpu"
    flags = flags.to(device)

    def job():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=groups.group)
        return flags

    return worker.submit("flag all-reduce (gradient present / non-finite)", job, kind="flags",
                         bytes_=flags.numel() * 4)


def read_flags(handle, timeout_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(has a gradient on some rank, non-finite on some rank) per parameter, on the CPU."""
    out = handle.wait(timeout_s).cpu()
    n = out.numel() // 2
    return out[:n] > 0, out[n:] > 0


def param_checksums(params) -> torch.Tensor:
    """(n, 2) int64 on the CPU: sum of each parameter's bit patterns, and a position-weighted sum."""
    rows = []
    for p in params:
        x = p.detach().reshape(-1)
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        v = x.view(bits).to(torch.int64)
        weights = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 1021 + 1
        rows.append(torch.stack([v.sum(), (v * weights).sum()]))
    return torch.stack(rows).cpu() if rows else torch.zeros(0, 2, dtype=torch.int64)


def check_replicas(worker: CommWorker, groups: CommGroups, names, params, timeout_s: float) -> None:
    """Raise ReplicaDivergenceError (on every rank) if any parameter differs between ranks."""
    local = param_checksums(params)
    if local.numel() == 0:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if groups.backend == "nccl" else "cpu"
    mine = local.reshape(-1).to(device)
    gathered = torch.empty(groups.world_size * mine.numel(), dtype=torch.int64, device=device)

    def job():
        _all_gather(gathered, mine, group=groups.group)
        return gathered

    allsums = worker.submit("replica checksum all-gather", job, kind="checksums",
                            bytes_=gathered.numel() * 8).wait(timeout_s).cpu().view(groups.world_size, -1, 2)
    differs = (allsums != allsums[0:1]).any(dim=2)  # (ranks, params)
    bad = differs.any(dim=0).nonzero().flatten().tolist()
    if bad:
        names = list(names)
        ranks = differs.any(dim=1).nonzero().flatten().tolist()
        shown = ", ".join(names[i] for i in bad[:10]) + (f" (+{len(bad) - 10} more)" if len(bad) > 10 else "")
        raise ReplicaDivergenceError(
            f"rank {groups.rank}: parameters differ between ranks: {shown}; ranks {ranks} differ from "
            "rank 0. Something changed parameters on some ranks only (a different seed, an in-place edit "
            "outside the optimizer, or non-deterministic code)")
