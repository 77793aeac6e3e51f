"""From a config to the numbers a step program runs on: layer times, NS costs, the plan, provenance.

`make_spec` resolves a `SimConfig` against a workload, a hardware profile and a cost table into a
`simulator.programs.step.StepSpec`, and says where every input came from (measured / fitted / modelled).
For dmuon the plan is `dmuon.plan.build.build_plan`'s (once per distinct input) or the one the config
carries (a Plan built elsewhere, e.g. by the runtime): the simulator never re-derives owners, batches or
buckets.
"""

from __future__ import annotations

from dmuon.errors import InputError

from simulator.models.compute import layer_times
from .costs import plan_for
from simulator.programs.step import DTYPE_BYTES, StepSpec


def _check_plan(plan, matrices, world: int) -> None:
    if plan.world_size != world:
        raise InputError(f"the given plan is for {plan.world_size} ranks; this layout needs a plan over "
                         f"{world}")
    mine = sorted((m.name, m.rows, m.cols) for m in matrices)
    theirs = sorted((m.name, m.rows, m.cols) for m in plan.matrices)
    if mine != theirs:
        missing = sorted(set(mine) - set(theirs))[:3]
        extra = sorted(set(theirs) - set(mine))[:3]
        raise InputError(f"the given plan does not match the workload's Muon matrices (missing {missing}, "
                         f"unexpected {extra})")


def ns_method_of(cfg, profile) -> str:
    """The NS method dmuon plans with: cfg.ns_method, else from cfg.gram and the symmetric kernels."""
    if cfg.ns_method is not None:
        return cfg.ns_method
    sym = profile.symmetric_kernels if cfg.symmetric_kernels is None else cfg.symmetric_kernels
    return ("gram" if cfg.gram else "standard") + ("_sym" if sym else "")


def orientation_of(muon, profile, method: str) -> bool | frozenset:
    """The NS shapes whose tall and wide matrices the plan keeps in batches of their own, as the runtime's
    plan does on that device (`dmuon.runtime.planning.tall_as_is_shapes`: where its NS iterates tall
    matrices as they are, so a mixed batch would run as two calls). CPU profiles: the runtime's NS runs
    torch ops there, which iterate every tall matrix as it is (standard and Gram NS; method 'auto' may
    pick either per shape), so the shapes where every method the plan may pick does. GPU profiles, and
    the '_sym' methods (the Triton kernels, which take the wide orientation): none (False), the
    simulator's long-standing convention (which shapes the runtime's 'auto' kernels leave to torch on a
    GPU is not modelled)."""
    if not profile.cpu_cores or method.endswith("_sym"):
        return False
    from dmuon.newton_schulz import iterates_tall_as_is

    methods = ("standard", "gram") if method == "auto" else (method,)
    shapes = {(min(m.rows, m.cols), max(m.rows, m.cols)) for m in muon}
    return frozenset(s for s in shapes
                     if all(iterates_tall_as_is(*s, "cpu", method=x, kernels="torch") for x in methods))


def elementwise_pricer(priced, profile, scale: float, answers: dict | None = None):
    """The simulator's price of one elementwise pass, `elementwise_s(numel, op, tensors=1) -> seconds`:
    the cost table's fp32 pass of `op` over `numel` elements in `tensors` tensors
    (`CostTable.elementwise_time`), x `scale` (the profile's elementwise_scale x contention x speed);
    grad_prep x the profile's grad_prep_passes (0: free). `answers[op]` keeps the largest pass's
    CostAnswer (provenance)."""
    answers = {} if answers is None else answers

    def elementwise_s(numel: float, op: str, tensors: int = 1) -> float:
        n = int(round(numel))
        if n <= 0:
            return 0.0
        if op == "grad_prep" and not profile.grad_prep_passes:
            return 0.0
        a = priced.elementwise_time(n, op, "fp32", max(1, min(int(tensors), n)))
        if n >= answers.get(op, (0, None))[0]:
            answers[op] = (n, a)  # provenance names the largest pass
        return a.time_s * scale * (profile.grad_prep_passes if op == "grad_prep" else 1.0)

    return elementwise_s


def profile_pricer(name: str):
    """`elementwise_pricer` of hardware profile `name` as `harness simulate --gpu NAME` prices a pass at
    speed 1 on one thread without contention (its first loadable cost table, its elementwise_scale)."""
    from .costs import load_cost
    from simulator.fabric.hardware import load_profile

    profile = load_profile(name)
    return elementwise_pricer(load_cost(profile.cost_profiles), profile, profile.elementwise_scale)


