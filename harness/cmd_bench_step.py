"""`harness bench step`: real training steps of DMuon, NaiveMuon and replicated AdamW on N processes.

Spawns N ranks (gloo on the CPU, nccl on CUDA) -- or runs as one rank under torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK set) -- builds `simulator.benchmodel` for the workload (or, with
--model, a Hugging Face causal LM from a config.json with transformers, shrunk by --layers / --hidden /
--vocab as harness.hf_model says; trained with labels = input_ids and the model's own loss), and trains
every requested variant (strategy x overlap) in turn on seeded synthetic data, in the same processes.
With --model the rows also hold model_config, model_type, hidden and vocab; workload is the model's
name and width_scale its hidden size over the config's.
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
  optimizer_runq_s time the compute thread was runnable inside step() but waited for a CPU (Linux
                  schedstat; NaN elsewhere): the oversubscription the wall time contains
  optimizer_ns_s  the compute thread's time inside NS calls during step() (`CommStats.ns_s`), and
  optimizer_ns_cpu_s the compute thread's CPU time inside those NS calls (`CommStats.ns_cpu_s`; on a CPU
                  their compute whatever else shares the cores; on CUDA their launch cost)
  optimizer_wait_s its waits for communication inside step(); optimizer_over_ns_comm = optimizer_s /
                  (the two) on the slowest rank: 1.0 means the step is nothing but NS and collectives
--ns-method / --ns-dtype (comma lists: one variant each, for dmuon and naive) set NSConfig; --comm-dtype
the dtype gradients travel in. Ratios ns_<a>_over_<b>_* compare one variant's NS time in two dtypes.

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

The command's parts: harness.bench_step_config (StepConfig, the checks before any process starts),
harness.bench_step_rank (what each rank runs and measures), harness.bench_step_launch (spawned ranks or
torchrun); this module prints and stores the rows.
"""

from __future__ import annotations

import json
import math
import os

from .bench_step_config import StepConfig, check_config, parse_scale
from .bench_step_launch import launch, run_torchrun, under_torchrun


