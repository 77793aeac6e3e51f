"""What one rank of `harness bench step` does: train every variant in blocks on the bench model
(simulator.models.benchmodel), time each phase on its compute thread, count the bytes of one extra step, probe
the machine's speed (--speed-probe), and aggregate the ranks' records into rows (rank 0).
The measured quantities are defined in harness/cmd_bench_step.py's docstring.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import time
from dataclasses import replace

from .bench_step_config import METRICS, StepConfig, use_cuda


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _runq_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (the run queue) since it started:
    /proc/thread-self/schedstat's second field (Linux with schedstats); NaN where it cannot be read."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return math.nan


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


def _count_step(cfg: StepConfig, built: Built, opt, rank: int, device, it: int) -> dict:
    """One more (untimed) iteration with every collective counted (see the module docstring)."""
    from dmuon.runtime.bytecount import CollectiveBytes
    from simulator.models.benchmodel import synthetic_batch

    counter = CollectiveBytes()
    workers = [w for w in (opt._worker, getattr(opt, "_pub_worker", None)) if w is not None]
    opt.synchronize_exchanges()
    for w in workers:
        w.counter = counter
    x, y = synthetic_batch(built.vocab, cfg.seq_len, cfg.micro_batch, seed=cfg.seed, step=it, rank=rank,
                           device=device)
    try:
        with counter.active():
            built.loss(x, y).backward()
            opt.step()
            opt.synchronize_exchanges()
    finally:
        for w in workers:
            w.counter = None
    opt.zero_grad(set_to_none=True)
    own = counter.bytes(label="dmuon") + counter.bytes(label="optimizer")
    return dict(comm_bytes_per_step=counter.bytes(), opt_comm_bytes_per_step=own,
                fsdp_comm_bytes_per_step=counter.bytes(label="main"))


class Built:
    """The model a block trains: the bench model (simulator.models.benchmodel, forward(tokens, targets) -> loss)
    or a Hugging Face causal LM (--model: harness.hf_model, labels = input_ids, its output's .loss)."""

    def __init__(self, cfg: StepConfig, device, dtype):
        if cfg.model_raw is not None:
            from .hf_model import build_model, vocab_size

            self.workload = None
            self.model = build_model(cfg.model_raw, seed=cfg.seed, device=device, dtype=dtype)
            self.vocab = vocab_size(cfg.model_raw)
        else:
            from simulator.models.benchmodel import build_bench_model
            from simulator.models.workload import load_workload

            self.workload = load_workload(cfg.workload).scaled(cfg.width_scale, blocks=cfg.layers)
            self.model = build_bench_model(self.workload, seed=cfg.seed, device=device, dtype=dtype,
                                           wide=cfg.wide)
            self.vocab = self.model.vocab
        self.hf = cfg.model_raw is not None

    def loss(self, tokens, targets):
        if self.hf:
            from .hf_model import causal_lm_loss

            return causal_lm_loss(self.model, tokens)
        return self.model(tokens, targets)


PROBE_REPEATS = 3


def _speed_probe(model, workload, cfg: StepConfig, device) -> tuple[float, float, float]:
    """--speed-probe: the machine's speed right now, on every rank at once: median seconds of
    PROBE_REPEATS forward + backward passes of the freshly built model (after one untimed), before the
    optimizer exists (no hooks, no communication; compared with the profile's compute model for this
    model, simulator.validation.validate.speed_scale_of), of PROBE_REPEATS calls of the NS the runtime makes that
    `simulator.validation.validate.ns_probe_call` names, and of PROBE_REPEATS AdamW passes over
    simulator.validation.validate.EW_PROBE_NUMEL elements (the last two: what the cost table prices)."""
    import torch
    import torch.distributed as dist

    from dmuon import orthogonalize
    from dmuon.plan.profile import elementwise_calls
    from simulator.models.benchmodel import synthetic_batch
    from simulator.validation.validate import EW_PROBE_NUMEL, EW_PROBE_OP, ns_probe_call

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


def run_variant(cfg: StepConfig, variant: tuple, rank: int, world: int, device, timed: int,
                tag: str = "") -> list[dict]:
    """Train one block of a variant on this rank; per-iteration records of its `timed` steps."""
    import torch
    import torch.distributed as dist

    from simulator.models.benchmodel import bench_optimizer, synthetic_batch

    strategy, overlap, exchange, ns_method, ns_dtype, max_split = variant
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    _trim_heap()
    base_rss = _rss_bytes()
    _reset_peak_rss()
    built = Built(cfg, device, dtype)
    model = built.model
    probe_s, probe_ns_s, probe_ew_s = (_speed_probe(model, built.workload, cfg, device) if cfg.speed_probe
                                       else (float("nan"),) * 3)
    opt = bench_optimizer(strategy, model, overlap=overlap, exchange=exchange, layout=cfg.layout,
                          memory=cfg.memory, node_size=cfg.node_size, timeout_s=min(cfg.timeout_s, 600.0),
                          balancer=cfg.balancer, profile=cfg.profile, ns=cfg.ns_config(ns_method, ns_dtype),
                          comm_dtype=cfg.comm_dtype, max_split=max_split)
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
        x, y = synthetic_batch(built.vocab, cfg.seq_len, cfg.micro_batch, seed=cfg.seed, step=it, rank=rank,
                               device=device)
        opt.comm_stats.reset()
        t0 = now()
        loss = built.loss(x, y)
        t1 = now()
        loss.backward()
        t2 = now()
        skew = align()
        t2 += skew
        c2, q2 = time.thread_time(), _runq_s()
        w2 = opt.comm_stats.wait_s
        opt.step()
        c3, q3 = time.thread_time(), _runq_s()
        t3 = now()
        w3 = opt.comm_stats.wait_s
        opt.zero_grad(set_to_none=True)
        t4 = now()
        if it >= cfg.warmup:
            records.append(dict(step_s=t4 - t0 - skew, forward_s=t1 - t0, backward_s=t2 - skew - t1,
                                optimizer_s=t3 - t2,
                                exposed_comm_s=opt.comm_stats.wait_s, optimizer_cpu_s=c3 - c2,
                                optimizer_ns_s=opt.comm_stats.ns_s, optimizer_wait_s=w3 - w2,
                                optimizer_ns_cpu_s=opt.comm_stats.ns_cpu_s,
                                optimizer_runq_s=q3 - q2,
                                ns_calls=opt.comm_stats.ns_calls,
                                peak_mem_bytes=(torch.cuda.max_memory_allocated(device) if cuda
                                                else _peak_rss() - base_rss),
                                loss=float(loss.detach()), load_1m=os.getloadavg()[0], probe_s=probe_s,
                                probe_ns_s=probe_ns_s, probe_ew_s=probe_ew_s))
    counted = _count_step(cfg, built, opt, rank, device, cfg.warmup + timed)
    for r in records:
        r.update(counted)
    if prof is not None:
        prof.__exit__(None, None, None)
        os.makedirs(cfg.profile_trace, exist_ok=True)
        name = (f"{strategy}-overlap_{'on' if overlap else 'off'}-{exchange}-ns_{ns_method}_{ns_dtype}"
                f"-split{max_split}{tag}-rank{rank}.json")
        prof.export_chrome_trace(os.path.join(cfg.profile_trace, name))
    opt.synchronize()
    info = dict(opt_state_bytes=opt.state_bytes,
                exchange_buffer_bytes=sum(u.buffer_bytes() * (2 if hasattr(u, "launch_publish") else 1)
                                          for u in opt.units),
                n_params=sum(p.numel() for p in model.parameters()),
                n_muon_params=sum(opt.params[i].numel() for i in range(opt.n_muon)),
                plan_makespan_s=opt.plan.makespan_s if opt.plan is not None else 0.0,
                plan_cost_source=opt.plan.cost_source if opt.plan is not None else "",
                split_batches=len(opt.plan.split_batches) if opt.plan is not None else 0,
                split_groups=" ".join("-".join(map(str, b.group)) for b in opt.plan.split_batches)
                if opt.plan is not None else "")
    opt.close()
    del model, opt, built
    for r in records:
        r.update(info)
    return records


def rank_main(cfg: StepConfig, rank: int, world: int, local_rank: int) -> list[dict] | None:
    """Run every variant on this (initialized) rank; rank 0 returns the aggregated rows."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", local_rank) if use_cuda(cfg) else torch.device("cpu")
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


def _model_columns(cfg: StepConfig) -> dict:
    """--model: the model's name (in workload, as `harness simulate --model` names it), its config.json,
    type, size and the hidden size over the config's (width_scale); the bench model: no extra columns."""
    if cfg.model_raw is None:
        return {}
    from .hf_model import read_config

    raw = cfg.model_raw
    _, original = read_config(cfg.model_path)
    hidden = raw.get("hidden_size", raw.get("n_embd"))
    return dict(workload=cfg.model_name, model_config=cfg.model_path, model_type=raw["model_type"],
                width_scale=hidden / original.get("hidden_size", original.get("n_embd", hidden)),
                layers=raw.get("num_hidden_layers", raw.get("n_layer")), hidden=hidden,
                vocab=raw["vocab_size"])


def aggregate(cfg: StepConfig, variant: tuple, per_rank: list[list[dict]],
              world: int, device) -> dict:
    """Max over ranks per step, then the median over steps. optimizer_over_ns_comm: per step, on the
    rank whose step() took longest, optimizer_s over its NS calls + its communication waits inside
    step() (1.0: nothing else; the excess is the optimizer's own overhead), median over steps."""
    import torch

    steps = len(per_rank[0])
    strategy, overlap, exchange, ns_method, ns_dtype, max_split = variant
    row = dict(ranks=world, strategy=strategy, overlap=overlap, exchange=exchange, layout=cfg.layout,
               memory=cfg.memory, ns_method=ns_method, ns_dtype=ns_dtype, comm_dtype=cfg.comm_dtype or "",
               max_split=max_split, wide_matrix="x".join(map(str, cfg.wide)) if cfg.wide else "")
    for key in ("optimizer_ns_s", "optimizer_wait_s", "ns_calls", "optimizer_runq_s", "optimizer_ns_cpu_s"):
        row[key] = statistics.median(max(r[i].get(key, math.nan) for r in per_rank) for i in range(steps))
    accounted = []
    for i in range(steps):
        slow = max(per_rank, key=lambda r, i=i: r[i]["optimizer_s"])[i]
        inside = slow["optimizer_ns_s"] + slow["optimizer_wait_s"]
        accounted.append(slow["optimizer_s"] / inside if inside > 0 else math.nan)
    row["optimizer_over_ns_comm"] = statistics.median(accounted)
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
               split_batches=first["split_batches"], split_groups=first["split_groups"],
               final_loss=per_rank[0][-1]["loss"], workload=cfg.workload, width_scale=cfg.width_scale,
               layers=cfg.layers, seq_len=cfg.seq_len, micro_batch=cfg.micro_batch, steps=cfg.steps,
               warmup=cfg.warmup, rounds=cfg.rounds, phase_barrier=cfg.phase_barrier, balancer=cfg.balancer,
               rank_sessions=cfg.rank_sessions,
               node_size=cfg.node_size,
               exact_memory=device.type == "cpu" and bool(os.environ.get("MALLOC_MMAP_THRESHOLD_")),
               device=str(device.type), backend="nccl" if device.type == "cuda" else "gloo",
               threads_per_rank=torch.get_num_threads(), cpu_cores=os.cpu_count(),
               torch_version=torch.__version__,
               measured_at=datetime.datetime.now().isoformat(timespec="seconds"))
    row.update(_model_columns(cfg))
    return row


__all__ = ["PROBE_REPEATS", "aggregate", "rank_main", "run_variant"]