def make_spec(cfg, workload, profile, cost, per_node: int, thread_cost=None):
    """(StepSpec, info) where info has ns_makespan_s, balancer, method, notes, and provenance: a callable
    returning the provenance dict once the step programs have been built. thread_cost: a cost table
    measured at cfg.cpu_threads threads (CPU profiles): it replaces `cost` (the plan is built from it, as
    the runtime plans with the table of its thread count, and it prices the elementwise passes)."""
    if cfg.ep > 1:  # expert parallelism places each expert matrix on its EP rank: every one its own entry
        workload = workload.experts_apart()
    priced = thread_cost or cost  # what NS calls and elementwise passes cost at this thread count
    measured = thread_cost is not None
    k = cfg.speed_scale  # the device's speed now vs when profiled
    stretch = profile.contention(per_node, cfg.cpu_threads) * k  # as layer compute's (provenance)
    k_ns = k if cfg.ns_speed_scale is None else cfg.ns_speed_scale  # NS drift, where probed apart
    k_ew = k if cfg.elementwise_speed_scale is None else cfg.elementwise_speed_scale  # memory-bound passes
    ns_stretch = profile.contention(per_node, cfg.cpu_threads, "ns", threads_measured=measured) * k_ns
    ew_stretch = (profile.contention(per_node, cfg.cpu_threads, "elementwise", threads_measured=measured)
                  * k_ew)
    ns_dtype = cfg.ns_dtype or profile.dtype
    muon = workload.muon_matrices
    index = {m.name: i for i, m in enumerate(muon)}
    n_layers = workload.n_layers
    layer_muon: list[list[int]] = [[] for _ in range(n_layers)]
    layer_adamw = [0] * n_layers
    layer_adamw_tensors = [0] * n_layers
    for p in workload.params:
        if p.optimizer == "muon":
            layer_muon[p.layer].append(index[p.name])
        else:
            layer_adamw[p.layer] += p.numel
            layer_adamw_tensors[p.layer] += 1
    heads = hidden = None
    if profile.activation_rw_passes:  # memory-bound passes (simulator.models.compute): the model's heads and width
        from simulator.programs.parallel import hidden_of, model_heads

        heads, hidden = (model_heads(cfg.model) or (None,))[0], hidden_of(workload)
    times = [(f * k, b * k) for f, b in layer_times(workload, profile, cfg.seq_len, cfg.micro_batch, per_node,
                                                     cfg.cpu_threads, heads=heads, hidden=hidden or 0)]

    ns_answers = {}
    naive_methods = [cfg.naive_ns_method]
    if cfg.naive_ns_method == "auto":  # per shape the cheapest method this device runs
        sym = profile.symmetric_kernels if cfg.symmetric_kernels is None else cfg.symmetric_kernels
        naive_methods = ["standard", "gram"] + (["standard_sym", "gram_sym"] if sym else [])
    # one call per matrix, or (naive_batching) one batched call per shape as dmuon.NaiveMuon's
    # orthogonalize_many makes, its time shared evenly by its members
    same_shape: dict[tuple[int, int], int] = {}  # matrices per shape (a parameter's count of them each)
    for m in muon:
        same_shape[(m.rows, m.cols)] = same_shape.get((m.rows, m.cols), 0) + m.count
    for m in muon:
        key = (m.rows, m.cols)
        if key not in ns_answers:
            b = same_shape[key] if cfg.naive_batching else 1
            ns_answers[key] = min((priced.ns_time(m.rows, m.cols, b, meth, ns_dtype)
                                   for meth in naive_methods), key=lambda a: a.time_s)
    per_member = {k: (same_shape[k] if cfg.naive_batching else 1) for k in ns_answers}
    share = {k: ns_answers[k].time_s / per_member[k] for k in ns_answers}  # a member's share of its call
    ns_naive = [share[(m.rows, m.cols)] * m.count * ns_stretch for m in muon]

    ew_answers: dict = {}
    elementwise_s = elementwise_pricer(priced, profile, profile.elementwise_scale * ew_stretch, ew_answers)

    ep = None
    if cfg.ep > 1:  # expert parallelism (simulator.programs.step_ep): placement, all-to-all bytes, expert compute
        from simulator.programs.step_ep import ep_spec

        ep = ep_spec(workload, muon, cfg.ep, cfg.seq_len, cfg.micro_batch, profile,
                     profile.contention(per_node, cfg.cpu_threads) * k, DTYPE_BYTES[profile.dtype])
        ns_naive_local = [t for t, w in zip(ns_naive, ep.muon_ep, strict=True) if w in (None, 0)]
    network = profile.network_for(per_node, k if profile.cpu_cores else 1.0)
    from simulator.programs.step_published import published_mechanisms, published_plan_of  # issue 28

    published = (published_mechanisms(cfg.system, cfg.published_off, cfg.published_on)
                 if cfg.strategy == "dmuon" else frozenset())
    plan = None
    info = {"ns_makespan_s": 0.0, "balancer": "", "method": "", "notes": list(workload.notes)}
    host_tensors = 0  # published adamw_unfused: the public AdamW loop's tensors (programs.published_host)
    if "adamw_unfused" in published:
        from simulator.programs.published_host import adamw_loop_tensors

        host_tensors, note = adamw_loop_tensors(workload.name, sum(layer_adamw_tensors))
        info["notes"] += [note] if note else []
    if cfg.strategy == "dmuon":
        # every layout plans over all ranks, as the runtime does (HSDP: fsdp2-owner on a replicate x shard
        # mesh spreads owners over all R x S ranks, two-level exchange, each NS once in the job)
        world = cfg.gpus
        if cfg.plan is not None:
            _check_plan(cfg.plan, muon, world)
            if getattr(cfg.plan, "ep", 1) != cfg.ep:
                raise InputError(f"the given plan has ep={getattr(cfg.plan, 'ep', 1)}; this config has "
                                 f"ep={cfg.ep}: accepted: a plan of the same ep "
                                 "(dmuon.plan.ep.build_ep_plan)")
            plan = cfg.plan
        else:  # planned from the table of this thread count, as the runtime plans (runtime.planning)
            links = None
            if cfg.max_split > 1:  # owner groups priced on this step's network (simulator.programs.split_links)
                from simulator.programs.split_links import SimulatorLinks

                links = SimulatorLinks(network, per_node, hierarchical=cfg.hierarchical,
                                       source=f"simulator profile {profile.name} network")
            method = ns_method_of(cfg, profile)
            orient = orientation_of(muon, profile, method) if cfg.ep == 1 else False
            plan = published_plan_of(cfg, published, muon, per_node, priced, method, ns_dtype, orient) or plan_for(
                            muon, world, priced, balancer=cfg.balancer, method=method,
                            dtype=ns_dtype, batching=cfg.batching,
                            max_batch=1 if "ns_per_matrix" in published else cfg.max_batch,
                            bucket_numel=cfg.bucket_numel, time_limit_s=cfg.milp_time_limit_s,
                            max_split=cfg.max_split, links=links, ep=cfg.ep,
                            owner_momentum=cfg.layout != "sharded",  # sharded: momentum on shards
                            orientation=orient)
        info.update(ns_makespan_s=max(plan.ns_loads_s) * ns_stretch, balancer=plan.balancer,
                    method=plan.method)  # the plan's NS part (its batch times less their momentum)
        info["notes"] += list(plan.notes)
    elif cfg.strategy == "naive":
        info.update(ns_makespan_s=sum(ns_naive if ep is None else ns_naive_local),
                    method=f"{cfg.naive_ns_method} ({ns_dtype}, every rank)")

    spec = StepSpec(
        strategy=cfg.strategy, layout=cfg.layout, n_ranks=cfg.gpus, per_node=per_node,
        layer_fwd_s=[t[0] for t in times], layer_bwd_s=[t[1] for t in times], layer_muon=layer_muon,
        muon_numel=[m.rows * m.cols * m.count for m in muon], muon_shape=[(m.rows, m.cols) for m in muon],
        layer_adamw_numel=layer_adamw,
        layer_adamw_tensors=layer_adamw_tensors,
        ns_naive_s=ns_naive, elementwise_s=elementwise_s,
        # bookkeeping measured on one thread (Python, dispatch): more threads per rank do not shorten it
        optimizer_overhead_s=profile.optimizer_overhead_s * k_ew
        * profile.contention(per_node, cfg.cpu_threads, threads_measured=True),
        network=network,
        hierarchical=cfg.hierarchical, overlap=cfg.overlap,
        param_bytes=DTYPE_BYTES[cfg.param_comm_dtype or profile.dtype],
        grad_bytes=DTYPE_BYTES[cfg.grad_comm_dtype or profile.dtype], plan=plan, ns_stretch=ns_stretch,
        split_exchange=cfg.split_exchange, ep_spec=ep, published=published,
        published_adamw_tensors=host_tensors,
    )
    # called after the step programs are built: they price the elementwise passes provenance names
    def provenance() -> dict:
        prov = _provenance(profile, priced, ns_answers, ew_answers, plan, cfg.strategy,
                           (stretch, ns_stretch, ew_stretch), measured)
        if k != 1.0:
            parts = (["compute"] + (["NS"] if cfg.ns_speed_scale is None else [])
                     + (["elementwise"] if cfg.elementwise_speed_scale is None else [])
                     + (["collective"] if profile.cpu_cores else []))
            what = " and ".join(parts) if len(parts) < 3 else ", ".join(parts[:-1]) + " and " + parts[-1]
            prov["speed_scale"] = (f"every {what} time x {k:.4g} (SimConfig.speed_scale: the device's "
                                   "speed vs its profile's)")
        if spec.optimizer_overhead_s:
            prov["optimizer_overhead"] = (f"{spec.optimizer_overhead_s * 1e3:.3g} ms per step "
                                          f"({profile.provenance.get('optimizer_overhead_ms', '')})")
        if cfg.ns_speed_scale is not None:
            prov["ns_speed_scale"] = (f"every NS time x {k_ns:.4g} (SimConfig.ns_speed_scale: NS speed vs "
                                      "the cost table's)")
        if cfg.elementwise_speed_scale is not None:
            prov["elementwise_speed_scale"] = (f"every elementwise pass and the optimizer overhead x "
                                               f"{k_ew:.4g} (SimConfig.elementwise_speed_scale: their speed "
                                               "vs the cost table's)")
        return prov

    info["provenance"] = provenance
    if ep is not None:
        how = "all-reduced" if cfg.layout == "ddp" and cfg.strategy != "dmuon" else "reduced / gathered"
        info["notes"].append(f"expert parallelism ep={cfg.ep}: experts {how} over their "
                             f"{cfg.gpus // cfg.ep}-rank replica group, 2 + 2 token all-to-alls per MoE "
                             "layer "
                             "over the EP group (simulator.programs.step_ep); ASSUMPTION: balanced routing")
    if len({p.component for p in workload.params}) > 1:
        info["notes"].append("ASSUMPTION: every token passes through every component (per-component token "
                             "counts are not public)")
    return spec, info


