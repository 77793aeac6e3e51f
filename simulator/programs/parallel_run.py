"""One training step of a TP x PP x DP job (`SimConfig.tp`, `pp`, `vpp`, `sp`, `microbatches`, `recompute`).

How the step is composed (simulator.programs.parallel: layout, shards, TP and stage-to-stage communication;
simulator.programs.pipeline: the schedule):
  1. the workload's transformer blocks split into pp x vpp chunks (embeddings on the first stage, final norm
     and head on the last); every parameter is cut to its TP shard (Megatron's column / row split);
  2. per stage, one micro-batch's forward and backward of each chunk: the shard's compute (simulator.models.compute,
     so FLOPs / tp), plus the layer's TP collectives on NVLink on the critical path, plus recomputation
     (full: the forward again in backward; selective: the attention core again, Korthikanti et al. 2022);
  3. per stage, the data-parallel part (gathers, gradient reductions, the optimizer with its exchanges) is
     today's step program (simulator.programs.step) over the stage's DP group: gpus / (tp pp) ranks with the shard's
     parameters, gpus_per_node / tp of them per node, each getting 1 / tp of the node's NICs (the tp DP
     groups of a node run at once), computing one micro-batch. Its exposed forward communication (beyond
     that micro-batch's compute) is added to the stage's first forward, its exposed backward communication
     to its last backward (FSDP with PP gathers once per step and reduces after the last micro-batch, as
     torchtitan runs it with reshard_after_forward=False); its optimizer time (gradient-reduction tail,
     Muon's exchanges and NS, AdamW) follows the stage's last backward;
  4. the pipeline schedule runs every micro-batch; the step ends when the slowest stage's optimizer ends.
Muon on TP shards (naive and dmuon): a TP-split matrix must be orthogonalized whole. dmuon: each stage
runs the Plan dmuon.plan.tp.build_tp_plan returns for it, as the runtime does (simulator.programs.parallel_dmuon:
the stage's DP step program runs its DP view, owners the plan's TP groups, each matrix's time its TP group's
gather + NS + scatter or group NS on this profile's NVLink). naive: duplicated, every TP rank all-gathers
the matrix over NVLink and orthogonalizes it whole (`TPCost`, the shard's NS time), where NS runs.
With tp = pp = 1, one micro-batch and no recomputation, simulator.api.run runs today's step unchanged.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import replace

from dmuon.errors import InputError
from dmuon.plan.cost import CostAnswer

from simulator.models.compute import activation_memory_s, layer_flops, layer_times
from .parallel import (hidden_of, layout_of, model_heads, p2p_time, stage_layers, stage_workload,
                       tp_layer_comm)
from .pipeline import simulate_pipeline


class TPCost:
    """A cost table whose NS time of a TP shard is its whole matrix's as NaiveMuon runs it: duplicated,
    every TP rank all-gathers the matrix (priced by dmuon.plan.tp.price_tp_modes on the simulator's NVLink,
    simulator.programs.split_links) and runs the whole NS. A batch of b same-shape shards: one batched NS of b whole
    matrices and b all-gathers. Everything else is `base`'s."""

    def __init__(self, base, full: dict, tp: int, links, elem_bytes: int):
        self.base, self.full, self.tp, self.links = base, full, tp, links
        self.elem_bytes = elem_bytes
        self.name = f"{getattr(base, 'name', type(base).__name__)} + TP{tp} duplicated"

    def __getattr__(self, k):
        return getattr(self.base, k)

    def ns_time(self, rows: int, cols: int, batch: int = 1, method: str = "gram_sym", dtype: str = "bf16"):
        from dmuon.plan.tp import price_tp_modes

        whole = self.full.get((rows, cols))
        if whole is None:  # a replicated matrix: as today
            return self.base.ns_time(rows, cols, batch, method, dtype)
        R, C, dim = whole
        price = price_tp_modes(R, C, dim, self.tp, self.base, method=method, dtype=dtype, links=self.links,
                               wire_bytes=self.elem_bytes)
        a = self.base.ns_time(min(R, C), max(R, C), batch, method, dtype)
        return CostAnswer(a.time_s + batch * (price.duplicated_s - price.ns_s), a.measured,
                          f"{a.detail}; whole {R}x{C} on every TP rank + TP all-gather (duplicated)")