def _ns_key(r: dict) -> tuple[str, str]:
    return r.get("ns_method", "auto"), r.get("ns_dtype", "default")


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def ratios(rows: list[dict]) -> dict[str, float]:
    """Side-by-side ratios of this run (same ranks, same model). Keys name the DMuon exchange mode and
    the NS method / dtype only when several were run; naive is compared at the same NS settings.
    ns_<d1>_over_<d2>_...: the same strategy's NS time (optimizer_ns_s), NS CPU time (optimizer_ns_cpu_s)
    and optimizer time in two NS dtypes. A ratio whose denominator is 0 (e.g. bytes at 1 rank) is NaN."""
    out = {}
    several = len({r["exchange"] for r in rows if r["strategy"] == "dmuon"}) > 1
    several_ns = len({_ns_key(r) for r in rows if r["strategy"] != "adamw"}) > 1
    splits = sorted({r.get("max_split", 1) for r in rows if r["strategy"] == "dmuon"})
    for d in (r for r in rows if r["strategy"] == "dmuon"):
        tag = ("overlap_on" if d["overlap"] else "overlap_off") + (f"_{d['exchange']}" if several else "")
        if several_ns:
            tag += "_ns_{}_{}".format(*_ns_key(d))
        if len(splits) > 1:
            tag += f"_split{d.get('max_split', 1)}"
            base = next((r for r in rows if r["strategy"] == "dmuon" and r.get("max_split", 1) == splits[0]
                         and (r["overlap"], r["exchange"], _ns_key(r)) == (d["overlap"], d["exchange"],
                                                                         _ns_key(d))), None)
            if base is not None and base is not d:
                pre = f"split{d['max_split']}_over_split{splits[0]}"
                out[f"{pre}_optimizer_s_{tag}"] = _div(base["optimizer_s"], d["optimizer_s"])
                out[f"{pre}_optimizer_s_min_{tag}"] = _div(base["optimizer_s_min"], d["optimizer_s_min"])
                out[f"{pre}_step_s_{tag}"] = _div(base["step_s"], d["step_s"])
                out[f"{pre}_optimizer_cpu_s_{tag}"] = _div(base["optimizer_cpu_s"], d["optimizer_cpu_s"])
                out[f"{pre}_optimizer_s_less_runq_{tag}"] = _div(
                    base["optimizer_s"] - base.get("optimizer_runq_s", math.nan),
                    d["optimizer_s"] - d.get("optimizer_runq_s", math.nan))
        n = next((r for r in rows if r["strategy"] == "naive" and r["overlap"] == d["overlap"]
                  and _ns_key(r) == _ns_key(d)), None)
        a = next((r for r in rows if r["strategy"] == "adamw" and r["overlap"] == d["overlap"]), None)
        if "optimizer_over_ns_comm" in d:
            out[f"dmuon_optimizer_over_ns_comm_{tag}"] = d["optimizer_over_ns_comm"]
        if n:
            out[f"naive_over_dmuon_optimizer_s_{tag}"] = n["optimizer_s"] / d["optimizer_s"]
            out[f"naive_over_dmuon_optimizer_s_min_{tag}"] = n["optimizer_s_min"] / d["optimizer_s_min"]
            out[f"naive_over_dmuon_optimizer_cpu_s_{tag}"] = n["optimizer_cpu_s"] / d["optimizer_cpu_s"]
            out[f"naive_over_dmuon_step_s_{tag}"] = n["step_s"] / d["step_s"]
            out[f"dmuon_over_naive_comm_bytes_{tag}"] = _div(d["comm_bytes_per_step"],
                                                             n["comm_bytes_per_step"])
            if d["layout"] == "fsdp2-owner":  # Muon-matrix bytes: DMuon's own vs naive's total less the
                adamw = d["fsdp_comm_bytes_per_step"]  # AdamW part FSDP2 moves in both
                naive_muon = n["comm_bytes_per_step"] - adamw
                own = d["opt_comm_bytes_per_step"]
                out[f"dmuon_over_naive_muon_comm_bytes_{tag}"] = own / naive_muon if naive_muon > 0 else 0.0
        if a:
            out[f"dmuon_over_adamw_step_s_{tag}"] = d["step_s"] / a["step_s"]
    dtypes = sorted({r.get("ns_dtype", "default") for r in rows if r["strategy"] != "adamw"})
    for r in rows:  # NS dtypes side by side: the same variant in each pair of dtypes
        for other in dtypes:
            if r["strategy"] == "adamw" or other == r.get("ns_dtype") or other < r.get("ns_dtype", ""):
                continue
            o = next((x for x in rows if x["strategy"] == r["strategy"] and x["overlap"] == r["overlap"]
                      and x["exchange"] == r["exchange"] and x.get("ns_method") == r.get("ns_method")
                      and x.get("ns_dtype") == other), None)
            if o is not None:
                tag = f"{r['strategy']}_{r.get('ns_method', 'auto')}"
                pair = f"{other}_over_{r['ns_dtype']}"
                out[f"ns_{pair}_ns_s_{tag}"] = _div(o["optimizer_ns_s"], r["optimizer_ns_s"])
                out[f"ns_{pair}_ns_cpu_s_{tag}"] = _div(o.get("optimizer_ns_cpu_s", math.nan),
                                                        r.get("optimizer_ns_cpu_s", math.nan))
                out[f"ns_{pair}_optimizer_s_{tag}"] = _div(o["optimizer_s"], r["optimizer_s"])
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