def _provenance(profile, cost, ns_answers, ew_answers, plan, strategy, stretch, threads_measured) -> dict:
    p = profile.provenance
    cost_name = getattr(cost, "name", type(cost).__name__)
    prov = {
        "profile": f"{profile.name}: {profile.description}".strip(": "),
        "forward_compute": f"modelled: FLOPs / {profile.fwd_flops / 1e12:.4g} TFLOP/s + "
                           f"{profile.fwd_layer_overhead_s * 1e3:.3g} ms per layer "
                           f"({p.get('fwd_tflops', '')})",
        "backward_compute": f"modelled: FLOPs / {profile.bwd_flops / 1e12:.4g} TFLOP/s + "
                            f"{profile.bwd_layer_overhead_s * 1e3:.3g} ms per layer "
                            f"({p.get('bwd_tflops', '')})",
        "intra_node_bandwidth": "modelled from " + (p.get("curve_from") or "; ".join(
            v for k, v in sorted(p.items()) if k.startswith("network.points"))[:300]),
        "inter_node_bandwidth": f"{profile.network.nic_Bps_per_node * 8 / 1e9:g} Gb/s per node x "
                                f"{profile.network.inter_efficiency:g} ({p.get('nic_gbps_per_node', '')}; "
                                f"{p.get('inter_efficiency', '')})",
        "latency": f"base {profile.network.base_latency_s * 1e6:g} us, "
                   f"{profile.network.intra_alpha_s * 1e6:g} us per NVLink step, "
                   f"{profile.network.inter_alpha_s * 1e6:g} us per network step "
                   f"({p.get('base_latency_us', '')})",
        "elementwise": "; ".join(f"{op} over {n:,} elements: {a.detail}" + (" (measured)" if a.measured
                                                                             else " (modelled)")
                                 for op, (n, a) in sorted(ew_answers.items())) + f" [cost table {cost_name}]",
    }
    if strategy == "naive":
        n_meas = sum(a.measured for a in ns_answers.values())
        example = next(iter(ns_answers.values())).detail if ns_answers else ""
        prov["ns_naive"] = (f"cost table {cost_name}: {n_meas} of {len(ns_answers)} naive-NS shapes "
                            f"measured, the rest modelled (e.g. {example})")
    if plan is not None:
        prov["ns_plan"] = (f"plan from cost table {plan.cost_source}: {plan.balancer}, {plan.method}, "
                           f"makespan {plan.makespan_s * 1e3:.3f} ms "
                           f"(lower bound {plan.lower_bound_s * 1e3:.3f} ms)"
                           + ("; the table was measured at this thread count" if threads_measured else ""))
    if any(s != 1.0 for s in stretch):
        src = {k: "; ".join(((f"thread speedup in cost table {cost_name}"
                              if threads_measured and k != "compute"
                              else p.get(f"{k}_speedup", "not measured: linear thread scaling (ASSUMPTION)")),
                             p.get(f"{k}_corun_slowdown", "co-running ranks: not measured, x1 (ASSUMPTION)")))
               for k in ("compute", "ns", "elementwise")}
        prov["cpu_contention"] = ("one-thread times x " + ", ".join(
            f"{k} {s:.3g}" for k, s in zip(src, stretch, strict=True))
            + " (ranks x threads over the profile's cores x co-run slowdown / thread speedup; "
            + "; ".join(f"{k}: {v}" for k, v in src.items()) + ")")
    return prov
