"""`simulate(SimConfig) -> SimResult`: one simulated training step, and what each output means.

Outputs (seconds; the simulation runs 2 steps and reports the second, in steady state; with `jitter`, 1 +
jitter_steps steps and the median of the sampled steps, its p90 in step_p90_s):
  step_s          iteration time: end of the previous optimizer step to the end of this one
                  (= forward_s + backward_s + optimizer_s)
  forward_s       step start to the end of the last forward compute (publication / all-gather waits
                  included: they are exposed communication of the forward pass)
  backward_s      end of forward compute to the end of backward compute
  optimizer_s     end of backward compute to the point the optimizer has finished on every rank,
                  including the exposed communication that belongs to it (gradient-reduction tail,
                  naive's all-gathers, dmuon's bucket exchange; dmuon's publication only when
                  overlap is off)
  grad_sync_tail_s  part of optimizer_s spent waiting for the gradient reductions issued in backward
                  (FSDP2's backward() returns only after them: the published tables count it in backward)
  exposed_comm_s  time the compute stream waited on communication during the step (max over ranks;
                  exposed_comm_mean_s: mean over ranks)
Times are maxima over ranks (the step ends when the slowest rank ends).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields

from dmuon.errors import InputError, choice_error

from .costs import load_cost, thread_cost_for
from simulator.programs.step import DTYPE_BYTES, LAYOUTS, STRATEGIES
from simulator.programs.step_split import SPLIT_EXCHANGES

BALANCERS = ("round_robin", "lpt", "milp")
NS_METHODS = ("standard", "standard_sym", "gram", "gram_sym", "auto")


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class SimConfig:
    """One simulated configuration. Every field has help text in its metadata (`SimConfig.help()`)."""

    workload: object = _f("qwen2.5-7b", "catalog name, a .toml / .csv path, or a simulator.models.workload.Workload")
    gpus: int = _f(8, "data-parallel ranks (GPUs, or processes on a CPU)")
    gpus_per_node: int | None = _f(None, "ranks per node (None: the profile's node size); gpus must be "
                                         "<= it (one node) or a multiple of it")
    gpu: object = _f("a800", "hardware profile: a name in simulator/profiles/ (simulator.fabric.hardware.profile_names()), a "
                             ".toml path, or a simulator.fabric.hardware.Profile; with `cluster`, anything but the "
                             "default 'a800' replaces the cluster file's GPU profile")
    model: str | None = _f(None, "a Hugging Face config.json (path, folder holding one, or a model in "
                                 "experiments/models/); replaces `workload` (simulator.models.hf_config)")
    per_head: bool = _f(False, "with `model`: q / k / v / o cut into one matrix per attention head, as "
                               "DMuon(model, per_head=True) runs them (dmuon.params.decide)")
    cluster: str | None = _f(None, "a cluster file (experiments/clusters/<name> or a .toml path: GPU "
                                   "profile, GPUs per node, NVLink, NICs, rails); gpus_per_node, nic_gbps "
                                   "and overlap_slowdown, where set, override it (simulator.fabric.cluster_file)")
    strategy: str = _f("dmuon", "adamw | naive | dmuon")
    layout: str = _f("fsdp-keep", "fsdp-keep | fsdp-free | hsdp-keep | hsdp-free | ddp | sharded")
    seq_len: int = _f(2048, "tokens per sequence")
    micro_batch: int = _f(2, "sequences per GPU per step")
    gram: bool = _f(True, "dmuon: Gram Newton-Schulz (False: standard NS)")
    symmetric_kernels: bool | None = _f(None, "dmuon: symmetric (SYRK-style) products (None: where the "
                                              "profile's device has them: GPUs yes, CPU no)")
    batching: bool = _f(True, "dmuon: batch same-shape matrices on an owner")
    balancer: str = _f("lpt", "dmuon owner balancer: round_robin | lpt | milp")
    overlap: bool = _f(True, "dmuon: overlap publication with the next forward (per-layer wait)")
    hierarchical: bool = _f(True, "dmuon's owner exchange two-level across nodes, as the runtime with "
                                  "node_size / an HSDP mesh (False: flat over all ranks); NCCL-native "
                                  "collectives (FSDP's, naive's, all-reduces) run as NCCL picks either way")
    nic_gbps: float | None = _f(None, "inter-node NIC bandwidth per node, Gbit/s per direction "
                                      "(None: profile)")
    overlap_slowdown: float | None = _f(None, "compute slowdown while communication overlaps it, e.g. 0.1 "
                                              "(None: profile)")
    ns_method: str | None = _f(None, "override the dmuon NS method (else from gram / symmetric_kernels): "
                                     + " | ".join(NS_METHODS))
    naive_ns_method: str = _f("standard", "naive: the NS method every rank runs (standard = the published "
                                          "baseline; gram_sym etc. for ablations; auto = per shape the "
                                          "cheapest the device runs, as dmuon's method='auto'): "
                                          + " | ".join(NS_METHODS))
    ns_dtype: str | None = _f(None, "NS iteration dtype the plan is priced in: bf16 | fp16 | fp32 "
                                    "(None: the profile's dtype)")
    param_comm_dtype: str | None = _f(None, "dtype of parameter all-gathers / publications: bf16 | fp16 | "
                                            "fp32 (None: the profile's dtype)")
    grad_comm_dtype: str | None = _f(None, "dtype of gradient reductions and exchanges: bf16 | fp16 | fp32 "
                                           "(None: the profile's dtype)")
    cpu_threads: int = _f(1, "CPU profiles: torch threads per rank (ranks x threads share the profile's "
                             "cores); NS and elementwise passes are priced from the cost table measured at "
                             "that many threads (<name>-t<threads>) where one exists")
    speed_scale: float = _f(1.0, "every compute, NS and elementwise time (and, on CPU profiles, every "
                                 "collective: CPU work there) x this: a device slower (> 1) or faster than "
                                 "when its profile was measured (harness validate: the speed probe's drift)")
    ns_speed_scale: float | None = _f(None, "every NS time x this instead of speed_scale (None: "
                                            "speed_scale); harness validate: the NS probe's drift against "
                                            "the cost table")
    elementwise_speed_scale: float | None = _f(None, "every elementwise pass and the per-step optimizer "
                                                     "overhead x this instead of speed_scale (None: "
                                                     "speed_scale); harness validate: the AdamW-pass probe's "
                                                     "drift against the cost table")
    naive_batching: bool = _f(False, "naive: one batched NS call per matrix shape, as dmuon.NaiveMuon runs "
                                     "it (False: one call per matrix, the published FSDP2+Muon baseline)")
    max_batch: int = _f(8, "dmuon: largest NS batch")
    ep: int = _f(1, "expert parallelism degree (simulator.programs.step_ep): each rank holds experts / ep of every "
                    "MoE "
                    "layer, experts sharded / reduced over their gpus / ep replica group, token all-to-alls "
                    "over ep consecutive ranks; 1 = none. Every layout (simulator.programs.step_ep)")
    max_split: int = _f(1, "dmuon: largest owner group of one batch (split NS over 2, 4, ... ranks up to "
                           "it, where the plan finds it pays; 1 = one owner per batch, the paper's design)")
    split_exchange: str = _f("lead", "dmuon, split batches: lead (as the runtime: the lead holds gradient, "
                                     "momentum and weights and scatters / gathers the NS stack in the "
                                     "group) | blocks (every member holds its column block)")
    bucket_numel: int = _f(0, "dmuon: elements per communication bucket (0: one bucket per layer)")
    milp_time_limit_s: float = _f(10.0, "dmuon MILP balancer: wall-clock safety net (work limits end it "
                                        "first)")
    jitter: float = _f(0.0, "stragglers: coefficient of variation of every compute op's time, drawn "
                            "per rank and op (lognormal, mean 1, seeded by `seed`); > 0 simulates 1 + "
                            "jitter_steps steps and reports the median step (p50, as published tables) and "
                            "its p90 (0 = none)")
    jitter_steps: int = _f(8, "steps sampled when jitter > 0 (after one warm-up step)")
    seed: int = _f(0, "seed of the jitter draws")
    # ---- memory model (simulator.models.memory): activations recomputation and the master weights' dtype ----
    recompute: str = _f("none", "activation recomputation: none | selective (Korthikanti et al. 2022: the "
                                "attention core) | full (every layer's input only)")
    param_dtype: str = _f("fp32", "dtype of master weights, gradients (FSDP: sharded) and replicated "
                                  "parameters: bf16 | fp16 | fp32 (compute copies in the profile's dtype)")
    # ---- tensor / sequence / pipeline parallelism (simulator.programs.parallel, simulator.programs.parallel_run) ----
    tp: int = _f(1, "tensor-parallel degree: each matrix cut over tp GPUs of a node (Megatron column / row "
                    "split), 2 all-reduces per layer forward and 2 backward on NVLink; 1 = none")
    pp: int = _f(1, "pipeline-parallel degree: the transformer layers in pp stages (embeddings on the first, "
                    "head on the last), 1F1B schedule; 1 = none")
    vpp: int = _f(1, "model chunks per pipeline stage (interleaved schedule, Megatron's virtual pipeline); "
                     "1 = plain 1F1B")
    sp: bool = _f(False, "sequence parallelism (with tp > 1): each TP all-reduce becomes an all-gather + a "
                         "reduce-scatter (Korthikanti et al. 2022)")
    microbatches: int | None = _f(None, "micro-batches of micro_batch sequences per step and DP rank (None: "
                                        "1 without pp, else 4 x pp); >= pp with pp > 1")
    # `recompute` (the memory model's field above) also sets the time: full re-runs the forward in backward,
    # selective the attention core (simulator.programs.parallel_run)
    plan: object = _f(None, "a dmuon.plan.Plan built elsewhere (e.g. by the runtime); None: build_plan")
    # issue 28: the public implementation's schedule beside ours (simulator.programs.step_published)
    system: str = _f("ours", "ours (this project's runtime) | published (the public implementation's "
                             "schedule, X-Square-Robot/dmuon: simulator.programs.step_published)")
    published_off: tuple = _f((), "system published: its mechanisms to turn off (simulator.programs.step_published."
                                  "MECHANISMS), e.g. ('fwd_prefetch',)")
    published_on: tuple = _f((), "system published: public modes that are not its runs' defaults to turn "
                                 "on (simulator.programs.step_published.OPT_IN: sync_publish)")
    cost: object = _f(None, "a dmuon CostTable (or any object with ns_time / elementwise_time); None: "
                            "CostTable.load(profile.cost_profile)")

    @classmethod
    def help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}


@dataclass(frozen=True)
class SimResult:
    """What one simulated step produced (see the module docstring for each time's meaning)."""

    workload: str
    gpus: int
    gpus_per_node: int
    strategy: str
    layout: str
    profile: str
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    grad_sync_tail_s: float
    exposed_comm_s: float
    exposed_comm_mean_s: float
    tokens_per_s: float
    comm_bytes_per_rank: float  # average bytes each rank sends per step (muon.md's convention)
    muon_comm_bytes_per_rank: float  # of which Muon-matrix data
    muon_comm_volume: float  # muon_comm_bytes_per_rank / (P_muon x bytes per element): e.g. 2 (N-1)/N
    ns_makespan_s: float  # dmuon: the plan's makespan; naive: every rank's NS total; adamw: 0
    ns_busy_max_s: float  # simulated NS compute of the busiest rank in the step
    plan_balancer: str
    plan_method: str
    settings: dict
    provenance: dict
    notes: tuple[str, ...]
    step_p90_s: float = 0.0  # p90 of the sampled steps with jitter (= step_s without)
    peak_mem_gib: float = 0.0  # simulator.models.memory: peak memory of the busiest rank over the step
    mem_fits: bool = True  # peak_mem_gib within the profile's memory_gib (per rank)
    memory: dict = field(default_factory=dict)  # simulator.models.memory.MemoryBreakdown.to_dict()

    def to_dict(self) -> dict:
        return asdict(self)


MAX_GPUS = 1 << 16  # the simulator runs one process per rank: far beyond any published cluster size


def _check_int(name: str, v, minimum: int = 1, maximum: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (maximum is not None and v > maximum):
        limit = f" and <= {maximum}" if maximum is not None else ""
        raise InputError(f"{name} must be an integer >= {minimum}{limit}, got {v!r}")


def _check_bool(name: str, v, none_ok: bool = False) -> None:
    if not (isinstance(v, bool) or (none_ok and v is None)):
        accepted = "true, false" + (" or unset (None)" if none_ok else "")
        raise InputError(f"{name} must be {accepted}, got {v!r}")


def _check_number(name: str, v, *, positive: bool, none_ok: bool = True, what: str = "") -> None:
    if v is None and none_ok:
        return
    ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
          and (v > 0 if positive else v >= 0))
    if not ok:
        raise InputError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}{what}, got {v!r}")