def add_modelled_memory(rows: list[dict], cfg: StepConfig) -> None:
    """model_peak_mem_bytes / model_peak_mem_error beside each CPU row's measured peak
    (harness.validation_memory.modelled_peak: simulator.memory of the same run; not for --wide-matrix)."""
    if cfg.wide is not None:
        return
    from .validation_memory import modelled_peak

    workload = None
    if cfg.model_raw is None:
        from simulator.workload import load_workload

        workload = load_workload(cfg.workload).scaled(cfg.width_scale, blocks=cfg.layers)
    for r in rows:
        r.update(modelled_peak(r, cfg.model_raw, workload))


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    r0 = rows[0]
    what = (f"{r0['workload']} x{r0['width_scale']:g}" if not r0.get("model_config") else
            f"{r0['workload']} ({r0['model_type']}, hidden {r0['hidden']}, vocab {r0['vocab']}, "
            f"{r0['n_params'] / 1e6:.2f}M parameters)")
    t = Table(title=f"bench step: {what}, {r0['layers']} layers, seq "
                    f"{r0['seq_len']}, micro-batch {r0['micro_batch']}, {r0['ranks']} ranks "
                    f"({r0['backend']}, "
                    f"{r0['threads_per_rank']} threads/rank, {r0['cpu_cores']} cores); medians of "
                    f"{r0['steps']} steps")
    cols = ["strategy", "layout", "memory", "overlap", "exchange", "ns", "split", "step ms", "fwd ms",
            "bwd ms", "opt ms", "opt NS ms", "opt wait ms", "exposed comm ms", "opt cpu ms", "opt runq ms",
            "comm MB/step",
            "opt state MB", "peak mem MB", "model mem MB"]
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        ns = "-" if r["strategy"] == "adamw" else "{} {}".format(*_ns_key(r))
        split = f"{r.get('max_split', 1)} ({r.get('split_batches', 0)})" if r["strategy"] == "dmuon" else "-"
        t.add_row(r["strategy"], r["layout"], r["memory"], "on" if r["overlap"] else "off", r["exchange"], ns,
                  split,
                  *[f"{r[k] * 1e3:.1f}" for k in ("step_s", "forward_s", "backward_s", "optimizer_s",
                                                   "optimizer_ns_s", "optimizer_wait_s", "exposed_comm_s",
                                                   "optimizer_cpu_s")],
                  f"{r.get('optimizer_runq_s', math.nan) * 1e3:.1f}",
                  f"{r['comm_bytes_per_step'] / 1e6:.2f}", f"{r['opt_state_bytes'] / 1e6:.2f}",
                  f"{r['peak_mem_bytes'] / 1e6:.0f}", f"{r.get('model_peak_mem_bytes', math.nan) / 1e6:.0f}")
    console = Console(width=200)
    console.print(t)
    for k, v in ratios(rows).items():
        console.print(f"{k}: {v:.2f}")


def _split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _ints(option: str, text: str) -> tuple[int, ...]:
    from dmuon.errors import InputError

    try:
        return tuple(int(x) for x in _split(text))
    except ValueError:
        raise InputError(f"{option} takes integers, comma-separated (e.g. 1,2), got {text!r}") from None


def _shape(text: str | None) -> tuple[int, int] | None:
    from dmuon.errors import InputError

    if text is None:
        return None
    parts = text.lower().split("x")
    try:
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise InputError(f"--wide-matrix takes ROWSxCOLS, e.g. 512x4096, got {text!r}")


