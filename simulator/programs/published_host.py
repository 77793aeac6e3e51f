"""The public implementation's host-side (CPU launch) cost on DMuon's optimizer phase, for
`system="published"`: `adamw_unfused` and `ns_eager` in `simulator.programs.step_published.MECHANISMS`
(docs/simulator.md, "What `--system published` models", items 14-17).

The public optimizer (X-Square-Robot/dmuon `dmuon/optim/muon.py`) runs eagerly, one Python call per tensor:

- AdamW for every non-Muon parameter (`Muon._step_adamw` -> `_step_adamw_params` -> `_adamw_update_tensor`, a
  loop over the FSDP2 local shards): `param.mul_` (decoupled weight decay, `adamw_weight_decay=0.01` > 0),
  `exp_avg.mul_().add_()`, `exp_avg_sq.mul_().addcmul_()`, `exp_avg_sq.sqrt()`, `/ bc2**0.5`, `.add_(eps)`,
  `param.addcdiv_()`: `ADAMW_LAUNCHES` = 9 kernels per tensor. The AdamW baseline is `torch.optim.AdamW`
  (multi-tensor foreach: a few launches per op for every tensor list), whose cost is the cost table's
  measured AdamW rows; it is not changed here.
- Muon per owned matrix (`_step_muon_params`): `momentum_buffer.mul_().add_()`, the Nesterov `grad.add(buf)`,
  `gram_newton_schulz_local` (`dmuon/optim/newton_schulz.py`, SYRK path, 5 Polar Express coefficients,
  restart at iteration 2), the cast of the update to the fp32 master and `owned.add_()` (Muon weight decay
  0 by default: no `mul_`). `ns_launches` counts them. `NSGraphCache` (`ns_graph.py`, CUDA-graph replay) is
  dated 2026-08-06, after the 2026-05-24 run set, and neither stored muon.py nor newton_schulz.py calls it:
  the published runs' NS is read as eager.

Mechanism (one host loop per rank): the host issues the optimizer's launches in program order, one every
`EAGER_OP_S`; the CUDA stream holds up to `LAUNCH_QUEUE` pending launches, so the host (which runs ahead of
a GPU-bound backward: FSDP2's memory management "does not require blocking the CPU", PyTorch's `fully_shard`
docs) enters the optimizer with that many already queued.
Launch i > LAUNCH_QUEUE of the phase is issued (i - LAUNCH_QUEUE) x EAGER_OP_S after the phase's first op
starts, so an op whose launches end at i cannot finish before then: its duration is max(its GPU time, the
host time of its launches past the queue) (`HostLoop.gate`). Gaps where the GPU waits for data are not
credited to the host (the queue is full then), so the cost is an upper bound of this reading.

Public measurements (not fitted to any row):
- `EAGER_OP_S` = 6.5 us = the CUDA driver's launch, 4-5 us per kernel, measured by launching 10,000 small
  kernels on one stream (NVIDIA developer forums, "CUDA stream are blocked when launch lots of kernels
  (>1000)",
  https://forums.developer.nvidia.com/t/cuda-stream-are-blocked-when-luanch-lots-of-kernels-1000/68937;
  midpoint 4.5 us) + PyTorch's Python and dispatcher overhead per eager op, about 2 us (`x*x`,
  requires_grad=False, measured by a PyTorch maintainer in pytorch/pytorch issue #41383).
- `LAUNCH_QUEUE` = 1000: the same forum measurement, "the buffer size is about 1000 kernels" per stream
  (launches past it wait for a kernel to finish).
"""

from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

EAGER_OP_S = 6.5e-6  # host seconds per eager op: 4.5 us driver launch + 2 us PyTorch dispatch (docstring)
LAUNCH_QUEUE = 1000  # pending launches a stream holds before the host blocks (docstring)
ADAMW_LAUNCHES = 9  # `_adamw_update_tensor` with weight decay > 0 (docstring)
HOST_MECHANISMS = ("adamw_unfused", "ns_eager")
TENSORS_PATH = (Path(__file__).resolve().parents[2] / "experiments" / "reference"
                / "published_nonmatrix_tensors.csv")


def ns_launches(grad_bytes: int) -> int:
    """Kernel launches per owned matrix of the public `_step_muon_params` (non-TP, Nesterov, Gram NS):
    momentum 2 + Nesterov 1; NS prologue X.float() (only when the gradient is not fp32), norm, + eps, /,
    half(), the first SYRK; iterations 0-4 with restart [2]: 5 + 2 + 7 + 4 + 2 (SYRK / copy_ / diagonal add_ /
    Q@Z / R evolve); Q@X and the cast back to the gradient's dtype; the cast to the fp32 master (only when
    the gradient is not fp32) and owned.add_."""
    low = grad_bytes != 4  # bf16 / fp16 gradients: X.float() and the cast to the fp32 master launch
    return 3 + (1 if low else 0) + 5 + (5 + 2 + 7 + 4 + 2) + 2 + (1 if low else 0) + 1


@lru_cache(maxsize=1)
def _extra_table() -> dict:
    with open(TENSORS_PATH, newline="") as f:
        return {row["workload"]: int(row["extra_tensors"]) for row in csv.DictReader(f)}


def adamw_loop_tensors(workload_name: str, listed: int) -> tuple[int, str | None]:
    """(tensors the public AdamW loop visits, a note or None): the workload's listed AdamW tensors plus its
    norms, biases and other non-matrix tensors (experiments/reference/published_nonmatrix_tensors.csv, one
    row per catalog model with its derivation and source). A workload without a row counts its listed
    tensors only, and the note says so."""
    extra = _extra_table().get(workload_name)
    if extra is None:
        return listed, (f"published adamw_unfused: no non-matrix tensor count for workload {workload_name!r} "
                        f"(experiments/reference/published_nonmatrix_tensors.csv): its AdamW loop counts its "
                        f"{listed} listed AdamW tensors only")
    return listed + extra, None


class HostLoop:
    """One rank's optimizer host loop: `gate` each op in program order."""

    def __init__(self, op_s: float = EAGER_OP_S, queue: int = LAUNCH_QUEUE):
        self.op_s, self.queue, self.issued = op_s, queue, 0

    def gate(self, dur: float, launches: int) -> float:
        """The op's duration with its `launches` issued by the host after the ones before it."""
        before = max(0, self.issued - self.queue)
        self.issued += launches
        return max(dur, (max(0, self.issued - self.queue) - before) * self.op_s)


class HostPrograms:
    """Hooks of `simulator.programs.step_optimizer` (mixed into `simulator.programs.step._Programs`)."""

    def _host_loop(self) -> HostLoop | None:
        """A new host loop where a host mechanism is on (system 'published', dmuon on FSDP / HSDP), else
        None."""
        if not any(m in self.pub for m in HOST_MECHANISMS) or not self._published_active():
            return None
        return HostLoop()

    def _host_batch(self, host: HostLoop | None, dur: float, matrices: int) -> float:
        """An owned batch's duration under the eager Muon loop (`ns_eager`): `matrices` calls."""
        if host is None or "ns_eager" not in self.pub:
            return dur
        return host.gate(dur, matrices * ns_launches(self.s.grad_bytes))

    def _host_adamw(self, host: HostLoop | None, dur: float) -> float:
        """DMuon's AdamW pass under the unfused per-tensor loop (`adamw_unfused`)."""
        if host is None or "adamw_unfused" not in self.pub:
            return dur
        return host.gate(dur, ADAMW_LAUNCHES * self.s.published_adamw_tensors)
