"""Byte counter for collectives: sees every c10d collective a thread issues and records what it moves.

`CollectiveBytes` is a `TorchDispatchMode`: every torch.distributed collective dispatches a `c10d.*` op
(the optimizer's, FSDP2's) or a functional `_c10d_functional.*` op (DTensor's `full_tensor()`), which
the mode records before running it. Nothing is patched. Dispatch modes are per thread: `with
counter.active():` counts the calling thread (FSDP2 issues its collectives from the training thread, in
forward and backward); `CommWorker.counter = counter` makes the optimizer's communication thread count
its jobs too. Each record carries a label (`with label("optimizer"):` on the issuing thread; the
communication thread's jobs are "dmuon").

Bytes are counted per rank as "bytes this rank puts on the wire" under ring / chain algorithms, for a
payload of S bytes on a group of N ranks:

  all_gather      S = output size         (N-1)/N S   (each rank forwards N-1 of the N chunks)
  reduce_scatter  S = input size          (N-1)/N S
  all_reduce      S                       2 (N-1)/N S (reduce-scatter + all-gather)
  broadcast       S                       (N-1)/N S   a pipelined chain carries S over N-1 links: (N-1) S
  reduce          S                       (N-1)/N S   in total, counted evenly as (N-1)/N S per rank
  all_to_all      input splits            exact: the input bytes addressed to the other ranks

So a reduce to an owner plus a broadcast from it count 2 (N-1)/N S per rank, the same as an all-reduce,
whichever rank owns the matrix (muon.md's table counts the same way). Padding is payload: an all-gather
of padded shards counts the padded size. Use `counter.bytes(label=..., op=...)` for totals.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_local = threading.local()

# op name -> how its payload is read: "out0" first tensor arg (all-gather output), "in1" second tensor
# arg (reduce-scatter input), "list0" sum of the first (list) arg
_ALL_GATHER = {"_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_", "allgather_coalesced_"}
_REDUCE_SCATTER = {"_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_"}
_ALL_REDUCE = {"allreduce_", "allreduce_coalesced_"}
_ROOTED = {"broadcast_", "reduce_"}
_ALL_TO_ALL = {"alltoall_base_", "alltoall_"}


@contextlib.contextmanager
def label(name: str):
    """Label the collectives this thread issues inside the block (nested: innermost wins)."""
    old = getattr(_local, "label", None)
    _local.label = name
    try:
        yield
    finally:
        _local.label = old


def current_label(default: str = "") -> str:
    return getattr(_local, "label", None) or default


@dataclass(frozen=True)
class Record:
    op: str  # c10d op name, e.g. "_allgather_base_"
    kind: str  # all_gather | reduce_scatter | all_reduce | broadcast | reduce | all_to_all | other
    group_size: int
    payload_bytes: int  # S of the table in the module docstring
    sent_bytes: float  # this rank's counted bytes
    label: str


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        out = []
        for y in x:
            out += _tensors(y)
        return out
    return []


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _group(args) -> tuple[int, int]:
    """(size, rank) of the process group among the op's arguments."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue
            return pg.size(), pg.rank()
    return 1, 0


def measure(op: str, args) -> tuple[str, int, float, int]:
    """(kind, payload bytes, counted bytes, group size) of one c10d op call (see the module docstring)."""
    n, rank = _group(args)
    f = (n - 1) / n if n > 1 else 0.0
    if op in _ALL_GATHER:
        s = _nbytes(args[0])
        return "all_gather", s, f * s, n
    if op in _REDUCE_SCATTER:
        s = _nbytes(args[1])
        return "reduce_scatter", s, f * s, n
    if op in _ALL_REDUCE:
        s = _nbytes(args[0])
        return "all_reduce", s, 2 * f * s, n
    if op in _ROOTED:
        s = _nbytes(args[0])
        return op.rstrip("_"), s, f * s, n
    if op == "alltoall_base_":
        inp = args[1]
        splits = list(args[4]) if len(args) > 4 and args[4] else []
        row = inp.numel() // inp.shape[0] if inp.dim() and inp.shape[0] else 0
        if splits:
            mine = splits[rank] * row
        else:
            mine = inp.numel() // n
        s = inp.numel() * inp.element_size()
        return "all_to_all", s, float(s - mine * inp.element_size()), n
    if op == "alltoall_":
        ins = _tensors(args[1])
        s = sum(t.numel() * t.element_size() for t in ins)
        mine = ins[rank].numel() * ins[rank].element_size() if len(ins) == n else 0
        return "all_to_all", s, float(s - mine), n
    return "other", _nbytes(args), 0.0, n


