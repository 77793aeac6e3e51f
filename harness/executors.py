"""Where a sweep's row groups run: `local` (this machine: in-process, or a pool of spawned worker
processes) or `ray` (one Ray task per group, on a Ray cluster or a local Ray instance).

An executor runs the groups harness.sweep hands it (already ordered, biggest first) and calls
`record(rows)` on the driver with each group's finished rows as the groups complete; the driver alone
writes the journal and results.csv (harness.store), so results, journal and resume are the same whatever
runs the rows. A group that fails hands back the rows it finished before the error, and the error is
raised on the driver after they are recorded (as the local pool does).

  local   jobs == 1 (or a runner that measures): in this process, rows recorded one at a time;
          else `jobs` spawned worker processes, one group each at a time.
  ray     `ray.init(address)` (a local Ray instance with `jobs` CPUs when no address is given); each group
          a Ray task of 1 CPU, at most `jobs` in flight when --jobs is given (one at a time for a runner
          that measures). Files a runner writes under its output folder (traces) are written on the
          worker into a temporary folder and shipped back with the rows, so they land beside results.csv
          on the driver. Every worker must run the driver's code version (harness.provenance
          .code_version); a worker that does not fails the sweep with a message naming its host.

Ray is an optional extra (`pip install 'dmuon-harness[ray]'`): it is imported only by the ray executor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from dmuon.errors import InputError, choice_error

EXECUTORS = ("local", "ray")
RAY_MISSING = (
    "--executor ray needs Ray, which is not installed: pip install 'dmuon-harness[ray]' (or pip install ray)"
)

Record = Callable[[list[dict]], None]


def check_executor(executor: str, address: str | None = None) -> str:
    """The executor's name when it is one of EXECUTORS and `address` goes with it; else an InputError."""
    if executor not in EXECUTORS:
        raise choice_error("executor", executor, EXECUTORS)
    if address is not None and executor != "ray":
        raise InputError(
            f"--address {address!r} is a Ray cluster address: it needs --executor ray "
            f"(got --executor {executor})"
        )
    if address is not None and not str(address).strip():
        raise InputError("--address is empty; give a Ray cluster address (HOST:6379), or leave it out for a "
                         "local Ray instance")
    return executor


def worker_init() -> None:
    """One thread per worker: the workers share the cores."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def run_group(runner_name: str, group: list[dict], ctx: dict) -> tuple[list[dict], BaseException | None]:
    """In a worker: the rows of a group that finished, and the exception that stopped it (if any)."""
    from .runners import get_runner

    rows: list[dict] = []
    try:
        for row in get_runner(runner_name).run_group(group, ctx):
            rows.append(row)
    except Exception as e:  # noqa: BLE001 - handed back with the finished rows, raised in the parent
        return rows, e
    return rows, None


# ---- local ---------------------------------------------------------------------------------------
class LocalExecutor:
    """Today's behaviour: in this process when jobs == 1, else a pool of `jobs` spawned processes."""

    name = "local"

    def __init__(self, jobs: int | None = None):
        self.requested = jobs if jobs is not None else (os.cpu_count() or 1)
        self.jobs = self.requested

    def run(self, runner, groups: list[list[dict]], ctx: dict, record: Record) -> None:
        self.jobs = jobs = 1 if not runner.parallel else max(1, min(self.requested, len(groups) or 1))
        if jobs == 1:
            for g in groups:
                for row in runner.run_group(g, ctx):
                    record([row])
            return
        import multiprocessing as mp
        from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

        with ProcessPoolExecutor(
            max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=worker_init
        ) as pool:
            pending = {pool.submit(run_group, runner.name, g, ctx) for g in groups}
            try:
                while pending:
                    done_f, pending = wait(pending, return_when=FIRST_EXCEPTION)
                    for f in done_f:
                        rows, error = f.result()
                        if rows:
                            record(rows)
                        if error is not None:
                            raise error
            except BaseException:
                for f in pending:
                    f.cancel()
                raise

    def prepare(self, groups: list[list[dict]]) -> None:
        """Nothing to start: the pool starts in run()."""

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"executor": self.name}


# ---- ray -----------------------------------------------------------------------------------------
_WORKER_CODE: str | None = None  # this Ray worker process's code version (computed once per process)


