"""`harness bench step`: real training steps of DMuon, NaiveMuon and replicated AdamW on N processes.

Spawns N ranks (gloo on the CPU, nccl on CUDA) -- or runs as one rank under torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK set) -- builds `harness.benchmodel` for the workload, and trains
every requested variant (strategy x overlap) in turn on seeded synthetic data, in the same processes.
Per timed step (after --warmup steps) each rank records, on its compute thread:

  forward_s       forward + loss (includes waiting for published weights: overlap=True)
  backward_s      loss.backward() (gradient exchange launched from hooks, not waited)
  optimizer_s     end of backward -> step() returned: waiting for the gradient exchange, flag all-reduce,
                  momentum + NS on this rank's matrices, updates, and the exposed publication wait when
                  overlap is off (with overlap on it moves into the next forward_s)
  step_s          one whole iteration: forward + backward + step + zero_grad
  exposed_comm_s  time the compute thread was blocked on communication (all phases; on CUDA only the
                  CPU-side waits: the compute stream's waits for the communication stream are inside
                  the phase times)
  optimizer_cpu_s CPU time of the compute thread inside step() (unaffected by CPU oversubscription)

Variants run in blocks, alternating over --rounds rounds (naive, dmuon, naive, dmuon, ...) so that a
drift in machine load hits all of them alike; each block builds a fresh model and optimizer (same seed),
runs --warmup untimed steps, then its share of the --steps timed steps, and frees everything. An untimed
one-step block of every variant runs first (first-use costs stay out of the measured blocks).
With --phase-barrier (default) an untimed barrier separates backward from step() on all ranks, so that
skew between ranks (large when ranks time-share CPU cores) is not charged to the optimizer phase: it is
measured as if every rank finished backward together, as a synchronous cluster (and the simulator)
does; step_s excludes that wait too. No barrier starts the iteration: a barrier there would give the
weight publication free time to finish before forward and hide its exposed wait.
Reported: per step the max over ranks, then the median over all timed steps of the variant.
peak_mem_bytes: CUDA: max allocated during the block; CPU: the peak resident set of the rank (the
kernel's high-water mark, reset when the block starts) over the set before the model was built, after
returning freed heap memory to the OS: what the variant's model, activations, gradients, optimizer
state and buffers took at their peak (glibc keeps some freed memory in its heap for reuse, so the peak
includes the allocator's slack, as a real CPU job's does). --exact-memory runs the CPU ranks with
MALLOC_MMAP_THRESHOLD_=65536 so that a freed tensor leaves the resident set at once: a tighter peak, but
every large allocation then maps fresh pages, which slows allocation-heavy code (the NS, AdamW) about
2x on the development machine: do not compare its times with other rows (column exact_memory).
probe_s (--speed-probe): before each block builds its optimizer, every rank times PROBE_REPEATS forward +
backward passes of the fresh model at once (median; max over ranks, then the median over blocks): the
machine's speed during the run, which `harness validate` compares with the profile's compute model (a
shared VM's speed drifts by tens of percent within minutes); probe_ns_s and probe_ew_s: the same for
one NS call the runtime makes (simulator.validate.ns_probe_call) and one AdamW pass over 4M elements,
compared with the cost table's times for them.
comm_bytes_per_step: bytes a rank sends per step (max over ranks), counted on one extra untimed step at
the end of the block by `dmuon.runtime.bytecount` (every collective of every thread: the optimizer's
and FSDP2's): payload (padding included) x (N-1)/N for reduce-scatter, all-gather, per-owner reduce
and broadcast, x 2 (N-1)/N for all-reduce (ring / chain algorithms), the exact bytes sent for
all-to-all; opt_comm_bytes_per_step is the optimizer's own part (fsdp_comm_bytes_per_step: FSDP2's).
strategy adamw = every parameter on replicated AdamW with bucketed async all-reduce (DDP-like), the
same runtime with no Muon matrices.
--layout ddp (replicated model) | fsdp2-owner | fsdp2-sharded (FSDP2 via `dmuon.shard_model`, a 1-D
mesh over the ranks; see docs/fsdp.md). fsdp2-owner: DMuon with the Muon matrices outside FSDP2
(owner-centric), NaiveMuon and adamw on FSDP2-sharded matrices (gather-then-compute: the paper's
baseline on FSDP). fsdp2-sharded: every strategy on FSDP2-sharded matrices. --memory keep | free:
FSDP2's reshard_after_forward (False | True) and, for the owner layout, DMuon's memory mode.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import queue
import signal
import socket
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction

from dmuon.errors import InputError, choice_error

from .errors import RunFailed

STRATEGIES = ("dmuon", "naive", "adamw")
LAYOUTS = ("ddp", "fsdp2-owner", "fsdp2-sharded")
MEMORY = ("keep", "free")
OVERLAP = ("on", "off", "both")
METRICS = ("step_s", "forward_s", "backward_s", "optimizer_s", "exposed_comm_s", "optimizer_cpu_s")


@dataclass
class StepConfig:
    ranks: int = 2
    strategies: tuple[str, ...] = ("dmuon",)
    overlap: str = "on"
    workload: str = "qwen2.5-7b"
    width_scale: float = 1 / 16
    layers: int | None = 4
    seq_len: int = 128
    micro_batch: int = 2
    steps: int = 8
    warmup: int = 2
    rounds: int = 2
    phase_barrier: bool = True
    balancer: str = "lpt"
    exchanges: tuple[str, ...] = ("auto",)
    node_size: int | None = None
    profile: str | None = None
    device: str = "auto"
    threads: int = 0  # 0: cores // ranks (at least 1)
    seed: int = 0
    timeout_s: float = 1800.0
    profile_trace: str | None = None
    layout: str = "ddp"
    memory: str = "keep"
    exact_memory: bool = False
    speed_probe: bool = False
    notes: list[str] = field(default_factory=list)

    def variants(self) -> list[tuple[str, bool, str]]:
        """(strategy, overlap, exchange) of every block; the exchange mode varies for dmuon only."""
        overlaps = {"on": (True,), "off": (False,), "both": (True, False)}[self.overlap]
        return [(s, ov, ex) for s in self.strategies for ov in overlaps
                for ex in (self.exchanges if s == "dmuon" else self.exchanges[:1])]


def parse_scale(text) -> float:
    try:
        value = float(Fraction(str(text)))
    except (ValueError, ZeroDivisionError):
        raise InputError(f"width scale {text!r} is not a number; accepted: e.g. 0.0625 or 1/16") from None
    if not value > 0:
        raise InputError(f"width scale must be > 0, got {text!r}")
    return value


def check_config(cfg: StepConfig) -> None:
    """Every InputError the run could raise, before any process starts."""
    from simulator.workload import load_workload

    from .benchmodel import decoder_spec

    for name, v, lo in (("ranks", cfg.ranks, 1), ("seq_len", cfg.seq_len, 1),
                        ("micro_batch", cfg.micro_batch, 1), ("steps", cfg.steps, 1),
                        ("warmup", cfg.warmup, 0), ("threads", cfg.threads, 0), ("rounds", cfg.rounds, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InputError(f"{name} must be an integer >= {lo}, got {v!r}")
    if not cfg.strategies:
        raise InputError(f"no strategy given; accepted: {', '.join(STRATEGIES)} (comma-separated)")
    for s in cfg.strategies:
        if s not in STRATEGIES:
            raise choice_error("strategy", s, STRATEGIES)
    if cfg.overlap not in OVERLAP:
        raise choice_error("overlap", cfg.overlap, OVERLAP)
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise choice_error("device", cfg.device, ("auto", "cpu", "cuda"))
    from dmuon.distributed import BALANCERS
    from dmuon.runtime.exchange import EXCHANGE_CHOICES
    from dmuon.runtime.groups import check_node_size

    if cfg.balancer not in BALANCERS:
        raise choice_error("balancer", cfg.balancer, BALANCERS)
    if not cfg.exchanges:
        raise InputError(f"no exchange mode given; accepted: {', '.join(EXCHANGE_CHOICES)} (comma-separated)")
    for ex in cfg.exchanges:
        if ex not in EXCHANGE_CHOICES:
            raise choice_error("exchange", ex, EXCHANGE_CHOICES)
    check_node_size(cfg.node_size, cfg.ranks)
    if cfg.layout not in LAYOUTS:
        raise choice_error("layout", cfg.layout, LAYOUTS)
    if cfg.memory not in MEMORY:
        raise choice_error("memory", cfg.memory, MEMORY)
    if cfg.layout == "ddp" and cfg.memory != "keep":
        raise InputError("--memory free needs an FSDP2 layout; accepted with --layout ddp: keep")
    if cfg.layout != "ddp" and cfg.node_size is not None:
        raise InputError("--node-size is for --layout ddp (FSDP2 layouts use a 1-D mesh here)")
    decoder_spec(load_workload(cfg.workload).scaled(cfg.width_scale, blocks=cfg.layers))
    if isinstance(cfg.timeout_s, bool) or not isinstance(cfg.timeout_s, (int, float)) \
            or not math.isfinite(cfg.timeout_s) or cfg.timeout_s <= 0:
        raise InputError(f"timeout_s must be a finite number of seconds > 0, got {cfg.timeout_s!r}")
    if cfg.profile is not None:  # a missing or malformed profile fails here, not inside every rank
        from dmuon.plan.cost import CostTable

        CostTable.load(cfg.profile)
    if cfg.profile_trace:
        try:
            os.makedirs(cfg.profile_trace, exist_ok=True)
        except OSError as e:
            raise InputError(f"--profile-trace {cfg.profile_trace!r}: cannot create this folder "
                             f"({e.strerror or type(e).__name__}); give a writable folder") from None
        if not os.access(cfg.profile_trace, os.W_OK):
            raise InputError(f"--profile-trace {cfg.profile_trace!r} is not writable; give a writable folder")


# ---- one rank ------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_optimizer(strategy: str, model, cfg: StepConfig, overlap: bool, exchange: str):
    from dmuon.distributed import DMuon, NaiveMuon

    from .benchmodel import shard_for

    common = dict(overlap=overlap, node_size=cfg.node_size, timeout_s=min(cfg.timeout_s, 600.0),
                  exchange=exchange, balancer=cfg.balancer, profile=cfg.profile)
    layout = shard_for(model, strategy, cfg.layout, cfg.memory)
    if layout == "fsdp2-owner":
        common["memory"] = cfg.memory
    if strategy == "adamw":
        return DMuon(model, muon_predicate=lambda name, p: False, warn_no_muon=False, shard_adamw=False,
                     **common)
    return (DMuon if strategy == "dmuon" else NaiveMuon)(model, **common)


def _reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark (Linux >= 4.0; else the peak stays process-wide)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return _rss_bytes()


def _count_step(cfg: StepConfig, model, opt, rank: int, device, it: int) -> dict:
    """One more (untimed) iteration with every collective counted (see the module docstring)."""
    from dmuon.runtime.bytecount import CollectiveBytes

    from .benchmodel import synthetic_batch

    counter = CollectiveBytes()
    workers = [w for w in (opt._worker, getattr(opt, "_pub_worker", None)) if w is not None]
    opt.synchronize_exchanges()
    for w in workers:
        w.counter = counter
    x, y = synthetic_batch(model.vocab, cfg.seq_len, cfg.micro_batch, seed=cfg.seed, step=it, rank=rank,
                           device=device)
    try:
        with counter.active():
            model(x, y).backward()
            opt.step()
            opt.synchronize_exchanges()
    finally:
        for w in workers:
            w.counter = None
    opt.zero_grad(set_to_none=True)
    own = counter.bytes(label="dmuon") + counter.bytes(label="optimizer")
    return dict(comm_bytes_per_step=counter.bytes(), opt_comm_bytes_per_step=own,
                fsdp_comm_bytes_per_step=counter.bytes(label="main"))


PROBE_REPEATS = 3


def _speed_probe(model, workload, cfg: StepConfig, device) -> tuple[float, float, float]:
    """--speed-probe: the machine's speed right now, on every rank at once: median seconds of
    PROBE_REPEATS forward + backward passes of the freshly built model (after one untimed), before the
    optimizer exists (no hooks, no communication; compared with the profile's compute model for this
    model, simulator.validate.speed_scale_of), of PROBE_REPEATS calls of the NS the runtime makes that
    `simulator.validate.ns_probe_call` names, and of PROBE_REPEATS AdamW passes over
    simulator.validate.EW_PROBE_NUMEL elements (the last two: what the cost table prices)."""
    import torch
    import torch.distributed as dist

    from dmuon import orthogonalize
    from dmuon.plan.profile import elementwise_calls
    from simulator.validate import EW_PROBE_NUMEL, EW_PROBE_OP, ns_probe_call

    from .benchmodel import synthetic_batch

    x, y = synthetic_batch(model.vocab, cfg.seq_len, cfg.micro_batch, seed=0, step=0, rank=0, device=device)
    batch, rows, cols, method = ns_probe_call(workload)
    stack = torch.randn(batch, rows, cols, generator=torch.Generator().manual_seed(0)).to(device)

    def fwd_bwd():
        model(x, y).backward()
        model.zero_grad(set_to_none=True)

    def median_s(fn) -> float:
        dist.barrier()
        times = []
        for i in range(PROBE_REPEATS + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    elementwise = elementwise_calls(EW_PROBE_NUMEL, device=device.type)[EW_PROBE_OP]
    out = median_s(fwd_bwd), median_s(lambda: orthogonalize(stack, method=method)), median_s(elementwise)
    dist.barrier()
    return out


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc), so RSS growth measures the next variant alone."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_variant(cfg: StepConfig, variant: tuple[str, bool, str], rank: int, world: int, device, timed: int,
                tag: str = "") -> list[dict]:
    """Train one block of a variant on this rank; per-iteration records of its `timed` steps."""
    import torch
    import torch.distributed as dist

    from simulator.workload import load_workload

    from .benchmodel import build_bench_model, synthetic_batch

    strategy, overlap, exchange = variant
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    _trim_heap()
    base_rss = _rss_bytes()
    _reset_peak_rss()
    workload = load_workload(cfg.workload).scaled(cfg.width_scale, blocks=cfg.layers)
    model = build_bench_model(workload, seed=cfg.seed, device=device, dtype=dtype)
    probe_s, probe_ns_s, probe_ew_s = (_speed_probe(model, workload, cfg, device) if cfg.speed_probe
                                       else (float("nan"),) * 3)
    opt = make_optimizer(strategy, model, cfg, overlap, exchange)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    prof = None
    records = []

    def align() -> float:
        """With --phase-barrier: a barrier (default group, untimed) so the next phase starts together on
        every rank; returns the seconds it took."""
        if not cfg.phase_barrier:
            return 0.0
        start = now()
        dist.barrier()
        return now() - start

    def now():  # CUDA: wait for the compute stream only (the communication stream keeps overlapping)
        if cuda:
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()

    for it in range(cfg.warmup + timed):
        if it == cfg.warmup and cfg.profile_trace:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                          + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
            prof.__enter__()
        x, y = synthetic_batch(model.vocab, cfg.seq_len, cfg.micro_batch, seed=cfg.seed, step=it, rank=rank,
                               device=device)
        opt.comm_stats.reset()
        t0 = now()
        loss = model(x, y)
        t1 = now()
        loss.backward()
        t2 = now()
        skew = align()
        t2 += skew
        c2 = time.thread_time()
        opt.step()
        c3 = time.thread_time()
        t3 = now()
        opt.zero_grad(set_to_none=True)
        t4 = now()
        if it >= cfg.warmup:
            records.append(dict(step_s=t4 - t0 - skew, forward_s=t1 - t0, backward_s=t2 - skew - t1,
                                optimizer_s=t3 - t2,
                                exposed_comm_s=opt.comm_stats.wait_s, optimizer_cpu_s=c3 - c2,
                                peak_mem_bytes=(torch.cuda.max_memory_allocated(device) if cuda
                                                else _peak_rss() - base_rss),
                                loss=float(loss.detach()), load_1m=os.getloadavg()[0], probe_s=probe_s,
                                probe_ns_s=probe_ns_s, probe_ew_s=probe_ew_s))
    counted = _count_step(cfg, model, opt, rank, device, cfg.warmup + timed)
    for r in records:
        r.update(counted)
    if prof is not None:
        prof.__exit__(None, None, None)
        os.makedirs(cfg.profile_trace, exist_ok=True)
        name = f"{strategy}-overlap_{'on' if overlap else 'off'}-{exchange}{tag}-rank{rank}.json"
        prof.export_chrome_trace(os.path.join(cfg.profile_trace, name))
    opt.synchronize()
    info = dict(opt_state_bytes=opt.state_bytes,
                exchange_buffer_bytes=sum(u.buffer_bytes() * (2 if hasattr(u, "launch_publish") else 1)
                                          for u in opt.units),
                n_params=sum(p.numel() for p in model.parameters()),
                n_muon_params=sum(opt.params[i].numel() for i in range(opt.n_muon)),
                plan_makespan_s=opt.plan.makespan_s if opt.plan is not None else 0.0,
                plan_cost_source=opt.plan.cost_source if opt.plan is not None else "")
    opt.close()
    del model, opt
    for r in records:
        r.update(info)
    return records


def rank_main(cfg: StepConfig, rank: int, world: int, local_rank: int) -> list[dict] | None:
    """Run every variant on this (initialized) rank; rank 0 returns the aggregated rows."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", local_rank) if _use_cuda(cfg) else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    variants = cfg.variants()
    records: list[list[dict]] = [[] for _ in variants]
    per_block = [cfg.steps // cfg.rounds + (1 if r < cfg.steps % cfg.rounds else 0)
                 for r in range(cfg.rounds)]
    for variant in variants:  # an untimed one-step block per variant first: libraries and lazily built
        dist.barrier()  # state (DTensor, FSDP2, NS code) load here, not in the first measured block's peak
        untimed = replace(cfg, warmup=0, profile_trace=None, speed_probe=False)
        run_variant(untimed, variant, rank, world, device, 1)
    for rnd, timed in enumerate(per_block):
        for k, variant in enumerate(variants):
            if timed:
                dist.barrier()
                tag = f"-round{rnd}" if cfg.rounds > 1 else ""
                records[k] += run_variant(cfg, variant, rank, world, device, timed, tag)
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    if rank != 0:
        return None
    return [aggregate(cfg, v, [g[k] for g in gathered], world, device) for k, v in enumerate(variants)]