def _group_by_name(name) -> tuple[int, int]:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(name)
        return pg.size(), pg.rank()
    except (ImportError, RuntimeError, ValueError, KeyError):
        return 1, 0


def measure_functional(op: str, args) -> tuple[str, int, float, int]:
    """The same for the functional collectives (`_c10d_functional.*`: DTensor's full_tensor() etc.),
    which return their output instead of filling one."""
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        n = int(args[1])
        s = _nbytes(args[0]) * n
        return "all_gather", s, (n - 1) / n * s, n
    if op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        n = int(args[2])
        s = _nbytes(args[0])
        return "reduce_scatter", s, (n - 1) / n * s, n
    if op in ("all_reduce", "all_reduce_coalesced", "all_reduce_"):
        n, _ = _group_by_name(args[2])
        s = _nbytes(args[0])
        return "all_reduce", s, 2 * (n - 1) / n * s, n
    if op in ("broadcast", "broadcast_"):
        n, _ = _group_by_name(args[2])
        s = _nbytes(args[0])
        return "broadcast", s, (n - 1) / n * s, n
    if op == "all_to_all_single":
        n, rank = _group_by_name(args[3])
        inp, splits = args[0], list(args[2])
        s = _nbytes(inp)
        row = inp.numel() // inp.shape[0] if inp.dim() and inp.shape[0] else 0
        mine = (splits[rank] * row if splits else inp.numel() // max(n, 1)) * inp.element_size()
        return "all_to_all", s, float(s - mine), n
    return "other", _nbytes(args), 0.0, 1


_FUNCTIONAL_SKIP = {"wait_tensor"}


class _Mode(TorchDispatchMode):
    def __init__(self, counter: CollectiveBytes, default_label: str):
        super().__init__()
        self.counter, self.default_label = counter, default_label

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if (func.namespace == "c10d" and name != "barrier") or (
                func.namespace == "_c10d_functional" and name not in _FUNCTIONAL_SKIP):
            full = list(args)
            if kwargs:  # keyword arguments after the positional ones, in schema order
                full += [kwargs[a.name] for a in func._schema.arguments[len(args):] if a.name in kwargs]
            self.counter._record(name, full, current_label(self.default_label), func.namespace == "c10d")
        return func(*args, **(kwargs or {}))


class CollectiveBytes:
    """Records of every collective issued where it is active (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.records: list[Record] = []

    def active(self, default_label: str = "main"):
        """A context manager counting the collectives of the calling thread."""
        return _Mode(self, default_label)

    def _record(self, op: str, args, lab: str, c10d: bool = True) -> None:
        kind, payload, sent, n = measure(op, args) if c10d else measure_functional(op, args)
        with self._lock:
            self.records.append(Record(op, kind, n, payload, sent, lab))

    def reset(self) -> None:
        with self._lock:
            self.records = []

    def bytes(self, label: str | None = None, kind: str | None = None) -> float:
        """Counted bytes of the records matching `label` / `kind` (None: any)."""
        with self._lock:
            return sum(r.sent_bytes for r in self.records
                       if (label is None or r.label == label) and (kind is None or r.kind == kind))

    def summary(self) -> dict[tuple[str, str], float]:
        """{(label, kind): counted bytes}."""
        out: dict[tuple[str, str], float] = {}
        with self._lock:
            for r in self.records:
                out[(r.label, r.kind)] = out.get((r.label, r.kind), 0.0) + r.sent_bytes
        return out