def _shard_shapes(stage_wl, full: dict) -> dict:
    """{shard (rows, cols): (whole rows, whole cols, shard dim)} of the stage's TP-split Muon matrices, both
    orientations; InputError if one shard shape stands for two whole shapes (the cost table is asked by
    shape)."""
    out: dict = {}
    for p in stage_wl.params:
        if p.optimizer != "muon" or p.name not in full:
            continue
        R, C = full[p.name]
        dim = 0 if p.rows != R else 1
        for k, v in (((p.rows, p.cols), (R, C, dim)), ((p.cols, p.rows), (C, R, 1 - dim))):
            if out.setdefault(k, v) != v:
                raise InputError(f"TP shards of shape {k[0]}x{k[1]} come from matrices "
                                 f"{out[k][0]}x{out[k][1]} "
                                 f"and {v[0]}x{v[1]}; not modelled: accepted: another tp")
    return out


def _dp_config(cfg, stage_wl, lay, profile, cost, full):
    dp_profile = profile
    if lay.tp > 1:  # the node's NICs carry its tp DP groups at once
        gbps = profile.network.nic_Bps_per_node * 8 / 1e9
        dp_profile = profile.with_nic_gbps(gbps / lay.tp)
        dp_profile = replace(dp_profile, provenance={**dp_profile.provenance, "nic_gbps_per_node": (
            f"{gbps:g} Gb/s per node / tp={lay.tp}: the node's tp DP groups share its NICs; "
            + profile.provenance.get("nic_gbps_per_node", ""))})
    plan = None
    if lay.tp > 1 and cfg.strategy in ("naive", "dmuon") and full:
        from simulator.costs import load_cost

        base = cost if cost is not None else load_cost(profile.cost_profiles)
        from .split_links import SimulatorLinks
        from .step import DTYPE_BYTES

        if cfg.strategy == "dmuon":  # the stage runs build_tp_plan's Plan (simulator.programs.parallel_dmuon)
            from .parallel_dmuon import stage_dp_plan

            tp_plan, plan = stage_dp_plan(cfg, stage_wl, full, lay, profile, base)
        else:
            links = SimulatorLinks(profile.network, lay.per_node, source=f"simulator profile {profile.name}")
            cost = TPCost(base, _shard_shapes(stage_wl, full), lay.tp, links,
                          DTYPE_BYTES[cfg.grad_comm_dtype or profile.dtype])
    # the stage's compute is parallel_run's (with the profile's memory-bound passes, which need the model's
    # heads); the DP step's own layer times only set how much of its communication they hide
    dp_profile = replace(dp_profile, activation_rw_passes=0.0)
    return replace(cfg, workload=stage_wl, model=None, per_head=False, gpus=lay.dp,
                   gpus_per_node=lay.dp_per_node, gpu=dp_profile, cluster=None, nic_gbps=None,
                   overlap_slowdown=None, cost=cost, plan=plan, tp=1, pp=1, vpp=1, sp=False,
                   microbatches=None, recompute="none")


def _dp_key(dcfg, run_dp) -> tuple | None:
    """What a stage's data-parallel step is a function of: every SimConfig field by value (repr), the plan
    and the cost table by identity (the DP view is cached by its inputs: simulator.programs.parallel_dmuon),
    the symmetry switch and `run_dp`; None where a field has no value repr (an object's address could be reused)."""
    from dataclasses import fields

    from simulator.engine.symmetry import enabled

    key = [enabled(), repr(run_dp)]  # simulator.api.run (a module function: its address is stable)
    for f in fields(dcfg):
        v = getattr(dcfg, f.name)
        if f.name in ("plan", "cost") and v is not None:
            key.append((f.name, id(v)))
            continue
        text = repr(v)
        if " at 0x" in text:
            return None
        key.append((f.name, text))
    return tuple(key)


