"""Chrome-trace (Perfetto / chrome://tracing) timelines of a finished simulation.

One process per node (pid = node index), one thread per rank and stream (tid = rank x 8 + stream index,
named "rank R compute" / "rank R comm"), one complete event ("ph": "X") per op that ran, times in
microseconds. Collectives appear on every participant's comm track with the collective's start and end;
`args` carry the step, phase, and for collectives the kind and bytes each rank sends. Written atomically
(temp file + os.replace).
"""

from __future__ import annotations

import json
from pathlib import Path

from dmuon.errors import InputError

_STREAMS_PER_RANK = 8


def trace_events(built, ranks_per_node: int, steps: tuple[int, ...] | None = None) -> list[dict]:
    cl = built.cluster
    events: list[dict] = []
    stream_index = {s: i for i, s in enumerate(cl.stream_names)}
    if len(stream_index) > _STREAMS_PER_RANK:
        raise ValueError(f"at most {_STREAMS_PER_RANK} streams per rank fit the tid scheme")
    nodes = set()
    for (rank, stream), ops in cl.queues.items():
        node = rank // ranks_per_node
        tid = rank * _STREAMS_PER_RANK + stream_index[stream]
        if not ops:
            continue
        if node not in nodes:
            nodes.add(node)
            events.append({"ph": "M", "name": "process_name", "pid": node, "tid": 0,
                           "args": {"name": f"node {node}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": node, "tid": tid,
                       "args": {"name": f"rank {rank} {stream}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": node, "tid": tid,
                       "args": {"sort_index": tid}})
        for op in ops:
            if op.start is None or (steps is not None and op.step not in steps):
                continue
            args = {"step": op.step, "phase": op.phase}
            if op.coll is not None:
                args.update(kind=op.coll.kind, bytes_per_rank=op.coll.bytes_per_rank, group=op.coll.group)
            if op.slowed_s:
                args["slowed_us"] = op.slowed_s * 1e6
            events.append({"ph": "X", "name": op.name, "cat": op.phase, "pid": node, "tid": tid,
                           "ts": op.start * 1e6, "dur": (op.end - op.start) * 1e6, "args": args})
    return events


def write_trace(built, path: str | Path, *, ranks_per_node: int, metadata: dict | None = None) -> Path:
    """Write the Chrome-trace JSON of `built` (a finished `simulator.programs.step.Built`) to `path`, atomically."""
    path = Path(path)
    if path.exists() and path.is_dir():
        raise InputError(f"trace path {str(path)!r} is a directory; give a file name such as trace.json")
    if not path.parent.exists():
        raise InputError(f"trace directory {str(path.parent)!r} does not exist")
    doc = {"traceEvents": trace_events(built, ranks_per_node), "displayTimeUnit": "ms",
           "otherData": metadata or {}}
    from dmuon.io import atomic_write_text

    return atomic_write_text(path, json.dumps(doc, separators=(",", ":"), default=str))
