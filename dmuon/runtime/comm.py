"""The communication thread: every collective of a distributed optimizer runs here, in submission order.

The training (compute) thread packs a buffer, submits a job and goes on; the job's `Handle` is waited
on only where the result is needed (the optimizer step, a module's forward pre-hook). Rules that keep
this safe:
  - one worker per optimizer, FIFO: ranks submit the same jobs in the same order (the hooks launch
    buckets in a fixed order), so the collectives match on every rank;
  - the worker uses private process groups (`groups.py`): no interleaving with the user's collectives;
  - every wait has a timeout; a collective that fails (a peer died, gloo/NCCL timed out) poisons the
    worker, and every later wait raises `CommError` naming the first failure: no rank hangs;
  - on CUDA the jobs run on a dedicated stream: a job first waits for the event recorded when its
    input was packed, and the consumer's stream waits for the event recorded after the job.
`CommStats` counts what the compute thread waited (exposed communication) and the bytes sent; set
`worker.counter` to a `bytecount.CollectiveBytes` to record the jobs' collectives as they run.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field

import torch


class CommError(RuntimeError):
    """A collective of the optimizer failed or did not finish within the timeout."""


@dataclass
class CommStats:
    """Counters since the last `reset()`: exposed wait, jobs run, payload bytes by kind, and the compute
    thread's time inside NS calls (`ns_s`: with wait_s, what a step's time is made of; the rest is the
    optimizer's own overhead. CPU: wall time of the calls; CUDA: their launch time only) and its CPU time
    there (`ns_cpu_s`: on a CPU the calls' compute, whatever else shares the cores)."""

    wait_s: float = 0.0  # time the compute thread spent blocked on communication handles
    jobs: int = 0  # communication jobs finished (each is one or a few collectives)
    payload_bytes: dict = field(default_factory=dict)  # kind -> estimated bytes this rank sent (see units.py)
    ns_s: float = 0.0  # compute-thread seconds inside orthogonalize calls
    ns_cpu_s: float = 0.0  # the compute thread's CPU seconds inside them (time.thread_time)
    ns_calls: int = 0

    def reset(self) -> None:
        self.wait_s = 0.0
        self.jobs = 0
        self.payload_bytes = {}
        self.ns_s = 0.0
        self.ns_cpu_s = 0.0
        self.ns_calls = 0

    @contextlib.contextmanager
    def ns_call(self, calls: int = 1):
        """Time the NS call(s) of the block into ns_s / ns_cpu_s and count them."""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.ns_s += time.perf_counter() - wall
            self.ns_cpu_s += time.thread_time() - cpu
            self.ns_calls += calls

    def add_bytes(self, kind: str, n: int) -> None:
        self.payload_bytes[kind] = self.payload_bytes.get(kind, 0) + int(n)

    @property
    def total_bytes(self) -> int:
        return sum(self.payload_bytes.values())


class Handle:
    """Completion of one submitted job."""

    def __init__(self, name: str, worker: CommWorker):
        self.name = name
        self._worker = worker
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.result = None
        self.cuda_event = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None):
        """Block until the job finished (counting the time as exposed communication); raise CommError
        if it failed or did not finish in time. On CUDA the current stream then waits for the job."""
        w = self._worker
        timeout_s = w.timeout_s if timeout_s is None else timeout_s
        if not self._done.is_set():
            start = time.perf_counter()
            finished = self._done.wait(timeout_s)
            w.stats.wait_s += time.perf_counter() - start
            if not finished:
                raise CommError(
                    f"rank {w.rank}: communication '{self.name}' did not finish within {timeout_s:g} s; "
                    "another rank probably failed, stopped calling backward()/step(), or built a different "
                    f"model or plan{w.failure_note()}")
        if self.error is not None:
            msg = f"rank {w.rank}: communication '{self.name}' failed: {self.error}"
            raise CommError(msg) from self.error
        if self.cuda_event is not None:
            torch.cuda.current_stream().wait_event(self.cuda_event)
        return self.result


class CommWorker:
    """A daemon thread running submitted jobs one after the other (see the module docstring)."""

    def __init__(self, rank: int, timeout_s: float, device: torch.device, stats: CommStats | None = None):
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.stats = stats if stats is not None else CommStats()
        self.device = torch.device(device)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._failed_job = ""
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.counter = None  # a bytecount.CollectiveBytes: jobs run with it active (label "dmuon")
        self._thread = threading.Thread(target=_run, args=(self._queue, self), name=f"dmuon-comm-{rank}",
                                        daemon=True)
        self._thread.start()

    def failure_note(self) -> str:
        if self._failure is None:
            return ""
        return f" (the communication thread stopped after '{self._failed_job}' failed: {self._failure})"

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def submit(self, name: str, fn, *, kind: str = "", bytes_: int = 0) -> Handle:
        """Run `fn()` (which issues blocking collectives) on the worker; returns its Handle at once.
        The job's input is considered ready at the time of this call (a CUDA event marks it)."""
        h = Handle(name, self)
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if kind:
            self.stats.add_bytes(kind, bytes_)
        self._queue.put((h, fn, ready))
        return h

    def close(self) -> None:
        """Stop the thread after the jobs already submitted (does not wait for a stuck collective)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=1.0)


def _run(jobs: queue.SimpleQueue, worker: CommWorker) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        handle, fn, ready = item
        if worker._failure is not None:
            handle.error = CommError(f"not run: an earlier communication '{worker._failed_job}' failed "
                                     f"({worker._failure})")
            handle._done.set()
            continue
        counter = worker.counter
        counting = counter.active("dmuon") if counter is not None else contextlib.nullcontext()
        try:
            with torch.no_grad(), counting:
                if worker._stream is not None:
                    with torch.cuda.stream(worker._stream):
                        worker._stream.wait_event(ready)
                        handle.result = fn()
                        handle.cuda_event = torch.cuda.Event()
                        handle.cuda_event.record(worker._stream)
                else:
                    handle.result = fn()
            worker.stats.jobs += 1
        except BaseException as e:  # noqa: BLE001 - reported to every waiter
            worker._failure, worker._failed_job = e, handle.name
            handle.error = e
        finally:
            handle._done.set()
            del item, fn  # drop the job (and the buffers it holds) now, not at the next job