def validate_config(cfg: SimConfig) -> None:
    """Raise InputError naming the bad field and what is accepted."""
    _check_int("gpus", cfg.gpus, maximum=MAX_GPUS)
    if cfg.gpus_per_node is not None:
        _check_int("gpus_per_node", cfg.gpus_per_node)
    _check_int("seq_len", cfg.seq_len)
    _check_int("micro_batch", cfg.micro_batch)
    _check_int("max_batch", cfg.max_batch)
    _check_int("max_split", cfg.max_split, maximum=MAX_GPUS)
    _check_int("ep", cfg.ep, maximum=MAX_GPUS)
    from simulator.programs.parallel import check_fields

    check_fields(cfg)  # tp, pp, vpp, sp, microbatches, recompute
    if cfg.ep > 1:
        from simulator.programs.step_ep import EP_LAYOUTS

        if cfg.gpus % cfg.ep:
            raise InputError(f"ep={cfg.ep} does not divide gpus={cfg.gpus}; accepted: a divisor of the GPU "
                             "count")
        if cfg.layout not in EP_LAYOUTS:
            raise InputError(f"ep > 1 runs with layout {' | '.join(EP_LAYOUTS)}, got {cfg.layout!r}")
        if cfg.max_split > 1:
            raise InputError("max_split > 1 is not supported with ep > 1; accepted: max_split=1")
    from simulator.models.memory_activations import RECOMPUTE

    if cfg.recompute not in RECOMPUTE:
        raise choice_error("recompute", cfg.recompute, RECOMPUTE)
    if cfg.param_dtype not in DTYPE_BYTES:
        raise choice_error("param_dtype", cfg.param_dtype, DTYPE_BYTES)
    if cfg.split_exchange not in SPLIT_EXCHANGES:
        raise choice_error("split_exchange", cfg.split_exchange, SPLIT_EXCHANGES)
    _check_int("cpu_threads", cfg.cpu_threads)
    _check_int("bucket_numel", cfg.bucket_numel, 0)
    _check_int("jitter_steps", cfg.jitter_steps)
    _check_int("seed", cfg.seed, 0)
    _check_number("jitter", cfg.jitter, positive=False, none_ok=False, what=" (0 = no stragglers)")
    if cfg.strategy not in STRATEGIES:
        raise choice_error("strategy", cfg.strategy, STRATEGIES)
    if cfg.layout not in LAYOUTS:
        raise choice_error("layout", cfg.layout, LAYOUTS)
    if cfg.balancer not in BALANCERS:
        raise choice_error("balancer", cfg.balancer, BALANCERS)
    if cfg.ns_method is not None and cfg.ns_method not in NS_METHODS:
        raise choice_error("NS method", cfg.ns_method, NS_METHODS)
    if cfg.naive_ns_method not in NS_METHODS:
        raise choice_error("naive NS method", cfg.naive_ns_method, NS_METHODS)
    for name in ("ns_dtype", "param_comm_dtype", "grad_comm_dtype"):
        if getattr(cfg, name) is not None and getattr(cfg, name) not in DTYPE_BYTES:
            raise choice_error(name.replace("_", " "), getattr(cfg, name), DTYPE_BYTES)
    for name in ("gram", "batching", "overlap", "hierarchical", "naive_batching", "per_head"):
        _check_bool(name, getattr(cfg, name))
    if cfg.per_head and cfg.model is None:
        raise InputError("per_head cuts a Hugging Face model's attention matrices; accepted: per_head with "
                         "model (a config.json), or per_head False")
    _check_bool("symmetric_kernels", cfg.symmetric_kernels, none_ok=True)
    for name, accepted in (("speed_scale", "(1 = as profiled)"),
                           ("ns_speed_scale", "or None (None = speed_scale)"),
                           ("elementwise_speed_scale", "or None (None = speed_scale)")):
        sc = getattr(cfg, name)
        bad = isinstance(sc, bool) or not isinstance(sc, (int, float)) or not (math.isfinite(sc) and sc > 0)
        if bad and (sc is not None or name == "speed_scale"):
            raise InputError(f"{name} must be a finite number > 0 {accepted}, got {sc!r}")
    nic = cfg.nic_gbps
    if nic is not None and (isinstance(nic, bool) or not isinstance(nic, (int, float)) or not nic > 0):
        raise InputError(f"nic_gbps must be a positive number (Gbit/s per node), got {cfg.nic_gbps!r}")
    _check_number("overlap_slowdown", cfg.overlap_slowdown, positive=False, what=" (0 = no slowdown)")
    _check_number("milp_time_limit_s", cfg.milp_time_limit_s, positive=True, none_ok=False, what=" seconds")
    from simulator.programs.step_published import published_mechanisms

    published_mechanisms(cfg.system, cfg.published_off, cfg.published_on)