def aggregate(cfg: StepConfig, variant: tuple[str, bool, str], per_rank: list[list[dict]], world: int,
              device) -> dict:
    """Max over ranks per step, then the median over steps."""
    import torch

    steps = len(per_rank[0])
    strategy, overlap, exchange = variant
    row = dict(ranks=world, strategy=strategy, overlap=overlap, exchange=exchange, layout=cfg.layout,
               memory=cfg.memory)
    for key in METRICS + ("comm_bytes_per_step", "opt_comm_bytes_per_step", "fsdp_comm_bytes_per_step",
                          "peak_mem_bytes"):
        per_step = [max(r[i][key] for r in per_rank) for i in range(steps)]
        row[key] = statistics.median(per_step)
    for key in ("probe_s", "probe_ns_s", "probe_ew_s"):  # the blocks' probes
        per_step = [max(r[i].get(key, math.nan) for r in per_rank) for i in range(steps)]
        row[key] = statistics.median(per_step) if cfg.speed_probe else None
    for key in ("step_s", "optimizer_s"):  # spread; the minimum is the least disturbed step
        row[f"{key}_min"] = min(max(r[i][key] for r in per_rank) for i in range(steps))
        row[f"{key}_max"] = max(max(r[i][key] for r in per_rank) for i in range(steps))
    for key in ("opt_state_bytes", "exchange_buffer_bytes"):
        row[key] = max(r[0][key] for r in per_rank)
    row["load_1m"] = statistics.median(r["load_1m"] for r in per_rank[0])
    first = per_rank[0][0]
    row.update(n_params=first["n_params"], n_muon_params=first["n_muon_params"],
               plan_makespan_s=first["plan_makespan_s"], plan_cost_source=first["plan_cost_source"],
               final_loss=per_rank[0][-1]["loss"], workload=cfg.workload, width_scale=cfg.width_scale,
               layers=cfg.layers, seq_len=cfg.seq_len, micro_batch=cfg.micro_batch, steps=cfg.steps,
               warmup=cfg.warmup, rounds=cfg.rounds, phase_barrier=cfg.phase_barrier, balancer=cfg.balancer,
               node_size=cfg.node_size,
               exact_memory=device.type == "cpu" and bool(os.environ.get("MALLOC_MMAP_THRESHOLD_")),
               device=str(device.type), backend="nccl" if device.type == "cuda" else "gloo",
               threads_per_rank=torch.get_num_threads(), cpu_cores=os.cpu_count(),
               torch_version=torch.__version__,
               measured_at=datetime.datetime.now().isoformat(timespec="seconds"))
    return row


