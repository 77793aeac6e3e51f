"""Run a function on N spawned gloo ranks for the measurement scripts (scripts/owner_step_ops.py,
scripts/ep_step.py): `run_ranks(target, n, args)` starts `target(rank, args, port, queue)` in n processes
(each puts one result on the queue, led by its rank) and returns the results in rank order; a rank
that fails stops the run (the others would wait in a collective) with the exit codes."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, n: int, args) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.SimpleQueue(), free_port()
    procs = [ctx.Process(target=target, args=(r, args, port, queue)) for r in range(n)]
    for p in procs:
        p.start()
    got = []
    while len(got) < len(procs):  # a rank that fails leaves the others waiting in a collective: stop them
        if not queue.empty():
            got.append(queue.get())
        elif any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            raise SystemExit(f"a rank failed (exit codes {[p.exitcode for p in procs]}); see its traceback")
        else:
            time.sleep(0.2)
    for p in procs:
        p.join()
    return sorted(got)