def node_shape(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node); gpus <= gpus_per_node is one (partial) node."""
    if gpus <= gpus_per_node:
        return 1, gpus
    if gpus % gpus_per_node:
        below, above = gpus - gpus % gpus_per_node, gpus - gpus % gpus_per_node + gpus_per_node
        raise InputError(f"gpus={gpus} is not a whole number of {gpus_per_node}-GPU nodes "
                         f"({gpus / gpus_per_node:g} nodes); accepted: 1..{gpus_per_node} (one node, "
                         f"possibly partial) or a multiple of {gpus_per_node} (nearest: {below} or {above}), "
                         "or set gpus_per_node")
    return gpus // gpus_per_node, gpus_per_node


def profile_of(cfg: SimConfig):
    """The hardware profile `cfg` runs on: its cluster file (simulator.fabric.cluster_file) or its gpu profile,
    then the config's nic_gbps and overlap_slowdown overrides."""
    from simulator.fabric.hardware import Profile, load_profile

    if cfg.cluster is not None:
        from simulator.fabric.cluster_file import load_cluster

        gpu = None if isinstance(cfg.gpu, str) and cfg.gpu == SimConfig.gpu else cfg.gpu
        profile = load_cluster(cfg.cluster, gpu)
    else:
        profile = cfg.gpu if isinstance(cfg.gpu, Profile) else load_profile(cfg.gpu)
    if cfg.nic_gbps is not None:
        profile = profile.with_nic_gbps(cfg.nic_gbps)
    if cfg.overlap_slowdown is not None:
        profile = profile.with_overlap_slowdown(cfg.overlap_slowdown)
    return profile


