"""Multi-process test helper: run `fn(rank, world_size, *args)` on N gloo ranks and collect the results.

    results = run_distributed(fn, world_size=2, args=(...), timeout_s=60)

- processes start with the spawn context (no inherited state), each with `torch.set_num_threads(1)`,
  a gloo process group on a free TCP port of 127.0.0.1, and the parent's environment (so
  TRITON_INTERPRET set by conftest.py reaches them);
- `fn` must be importable by the children (a module-level function of a test module);
- each rank's return value travels back serialized with `torch.save` (tensors by value);
- if any rank raises, `RanksFailed` lists every rank's outcome (tracebacks included), unless
  `allow_errors=True`, which returns `RankOutcome`s instead of values;
- after `timeout_s` every process still alive is killed and `RanksTimedOut` says which ranks never
  reported: a hang becomes a clear test failure, never a stuck test run.

Later helpers (FSDP2 layout, profiling) reuse this module.
"""

from __future__ import annotations

import atexit
import datetime
import io
import queue
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp


@dataclass
class RankOutcome:
    """What one rank reported: its return value, or the exception (type name, message, traceback)."""

    rank: int
    ok: bool
    value: object = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    elapsed_s: float = 0.0


class RanksFailed(AssertionError):
    """At least one rank raised; the message holds every failing rank's traceback."""


class RanksTimedOut(AssertionError):
    """Some ranks did not report within the timeout; they were killed."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world_size: int, port: int, args: tuple, pg_timeout_s: float, out_queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        payload = ("ok", rank, buf.getvalue(), "", "", "", time.perf_counter() - start)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        payload = ("err", rank, b"", type(e).__name__, str(e), traceback.format_exc(),
                   time.perf_counter() - start)
    out_queue.put(payload)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a failed peer can make tear-down fail; the outcome is already sent
        pass


def run_distributed(fn, world_size: int, args: tuple = (), *, timeout_s: float = 90.0,
                    pg_timeout_s: float = 30.0, allow_errors: bool = False,
                    grace_s: float | None = None) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; see the module docstring.

    Once a rank has raised, the others get `grace_s` more seconds (default pg_timeout_s + 5: long
    enough for their own collective timeouts to fire) before they are killed."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    out_queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, tuple(args), pg_timeout_s, out_queue),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout_s
    grace_s = pg_timeout_s + 5.0 if grace_s is None else grace_s
    shortened = False
    try:
        while len(outcomes) < world_size:
            if not shortened and any(not o.ok for o in outcomes.values()):
                deadline, shortened = min(deadline, time.monotonic() + grace_s), True
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                status, rank, blob, etype, msg, tb, elapsed = out_queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode not in (None, 0)]
                if dead:  # a rank died without reporting (segfault, os._exit): don't wait for the timeout
                    time.sleep(0.5)  # its report may still be in flight
                    if out_queue.empty():
                        for r in dead:
                            outcomes[r] = RankOutcome(r, False, error_type="ProcessDied",
                                                      error=f"exit code {procs[r].exitcode}")
                continue
            value = torch.load(io.BytesIO(blob), weights_only=False) if status == "ok" else None
            outcomes[rank] = RankOutcome(rank, status == "ok", value, etype, msg, tb, elapsed)
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(outcomes) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        out_queue.close()
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing and any(not o.ok for o in outcomes.values()) and not allow_errors:
        detail = "\n".join(f"--- rank {o.rank}: {o.error_type}: {o.error}\n{o.traceback}"
                           for o in outcomes.values() if not o.ok)
        raise RanksFailed(f"ranks {missing} of {world_size} were killed after another rank raised:\n{detail}")
    if missing:
        reported = ", ".join(f"rank {o.rank}: {'ok' if o.ok else o.error_type + ': ' + o.error}"
                             for o in sorted(outcomes.values(), key=lambda o: o.rank))
        raise RanksTimedOut(f"ranks {missing} of {world_size} did not finish within {timeout_s:g} s and were "
                            f"killed (reported: {reported or 'none'})")
    ordered = [outcomes[r] for r in range(world_size)]
    if allow_errors:
        return ordered
    failed = [o for o in ordered if not o.ok]
    if failed:
        detail = "\n".join(f"--- rank {o.rank}: {o.error_type}: {o.error}\n{o.traceback}" for o in failed)
        raise RanksFailed(f"{len(failed)} of {world_size} ranks raised:\n{detail}")
    return [o.value for o in ordered]


def scratch_dir(prefix: str) -> str:
    """A fresh temporary folder for files the ranks share (checkpoints), removed when the test process
    exits, so no run leaves one behind in the temp directory."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