def _use_cuda(cfg: StepConfig) -> bool:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda but no CUDA device is visible; accepted here: cpu, auto")
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def _threads(cfg: StepConfig, local_world: int) -> int:
    return cfg.threads or max(1, (os.cpu_count() or 1) // local_world)


def _spawned(rank: int, world: int, port: int, cfg: StepConfig, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(_threads(cfg, world))
    try:
        backend = "nccl" if _use_cuda(cfg) else "gloo"
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

    if _use_cuda(cfg):
        import torch

        if cfg.ranks > torch.cuda.device_count():
            raise InputError(f"--ranks {cfg.ranks} needs {cfg.ranks} GPUs (nccl: one rank per GPU); "
                             f"{torch.cuda.device_count()} visible. Use --device cpu for gloo ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if cfg.exact_memory and not _use_cuda(cfg):  # freed tensors leave the resident set at once
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
    torch.set_num_threads(_threads(cfg, local_world))
    backend = "nccl" if _use_cuda(cfg) else "gloo"
    dist.init_process_group(backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=min(cfg.timeout_s, 600.0)))
    try:
        return rank_main(cfg, rank, world, local_rank)
    finally:
        dist.destroy_process_group()


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


# ---- output --------------------------------------------------------------------------------------
def ratios(rows: list[dict]) -> dict[str, float]:
    """Side-by-side ratios of this run (same ranks, same model). Keys name the DMuon exchange mode only
    when several were run."""
    out = {}
    several = len({r["exchange"] for r in rows if r["strategy"] == "dmuon"}) > 1
    for d in (r for r in rows if r["strategy"] == "dmuon"):
        tag = ("overlap_on" if d["overlap"] else "overlap_off") + (f"_{d['exchange']}" if several else "")
        n = next((r for r in rows if r["strategy"] == "naive" and r["overlap"] == d["overlap"]), None)
        a = next((r for r in rows if r["strategy"] == "adamw" and r["overlap"] == d["overlap"]), None)
        if n:
            out[f"naive_over_dmuon_optimizer_s_{tag}"] = n["optimizer_s"] / d["optimizer_s"]
            out[f"naive_over_dmuon_optimizer_s_min_{tag}"] = n["optimizer_s_min"] / d["optimizer_s_min"]
            out[f"naive_over_dmuon_optimizer_cpu_s_{tag}"] = n["optimizer_cpu_s"] / d["optimizer_cpu_s"]
            out[f"naive_over_dmuon_step_s_{tag}"] = n["step_s"] / d["step_s"]
            out[f"dmuon_over_naive_comm_bytes_{tag}"] = d["comm_bytes_per_step"] / n["comm_bytes_per_step"]
            if d["layout"] == "fsdp2-owner":  # Muon-matrix bytes: DMuon's own vs naive's total less the
                adamw = d["fsdp_comm_bytes_per_step"]  # AdamW part FSDP2 moves in both
                naive_muon = n["comm_bytes_per_step"] - adamw
                own = d["opt_comm_bytes_per_step"]
                out[f"dmuon_over_naive_muon_comm_bytes_{tag}"] = own / naive_muon if naive_muon > 0 else 0.0
        if a:
            out[f"dmuon_over_adamw_step_s_{tag}"] = d["step_s"] / a["step_s"]
    for r in rows:
        if r["overlap"]:
            off = next((x for x in rows if (x["strategy"], x["exchange"], x["overlap"])
                        == (r["strategy"], r["exchange"], False)), None)
            if off and off["exposed_comm_s"] > 0:
                tag = f"_{r['exchange']}" if several and r["strategy"] == "dmuon" else ""
                key = f"{r['strategy']}{tag}_exposed_comm_on_over_off"
                out[key] = r["exposed_comm_s"] / off["exposed_comm_s"]
    return out


def append_csv(path: str, rows: list[dict]) -> None:
    """Append rows to a CSV (columns: union, existing order first), written atomically."""
    import pandas as pd

    from dmuon.io import atomic_path

    new = pd.DataFrame(rows)
    if os.path.exists(path):
        new = pd.concat([pd.read_csv(path), new], ignore_index=True)
    with atomic_path(path) as tmp:
        new.to_csv(tmp, index=False)


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    r0 = rows[0]
    t = Table(title=f"bench step: {r0['workload']} x{r0['width_scale']:g}, {r0['layers']} layers, seq "
                    f"{r0['seq_len']}, micro-batch {r0['micro_batch']}, {r0['ranks']} ranks "
                    f"({r0['backend']}, "
                    f"{r0['threads_per_rank']} threads/rank, {r0['cpu_cores']} cores); medians of "
                    f"{r0['steps']} steps")
    cols = ["strategy", "layout", "memory", "overlap", "exchange", "step ms", "fwd ms", "bwd ms", "opt ms",
            "exposed comm ms", "opt cpu ms", "comm MB/step", "opt state MB", "peak mem MB"]
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["strategy"], r["layout"], r["memory"], "on" if r["overlap"] else "off", r["exchange"],
                  *[f"{r[k] * 1e3:.1f}" for k in ("step_s", "forward_s", "backward_s", "optimizer_s",
                                                   "exposed_comm_s", "optimizer_cpu_s")],
                  f"{r['comm_bytes_per_step'] / 1e6:.2f}", f"{r['opt_state_bytes'] / 1e6:.2f}",
                  f"{r['peak_mem_bytes'] / 1e6:.0f}")
    console = Console(width=200)
    console.print(t)
    for k, v in ratios(rows).items():
        console.print(f"{k}: {v:.2f}")


def _split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def register(app, bench) -> None:
    import typer

    @bench.command("step")
    def step_cmd(
        ranks: int = typer.Option(2, help="Processes to spawn (ignored under torchrun: WORLD_SIZE)."),
        strategy: str = typer.Option("dmuon", help="dmuon | naive | adamw, or a comma-separated list run "
                                     "side by side in the same processes."),
        workload: str = typer.Option("qwen2.5-7b", help="Catalog name or .toml/.csv (decoder LLM)."),
        width_scale: str = typer.Option("1/16", help="Multiply every dimension (e.g. 1/16 or 0.0625)."),
        layers: int = typer.Option(4, help="Keep the first L blocks."),
        seq_len: int = typer.Option(128, help="Tokens per sequence."),
        micro_batch: int = typer.Option(2, help="Sequences per rank per step."),
        steps: int = typer.Option(8, help="Timed steps per variant (medians reported)."),
        warmup: int = typer.Option(2, help="Untimed steps at the start of every block."),
        rounds: int = typer.Option(2, help="Alternate the variants' blocks this many times."),
        phase_barrier: bool = typer.Option(True, help="Align ranks (untimed barrier) between backward and "
                                           "step() (see docs)."),
        balancer: str = typer.Option("lpt", help="lpt | round_robin | milp (DMuon owners)."),
        exchange: str = typer.Option("auto", help="auto | reduce_scatter | reduce (DMuon exchange), or a "
                                     "comma-separated list (one DMuon variant each)."),
        node_size: int = typer.Option(None, help="Ranks per node: two-level exchange."),
        profile: str = typer.Option(None, help="Cost table for the plan (default: this device's)."),
        no_overlap: bool = typer.Option(False, "--no-overlap", help="Exchange at step() only."),
        overlap: str = typer.Option(None, help="on | off | both (both: each strategy twice)."),
        device: str = typer.Option("auto", help="auto | cpu | cuda."),
        threads: int = typer.Option(0, help="torch threads per rank (0: cores // ranks)."),
        seed: int = typer.Option(0),
        timeout_s: float = typer.Option(1800.0, help="Kill the run after this many seconds."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON (one object, or rows + ratios)."),
        csv: str = typer.Option(None, help="Append the rows to this CSV (atomic rewrite)."),
        profile_trace: str = typer.Option(None, help="Write torch.profiler Chrome traces to this folder."),
        layout: str = typer.Option("ddp", help="ddp | fsdp2-owner | fsdp2-sharded (see docs/fsdp.md)."),
        memory: str = typer.Option("keep", help="keep | free: FSDP2 reshard_after_forward False / True "
                                   "and DMuon's memory mode (fsdp2-owner)."),
        exact_memory: bool = typer.Option(False, "--exact-memory", help="CPU: return freed tensors to the OS "
                                          "at once (tighter peak_mem_bytes, ~2x slower allocation; see "
                                          "docs)."),
        speed_probe: bool = typer.Option(False, "--speed-probe", help="Time the model's forward + backward "
                                         "one NS call and one AdamW pass before each block (columns probe_s, "
                                         "probe_ns_s, probe_ew_s: the machine's speed then)."),
    ):
        """Measure training steps of DMuon / NaiveMuon / AdamW on N real processes (see docs/runtime.md)."""
        cfg = StepConfig(ranks=ranks, strategies=_split(strategy),
                         overlap=overlap or ("off" if no_overlap else "on"), workload=workload,
                         width_scale=parse_scale(width_scale), layers=layers, seq_len=seq_len,
                         micro_batch=micro_batch, steps=steps, warmup=warmup, rounds=rounds,
                         phase_barrier=phase_barrier, balancer=balancer, exchanges=_split(exchange),
                         node_size=node_size, profile=profile, device=device, threads=threads, seed=seed,
                         timeout_s=timeout_s, profile_trace=profile_trace, layout=layout, memory=memory,
                         exact_memory=exact_memory, speed_probe=speed_probe)
        if under_torchrun():
            cfg.ranks = int(os.environ["WORLD_SIZE"])
            check_config(cfg)
            rows = run_torchrun(cfg)
            if rows is None:
                return
        else:
            check_config(cfg)
            rows = launch(cfg)
        if csv:
            append_csv(csv, rows)
        if json_out:
            print(json.dumps(rows[0] if len(rows) == 1 else {"rows": rows, "ratios": ratios(rows)}, indent=1))
        else:
            print_table(rows)


__all__ = ["StepConfig", "aggregate", "asdict", "launch", "ratios", "register"]