def simulate(cfg: SimConfig) -> SimResult:
    """Simulate `cfg` (2 steps, the second reported). Deterministic: same config -> same result. The garbage
    collector stays paused until the ops are freed (simulator.engine.engine.paused_gc: a MoE run's ~10^6 ops would
    otherwise be walked by a full collection once it resumes)."""
    from simulator.engine.engine import paused_gc

    with paused_gc():
        return run(cfg, all_ranks=False)[0]


def run(cfg: SimConfig, all_ranks: bool = True, _execute: bool = True, _memory: bool = True):
    """(SimResult, the finished simulator.programs.step.Built) — the trace writer needs the second. all_ranks=False:
    ranks with identical programs are simulated once (the same result, faster; the trace then holds only
    those ranks). _execute=False: (None, the Built not run yet): `build_programs`. _memory=False: the
    memory fields left at their defaults (a TP x PP stage's DP step, whose memory run_parallel does not use)."""
    from simulator.engine.engine import paused_gc
    from simulator.engine.metrics import measure
    from .setup import make_spec
    from simulator.programs.step import build

    validate_config(cfg)
    from simulator.programs.parallel import is_parallel

    if is_parallel(cfg):  # TP x PP x DP (simulator.programs.parallel_run): no single step program to return
        if not _execute or all_ranks:
            raise InputError("traces and built programs are for data-parallel steps; accepted: tp=pp=1, one "
                             "micro-batch, recompute none")
        from simulator.programs.parallel_run import run_parallel
        from simulator.models.workload import resolve_workload

        profile = profile_of(cfg)
        per_node_cap = cfg.gpus_per_node or profile.gpus_per_node
        nodes, per_node = node_shape(cfg.gpus, per_node_cap)
        from functools import partial

        # each stage's DP step: its memory is not read (run_parallel's result has the job's, below)
        out = run_parallel(cfg, resolve_workload(cfg.workload, cfg.model, cfg.per_head), profile, per_node,
                           partial(run, _memory=False))
        settings = {k: v for k, v in asdict_shallow(cfg).items() if k not in ("workload", "plan", "cost", "gpu")}
        out["settings"] = {**settings, "nodes": nodes, "ranks_per_node": per_node, **out["settings"]}
        out.update(_memory_fields(cfg, None))  # simulator.models.memory: tp, pp, vpp, microbatches, recompute
        return SimResult(gpus=cfg.gpus, gpus_per_node=per_node_cap, strategy=cfg.strategy, layout=cfg.layout,
                         **out), None
    from simulator.engine.symmetry import enabled
    from simulator.models.workload import resolve_workload

    all_ranks = all_ranks or not enabled()  # DMUON_SIM_SYMMETRY=off: every rank (simulator.engine.symmetry)

    workload = resolve_workload(cfg.workload, cfg.model, cfg.per_head)
    profile = profile_of(cfg)
    per_node_cap = cfg.gpus_per_node or profile.gpus_per_node
    nodes, per_node = node_shape(cfg.gpus, per_node_cap)
    if cfg.ep > 1 and per_node % cfg.ep and cfg.ep % per_node:
        raise InputError(f"ep={cfg.ep} with {per_node} GPUs per node: EP groups must fit a node or span "
                         f"whole nodes; accepted: a divisor or a multiple of {per_node}")
    cost = cfg.cost if cfg.cost is not None else load_cost(profile.cost_profiles)
    thread_cost = thread_cost_for(profile, cfg) if cfg.cost is None else None
    spec, info = make_spec(cfg, workload, profile, cost, per_node, thread_cost)
    spec.sm_share = profile.sm_share  # SMs an NCCL collective holds (simulator.engine.engine)
    spec.sm_share_net = profile.sm_share_net  # ... over one GPU per node (Profile.nccl_channels_net)
    if cfg.jitter > 0:  # stragglers: every rank draws its own times, so every rank is simulated
        spec.steps, all_ranks = 1 + cfg.jitter_steps, True
    with paused_gc():  # one pause for building, running and reading the ops (simulator.engine.engine.paused_gc)
        built = build(spec, overlap_slowdown=profile.overlap_slowdown,
                      comm_overlap_slowdown=profile.comm_overlap_slowdown, all_ranks=all_ranks,
                      jitter=(cfg.jitter, cfg.seed))
        if not _execute:
            return None, built
        built.cluster.run()
        samples = sorted((measure(built, step=s) for s in range(1, spec.steps)), key=lambda x: x["step_s"])
    m = samples[(len(samples) - 1) // 2]  # the median step (the only one without jitter)
    p90 = samples[min(len(samples) - 1, round(0.9 * (len(samples) - 1)))]["step_s"]
    p_muon = sum(spec.muon_numel)
    same_width = spec.grad_bytes == spec.param_bytes
    vol = m["muon_bytes"] / (p_muon * spec.grad_bytes) if p_muon and same_width else 0.0
    tokens = cfg.gpus * cfg.seq_len * cfg.micro_batch
    settings = {k: v for k, v in asdict_shallow(cfg).items() if k not in ("workload", "plan", "cost", "gpu")}
    settings.update(nodes=nodes, ranks_per_node=per_node)
    result = SimResult(
        workload=workload.name, gpus=cfg.gpus, gpus_per_node=per_node_cap, strategy=cfg.strategy,
        layout=cfg.layout, profile=profile.name,
        step_s=m["step_s"], forward_s=m["forward_s"], backward_s=m["backward_s"],
        optimizer_s=m["optimizer_s"], grad_sync_tail_s=m["grad_sync_tail_s"],
        exposed_comm_s=m["exposed_max_s"], exposed_comm_mean_s=m["exposed_mean_s"],
        tokens_per_s=tokens / m["step_s"] if m["step_s"] > 0 else 0.0,
        comm_bytes_per_rank=m["bytes"], muon_comm_bytes_per_rank=m["muon_bytes"], muon_comm_volume=vol,
        ns_makespan_s=info["ns_makespan_s"], ns_busy_max_s=m["ns_busy_max_s"],
        plan_balancer=info["balancer"], plan_method=info["method"], settings=settings,
        provenance=info["provenance"](), notes=tuple(info["notes"] + built.notes), step_p90_s=p90,
        **(_memory_fields(cfg, spec.plan) if _memory else {}),
    )
    return result, built


def memory_of(cfg: SimConfig, plan=None, **kw):
    """Memory per rank of `cfg` without simulating the step (simulator.models.memory.breakdown): a
    MemoryBreakdown with .peak_bytes, .peak_gib, .fits, .capacity_bytes, .gib() and one field per part.
    Stable API for layout searches: cheap (no plan is built; DMuon owners balanced by elements unless
    `plan` or cfg.plan gives them). kw: simulator.models.memory.breakdown's recompute / loss_fp32 / free."""
    from simulator.models.memory import breakdown
    from simulator.models.workload import resolve_workload

    validate_config(cfg)
    profile = profile_of(cfg)
    _, per_node = node_shape(cfg.gpus, cfg.gpus_per_node or profile.gpus_per_node)
    return breakdown(cfg, resolve_workload(cfg.workload, cfg.model, cfg.per_head), profile, per_node, plan,
                     **kw)


def _memory_fields(cfg: SimConfig, plan) -> dict:
    """SimResult's memory fields: simulator.models.memory of the plan the step ran."""
    mem = memory_of(cfg, plan)
    return {"peak_mem_gib": mem.peak_gib, "mem_fits": mem.fits, "memory": mem.to_dict()}


def build_programs(cfg: SimConfig, all_ranks: bool = True):
    """The simulator.programs.step.Built that `run(cfg, all_ranks)` would run, built and not run (its cluster's
    `run()` gives the same op times): for timing or comparing event loops on one graph."""
    return run(cfg, all_ranks, _execute=False)[1]


def asdict_shallow(cfg: SimConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def timed_simulate(cfg: SimConfig) -> tuple[SimResult, float]:
    """simulate() and its wall-clock seconds (kept out of SimResult so results stay bitwise equal)."""
    t0 = time.perf_counter()
    r = simulate(cfg)
    return r, time.perf_counter() - t0


__all__ = ["SimConfig", "SimResult", "simulate", "run", "build_programs", "timed_simulate", "memory_of"]