def ray_group(runner_name: str, group: list[dict], ctx: dict, code: str):
    """The body of a Ray task: run a group with the files it writes kept in a temporary folder.

    Returns (rows, error, files, host): the finished rows, the exception that stopped the group (or
    None), {path relative to the output folder: bytes} of the files the runner wrote, and this host."""
    import platform
    import tempfile

    global _WORKER_CODE
    worker_init()
    if _WORKER_CODE is None:
        from .provenance import code_version

        _WORKER_CODE = code_version()
    host = platform.node()
    if _WORKER_CODE != code:
        from .errors import RunFailed

        return [], RunFailed(
            f"Ray worker on {host} runs code version {_WORKER_CODE}, the driver {code}: install the same "
            "commit of dmuon-harness on every node of the cluster (rows of other code would be stored as "
            "the driver's)"
        ), {}, host
    with tempfile.TemporaryDirectory(prefix="harness-ray-") as tmp:
        rows, error = run_group(runner_name, group, {**ctx, "out_dir": tmp})
        files = {
            str(p.relative_to(tmp)): p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()
        }
    return rows, error, files, host


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """For a HOST:PORT address, an InputError when nothing listens there (ray.init would retry for
    minutes); other forms (auto, ray://...) are left to Ray."""
    import re
    import socket

    m = re.fullmatch(r"\[?([^\[\]/]+?)\]?:(\d+)", address.strip())
    if not m:
        return
    host, port = m.group(1), int(m.group(2))
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise InputError(
            f"--address {address!r}: no Ray cluster answers there ({e.strerror or e}); start one with "
            "`ray start --head` on that host, or leave --address out for a local Ray instance"
        ) from None


def import_ray():
    """The ray module, or an InputError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise InputError(RAY_MISSING) from None
    return ray


class RayExecutor:
    """Each group a Ray task; results come back in completion order and are recorded by the driver."""

    name = "ray"

    def __init__(self, address: str | None = None, jobs: int | None = None):
        self.ray = import_ray()  # before any work: a missing Ray (or no cluster at address) is one line
        self.address = address
        if address and not self.ray.is_initialized():
            _check_reachable(address)
        self.requested = jobs
        self.jobs = jobs
        self.cluster_cpus: float | None = None
        self._started = False
        self._auth_mode: str | None = None

    def prepare(self, groups: list[list[dict]]) -> None:
        """Connect to the cluster (or start a local instance) when there is work; before anything is
        written, so a cluster that cannot be reached leaves the output folder as it was."""
        import logging

        ray = self.ray
        if not groups or ray.is_initialized():
            return
        kw: dict = {"logging_level": logging.WARNING, "log_to_driver": True}
        if self.address:
            kw["address"] = self.address
        else:  # "local": a new instance even where `ray start` runs on this machine
            kw.update(
                address="local", num_cpus=self.requested or (os.cpu_count() or 1), include_dashboard=False
            )
        self._auth_mode = os.environ.get("RAY_AUTH_MODE")  # ray.init sets it for a local instance
        try:
            ray.init(**kw)
        except ConnectionError as e:
            raise InputError(
                f"--address {self.address!r}: cannot connect to a Ray cluster there ({e}); a cluster with "
                "token authentication (Ray's default) needs RAY_AUTH_MODE=token and its token "
                "(RAY_AUTH_TOKEN, or ~/.ray/auth_token; `ray get-auth-token` on the head node prints it)"
            ) from None
        self._started = True

    def close(self) -> None:
        """Shut Ray down when prepare() started or joined it (a Ray the caller had started stays)."""
        if self._started:
            self.ray.shutdown()
            self._started = False
            if self._auth_mode is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = self._auth_mode

    def run(self, runner, groups: list[list[dict]], ctx: dict, record: Record) -> None:
        from dmuon.io import atomic_write_bytes

        from .provenance import code_version

        ray = self.ray
        if not groups:
            return
        self.prepare(groups)  # a no-op when run_sweep prepared it (or the caller runs Ray)
        self.cluster_cpus = ray.cluster_resources().get("CPU")
        cap = 1 if not runner.parallel else (self.requested or len(groups))
        self.jobs = max(1, min(cap, len(groups)))
        task = ray.remote(num_cpus=1, max_retries=0)(ray_group)
        code = code_version()
        out_dir = Path(ctx["out_dir"])
        queue = list(groups)
        pending: list = []
        try:
            while queue or pending:
                while queue and len(pending) < self.jobs:
                    pending.append(task.remote(runner.name, queue.pop(0), ctx, code))
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    rows, error, files, _host = ray.get(ref)
                    for rel, data in files.items():  # traces, before their rows (as a local run)
                        atomic_write_bytes(out_dir / rel, data)
                    if rows:
                        record(rows)
                    if error is not None:
                        raise error
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise

    def describe(self) -> dict:
        return {"executor": self.name, "ray_address": self.address or "local instance",
                "ray_cluster_cpus": self.cluster_cpus}


def make_executor(executor: str = "local", *, address: str | None = None, jobs: int | None = None):
    """A LocalExecutor or RayExecutor (checked: an unknown name, or an address without ray, is an
    InputError; so is --executor ray without Ray installed)."""
    check_executor(executor, address)
    if executor == "ray":
        return RayExecutor(address=address, jobs=jobs)
    return LocalExecutor(jobs=jobs)


__all__ = [
    "EXECUTORS",
    "RAY_MISSING",
    "LocalExecutor",
    "RayExecutor",
    "check_executor",
    "import_ray",
    "make_executor",
    "ray_group",
    "run_group",
    "worker_init",
]