def register(app, bench) -> None:
    import typer

    from .options import option_command

    # the workload calls --layers blocks
    @bench.command("step", cls=option_command(blocks="layers"))
    def step_cmd(
        ranks: int = typer.Option(2, help="Processes to spawn (ignored under torchrun: WORLD_SIZE)."),
        strategy: str = typer.Option("dmuon", help="dmuon | naive | adamw, or a comma-separated list run "
                                     "side by side in the same processes."),
        workload: str = typer.Option(None, help="Catalog name or .toml/.csv (decoder LLM) of the bench "
                                     "model (default: qwen2.5-7b)."),
        width_scale: str = typer.Option(None, help="Multiply every dimension of the bench model (e.g. 1/16 "
                                        "or 0.0625) (default: 1/16)."),
        layers: int = typer.Option(None, help="Keep the first L blocks (default: 4); with --model: "
                                   "num_hidden_layers = L, default the config's; DeepSeek's "
                                   "first_k_dense_replace capped at L-1, num_nextn_predict_layers, "
                                   "max_window_layers, mlp_only_layers and layer_types cut to L."),
        model: str = typer.Option(None, help="A Hugging Face config.json (or a folder holding one, or a "
                                  "model in experiments/models/) built with transformers (pip install "
                                  "transformers; nothing downloaded) instead of the bench model; trained "
                                  "on random tokens, labels = input_ids, the model's own loss."),
        hidden: int = typer.Option(None, help="With --model: hidden_size = H; intermediate sizes (dense, "
                                   "MoE, shared expert: to a multiple of 8) and MLA ranks scaled by H / "
                                   "hidden_size; head counts and expert counts kept; head_dim = H / "
                                   "num_attention_heads (H a multiple of 2 x heads) or, where the config "
                                   "sets head_dim / MLA head dims, those scaled by H / hidden_size too (to "
                                   "even numbers) (default: the config's)."),
        vocab: int = typer.Option(None, help="With --model: vocab_size = V (a smaller embedding and head; "
                                  "token ids outside it dropped) (default: the config's)."),
        seq_len: int = typer.Option(128, help="Tokens per sequence."),
        micro_batch: int = typer.Option(2, help="Sequences per rank per step."),
        steps: int = typer.Option(8, help="Timed steps per variant (medians reported)."),
        warmup: int = typer.Option(2, help="Untimed steps at the start of every block."),
        rounds: int = typer.Option(2, help="Alternate the variants' blocks this many times."),
        phase_barrier: bool = typer.Option(True, help="Align ranks (untimed barrier) between backward and "
                                           "step() (see docs)."),
        rank_sessions: bool = typer.Option(False, "--rank-sessions/--shared-session", help="Spawned ranks: "
                                           "each in a session of its own (the scheduler's autogroup; see "
                                           "docs) or all in this one (default)."),
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
        ns_method: str = typer.Option("auto", help="auto | standard | gram (NSConfig.method of dmuon and "
                                      "naive), or a comma-separated list (one variant each)."),
        ns_dtype: str = typer.Option("default", help="default | bf16 | fp16 | fp32 (NSConfig.dtype; default: "
                                     "fp32 on CPU, bf16/fp16 on CUDA), or a comma-separated list."),
        comm_dtype: str = typer.Option(None, help="bf16 | fp16 | fp32: the dtype gradients (and the sharded "
                                       "layout's all-to-alls) travel in (default: the parameters')."),
        max_split: str = typer.Option("1", help="DMuon max_split (owner groups that split one matrix's NS "
                                      "over up to K ranks; 1: none), or a comma-separated list (one DMuon "
                                      "variant each: ratio split<K>_over_split1_optimizer_s)."),
        wide_matrix: str = typer.Option(None, help="ROWSxCOLS: add one Muon matrix of that shape to the "
                                        "bench model (e.g. 512x4096: one dominant matrix next to small "
                                        "ones)."),
        speed_probe: bool = typer.Option(False, "--speed-probe", help="Time the model's forward + backward "
                                         "one NS call and one AdamW pass before each block (columns probe_s, "
                                         "probe_ns_s, probe_ew_s: the machine's speed then)."),
    ):
        """Measure training steps of DMuon / NaiveMuon / AdamW on N real processes (see docs/runtime.md), on
        the bench model or (--model) a Hugging Face model built from its config.json."""
        if model is not None and (workload is not None or width_scale is not None):
            from dmuon.errors import InputError

            raise InputError("--model replaces the bench model: drop --workload / --width-scale (shrink the "
                             "model with --layers, --hidden, --vocab)")
        cfg = StepConfig(ranks=ranks, strategies=_split(strategy),
                         overlap=overlap or ("off" if no_overlap else "on"),
                         workload=workload or "qwen2.5-7b",
                         width_scale=parse_scale(width_scale or "1/16"),
                         layers=layers if layers is not None or model is not None else 4, seq_len=seq_len,
                         micro_batch=micro_batch, steps=steps, warmup=warmup, rounds=rounds,
                         phase_barrier=phase_barrier, rank_sessions=rank_sessions, balancer=balancer,
                         exchanges=_split(exchange),
                         node_size=node_size, profile=profile, device=device, threads=threads, seed=seed,
                         timeout_s=timeout_s, profile_trace=profile_trace, layout=layout, memory=memory,
                         exact_memory=exact_memory, speed_probe=speed_probe, ns_methods=_split(ns_method),
                         ns_dtypes=_split(ns_dtype), comm_dtype=comm_dtype,
                         max_splits=_ints("--max-split", max_split), wide=_shape(wide_matrix), model=model,
                         hidden=hidden, vocab=vocab)
        if under_torchrun():
            cfg.ranks, cfg.rank_sessions = int(os.environ["WORLD_SIZE"]), False  # torchrun starts the ranks
            check_config(cfg)
            rows = run_torchrun(cfg)
            if rows is None:
                return
        else:
            check_config(cfg)
            rows = launch(cfg)
        add_modelled_memory(rows, cfg)
        if csv:
            append_csv(csv, rows)
        if json_out:
            print(json.dumps(rows[0] if len(rows) == 1 else {"rows": rows, "ratios": ratios(rows)}, indent=1))
        else:
            print_table(rows)


__all__ = ["append_csv", "print_table", "ratios", "register"]