def dp_step(dcfg, run_dp) -> tuple:
    """(SimResult, forward compute s, backward compute s) of a stage's data-parallel step, simulated once
    per distinct config in this process: the stage's DP step runs one micro-batch without recomputation
    (`_dp_config`), so a search's layouts that differ only in recomputation, micro-batches per step or
    pipeline schedule around the same stage ask for the same one. The simulation is deterministic, so
    the reused result is the one simulating again gives (tests/test_search.py)."""
    key = _dp_key(dcfg, run_dp)
    got = _DP_STEPS.get(key) if key is not None else None
    if got is None:
        r, built = run_dp(dcfg, all_ranks=False)
        got = (r, sum(built.spec.layer_fwd_s), sum(built.spec.layer_bwd_s), dcfg.plan, dcfg.cost)
        if key is not None:
            if len(_DP_STEPS) >= _DP_STEPS_MAX:  # oldest first; its plan / cost may then be freed
                del _DP_STEPS[next(iter(_DP_STEPS))]
            _DP_STEPS[key] = got  # holding plan and cost keeps their ids from being reused while cached
    return got[:3]


def _stage_workload(workload, layers: list[int], tp: int, name: str):
    """simulator.programs.parallel.stage_workload, built once per distinct input in a process (the
    workload by value; the result is frozen and only read)."""
    key = (workload, tuple(layers), tp, name)
    got = _STAGES.get(key)
    if got is None:
        if len(_STAGES) >= 1024:
            _STAGES.clear()
        got = _STAGES[key] = stage_workload(workload, layers, tp, name)
    return got


_STAGES: dict[tuple, tuple] = {}
_DP_STEPS: dict[tuple, tuple] = {}
_DP_STEPS_MAX = 256  # a SimResult and a few floats each


