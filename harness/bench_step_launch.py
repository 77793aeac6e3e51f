"""How `harness bench step` starts its ranks: N spawned processes on this machine (gloo on the CPU,
nccl on CUDA, one GPU per rank) or this process as one rank under torchrun; failures come back as one
RunFailed line naming the rank that died first (full tracebacks in a log file), timeouts kill every rank.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import tempfile
import time
import traceback

from dmuon.errors import InputError

from .bench_step_config import StepConfig, threads_for, use_cuda
from .bench_step_rank import rank_main
from .errors import RunFailed


def _own_session() -> None:
    """--rank-sessions: put this rank in a session of its own. Linux's scheduler with autogroups
    (/proc/sys/kernel/sched_autogroup_enabled = 1) shares the CPU fairly between sessions, not threads,
    so ranks spawned into the launcher's session share one session's share against other sessions'
    jobs; in a session of its own each rank competes as one process (as a rank on its own node would).
    Measured on the shared 2-core machine: no clear effect on the split ratios (results/bench/README.md)."""
    try:
        os.setsid()
    except (AttributeError, OSError):  # not POSIX, or already a session / group leader
        pass


def _spawned(rank: int, world: int, port: int, cfg: StepConfig, out) -> None:
    import torch
    import torch.distributed as dist

    if cfg.rank_sessions:
        _own_session()
    torch.set_num_threads(threads_for(cfg, world))
    try:
        backend = "nccl" if use_cuda(cfg) else "gloo"
        kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=min(cfg.timeout_s, 600.0)), **kwargs)
        rows = rank_main(cfg, rank, world, rank)
        out.put(("ok", rank, rows))
    except BaseException as e:  # noqa: BLE001 - every failure reaches the parent
        out.put(("err", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(cfg: StepConfig) -> list[dict]:
    """Spawn cfg.ranks processes on this machine and return rank 0's rows (kill all on timeout/error)."""
    import torch.multiprocessing as mp

    if use_cuda(cfg):
        import torch

        if cfg.ranks > torch.cuda.device_count():
            raise InputError(f"--ranks {cfg.ranks} needs {cfg.ranks} GPUs (nccl: one rank per GPU); "
                             f"{torch.cuda.device_count()} visible. Use --device cpu for gloo ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if cfg.exact_memory and not use_cuda(cfg):  # freed tensors leave the resident set at once
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, cfg.ranks, port, cfg, out), daemon=True)
             for r in range(cfg.ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + cfg.timeout_s
    rows, errors, reported = None, {}, set()
    try:
        while len(reported) < cfg.ranks and time.monotonic() < deadline:
            try:
                status, rank, payload = out.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and out.empty():
                    time.sleep(1.0)
                    if out.empty():
                        break
                continue
            reported.add(rank)
            if status == "ok" and rank == 0:
                rows = payload
            elif status == "err":
                errors[rank] = payload
                break
        failed = bool(errors) or any(p.exitcode not in (None, 0) for p in procs)
        if failed:  # a peer's death shows up on the others as "connection closed": find who died first
            settle = time.monotonic() + 3.0
            while time.monotonic() < settle and any(p.exitcode is None for p in procs):
                while not out.empty():
                    status, rank, payload = out.get_nowait()
                    if status == "err":
                        errors.setdefault(rank, payload)
                time.sleep(0.1)
    finally:
        for p in procs:
            p.join(timeout=10.0 if not errors and rows is not None else 0.5)
            if p.is_alive():
                p.kill()
    died = [f"rank {r} died ({_exit_text(p.exitcode)})" for r, p in enumerate(procs)
            if p.exitcode not in (None, 0) and r not in errors]
    if errors or died:
        raise RunFailed(_failure_message(died, errors))
    if rows is None:
        missing = sorted(set(range(cfg.ranks)) - reported)
        raise RunFailed(f"bench step: ranks {missing} did not finish within {cfg.timeout_s:g} s and were "
                        "killed; raise --timeout-s or shrink the model (--width-scale, --layers)")
    return rows


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _failure_message(died: list[str], errors: dict[int, str]) -> str:
    """One line for the terminal; the ranks' full tracebacks go to a log file it names."""
    parts = died + [f"rank {r}: {text.splitlines()[0] if text else '?'}"
                    for r, text in sorted(errors.items())]
    msg = "bench step failed: " + "; ".join(parts)
    if errors:
        from dmuon.io import atomic_path

        log = os.path.join(tempfile.gettempdir(), f"harness-bench-step-{os.getpid()}-{int(time.time())}.log")
        with atomic_path(log) as tmp:
            tmp.write_text("".join(f"=== rank {r} ===\n{text}\n" for r, text in sorted(errors.items())))
        msg += f" (full tracebacks: {log})"
    return msg


def run_torchrun(cfg: StepConfig) -> list[dict] | None:
    """Under torchrun: this process is one rank (env://); rank 0 returns the rows."""
    import torch
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.set_num_threads(threads_for(cfg, local_world))
    backend = "nccl" if use_cuda(cfg) else "gloo"
    dist.init_process_group(backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=min(cfg.timeout_s, 600.0)))
    try:
        return rank_main(cfg, rank, world, local_rank)
    finally:
        dist.destroy_process_group()


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


__all__ = ["launch", "run_torchrun", "under_torchrun"]