def run_parallel(cfg, workload, profile, per_node: int, run_dp) -> dict:
    """The SimResult fields of a TP x PP x DP step (module docstring) but gpus, gpus_per_node, strategy and
    layout; settings: the parallel ones only. cfg validated by simulator.api, which passes the workload, the
    profile, GPUs per node and its `run` (for each stage's data-parallel step)."""
    from .step import DTYPE_BYTES

    heads = model_heads(cfg.model)
    lay = layout_of(cfg, per_node, heads)
    stages = stage_layers(workload, lay.pp, lay.vpp)
    hidden = hidden_of(workload)
    elem = DTYPE_BYTES[profile.dtype]
    tokens = cfg.micro_batch * cfg.seq_len
    k = cfg.speed_scale
    net = profile.network_for(per_node, k if profile.cpu_cores else 1.0)
    tp_f, tp_fb = tp_layer_comm(lay, tokens, hidden, elem, net, backward=False)
    tp_b, tp_bb = tp_layer_comm(lay, tokens, hidden, elem, net, backward=True)
    across = lay.pp > 1 and cfg.gpus > per_node  # some stage boundary crosses nodes: the network prices all
    send = p2p_time(lay, tokens, hidden, elem, net, across) if lay.pp > 1 else 0.0

    cache: dict = {}
    views: list = []  # dmuon on TP: each distinct stage's DP view of its TP plan (simulator.programs.parallel_dmuon)
    f_s, b_s, first_extra, last_extra, dp_res, tp_s, blocks_of = [], [], [], [], [], [], []
    for s, chunks in enumerate(stages):
        layers = [l for c in chunks for l in c]
        stage_wl, full = _stage_workload(workload, layers, lay.tp, f"{workload.name} stage {s}")
        sig = tuple((p.matrix, p.rows, p.cols, p.count, p.optimizer, p.layer, p.matmuls_per_token,
                     p.attn_width, p.block is None) for p in stage_wl.params)
        if sig not in cache:
            dcfg = _dp_config(cfg, stage_wl, lay, profile, cfg.cost, full)
            r, fc, bc = dp_step(dcfg, run_dp)
            views += [dcfg.plan] if dcfg.plan is not None else []
            cache[sig] = (r, max(0.0, r.forward_s - fc), max(0.0, r.backward_s - bc))
        r, ef, eb = cache[sig]
        dp_res.append(r)
        first_extra.append(ef)
        last_extra.append(eb)
        times = [(a * k, b * k) for a, b in layer_times(stage_wl, profile, cfg.seq_len, cfg.micro_batch,
                                                         per_node, cfg.cpu_threads, lay.tp, lay.sp,
                                                         heads and heads[0], hidden)]
        flops = layer_flops(stage_wl, cfg.seq_len, cfg.micro_batch, profile.attention_causal_fraction)
        score_s = activation_memory_s(profile, cfg.seq_len, cfg.micro_batch, hidden, heads and heads[0],
                                      lay.tp, lay.sp)[2] * k
        is_block = [any(p.block is not None for p in ps) for ps in stage_wl.layer_params()]
        fs, bs, pos, nb = [], [], 0, 0
        for c in chunks:
            idx = range(pos, pos + len(c))
            pos += len(c)
            blocks = sum(is_block[i] for i in idx)
            nb += blocks
            fwd = sum(times[i][0] for i in idx)
            rec = {"none": 0.0, "full": fwd,
                   "selective": sum(flops[i].attention_flops / profile.fwd_flops for i in idx) * k
                   + blocks * score_s}[lay.recompute]
            fs.append(fwd + blocks * tp_f)
            bs.append(sum(times[i][1] for i in idx) + rec + blocks * tp_b)
        f_s.append(fs)
        b_s.append(bs)
        blocks_of.append(nb)
        tp_s.append(nb * lay.microbatches * (tp_f + tp_b))

    pipe = simulate_pipeline(lay.pp, lay.vpp, lay.microbatches, f_s, b_s, send, send, first_extra, last_extra)
    ends = [e + r.optimizer_s for e, r in zip(pipe.end_s, dp_res, strict=True)]
    s_max = max(range(lay.pp), key=lambda s: ends[s])
    r = dp_res[s_max]
    step = ends[s_max]
    fwd = pipe.busy_f_s[s_max]
    m = lay.microbatches
    tp_bytes = blocks_of[s_max] * m * (tp_fb + tp_bb)
    send_bytes = (2 * m * lay.vpp * tokens * hidden * elem / lay.tp) if lay.pp > 1 else 0.0
    settings = dict(dp=lay.dp, microbatches=m,
                    bubble_s=pipe.bubble_s, bubble_fraction=pipe.bubble_s / max(1e-30, pipe.makespan_s
                                                                                  - pipe.bubble_s),
                    tp_comm_s=tp_s[s_max], p2p_send_s=send, slowest_stage=s_max,
                    stage_optimizer_s=[x.optimizer_s for x in dp_res], stage_end_s=list(pipe.end_s))
    notes = list(r.notes) + [
        f"TP x PP x DP: tp={lay.tp}{' + SP' if lay.sp else ''}, pp={lay.pp}, vpp={lay.vpp}, dp={lay.dp}, "
        f"{m} micro-batches of {cfg.micro_batch} sequences, recompute {lay.recompute}; stage {s_max} sets "
        "the "
        f"step; bubble {pipe.bubble_s * 1e3:.1f} ms (simulator.programs.parallel_run)"]
    if lay.tp > 1 and cfg.strategy == "naive":
        notes.append("Muon on TP shards: every TP rank gathers and orthogonalizes each matrix (duplicated)")
    if views:
        from .parallel_dmuon import mode_note

        notes.append("Muon on TP shards: each stage runs dmuon.plan.tp.build_tp_plan's Plan "
                     f"(simulator.programs.parallel_dmuon): {mode_note(views)}")
    return dict(
        workload=workload.name, profile=profile.name, step_s=step, forward_s=fwd,
        backward_s=step - fwd - r.optimizer_s, optimizer_s=r.optimizer_s, grad_sync_tail_s=r.grad_sync_tail_s,
        exposed_comm_s=r.exposed_comm_s + tp_s[s_max],
        exposed_comm_mean_s=r.exposed_comm_mean_s + tp_s[s_max],
        tokens_per_s=lay.dp * m * tokens / step if step > 0 else 0.0,
        comm_bytes_per_rank=r.comm_bytes_per_rank + tp_bytes + send_bytes,
        muon_comm_bytes_per_rank=r.muon_comm_bytes_per_rank, muon_comm_volume=r.muon_comm_volume,
        ns_makespan_s=max(x.ns_makespan_s for x in dp_res),
        ns_busy_max_s=max(x.ns_busy_max_s for x in dp_res),
        plan_balancer=r.plan_balancer, plan_method=r.plan_method, settings=settings,
        provenance=deepcopy(r.provenance),  # r may be cached (dp_step): the caller gets its own
        notes=tuple(notes), step_p90_s=step)
