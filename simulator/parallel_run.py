"""One training step of a TP x PP x DP job (`SimConfig.tp`, `pp`, `vpp`, `sp`, `microbatches`, `recompute`).

How the step is composed (simulator.parallel: layout, shards, TP and stage-to-stage communication;
simulator.pipeline: the schedule):
  1. the workload's transformer blocks split into pp x vpp chunks (embeddings on the first stage, final norm
     and head on the last); every parameter is cut to its TP shard (Megatron's column / row split);
  2. per stage, one micro-batch's forward and backward of each chunk: the shard's compute (simulator.compute,
     so FLOPs / tp), plus the layer's TP collectives on NVLink on the critical path, plus recomputation
     (full: the forward again in backward; selective: the attention core again, Korthikanti et al. 2022);
  3. per stage, the data-parallel part (gathers, gradient reductions, the optimizer with its exchanges) is
     today's step program (simulator.step) over the stage's DP group: gpus / (tp pp) ranks with the shard's
     parameters, gpus_per_node / tp of them per node, each getting 1 / tp of the node's NICs (the tp DP
     groups of a node run at once), computing one micro-batch. Its exposed forward communication (beyond
     that micro-batch's compute) is added to the stage's first forward, its exposed backward communication
     to its last backward (FSDP with PP gathers once per step and reduces after the last micro-batch, as
     torchtitan runs it with reshard_after_forward=False); its optimizer time (gradient-reduction tail,
     Muon's exchanges and NS, AdamW) follows the stage's last backward;
  4. the pipeline schedule runs every micro-batch; the step ends when the slowest stage's optimizer ends.
Muon on TP shards (naive and dmuon): a TP-split matrix must be orthogonalized whole. dmuon: the mode
dmuon.plan.tp picks per matrix (TP-group distributed NS, or gather to one TP owner, NS, scatter back), priced
by its price_tp_modes on this profile's NVLink, a gathered matrix's time spread evenly over the tp ranks
(ASSUMPTION: a TP group's matrices balance over its ranks, as build_tp_plan's LPT share does); the DP
share of the matrices over the TP groups is the stage's DMuon plan over its DP ranks. naive: duplicated,
every TP rank all-gathers the matrix over NVLink and orthogonalizes it whole. Both enter the step programs
as the shard's NS time (`TPCost`), so they run where NS runs.
With tp = pp = 1, one micro-batch and no recomputation, simulator.api.run runs today's step unchanged.
"""

from __future__ import annotations

from dataclasses import replace

from dmuon.errors import InputError
from dmuon.plan.cost import CostAnswer

from .compute import activation_memory_s, layer_flops, layer_times
from .parallel import (hidden_of, layout_of, model_heads, p2p_time, stage_layers, stage_workload,
                       tp_layer_comm)
from .pipeline import simulate_pipeline


class TPCost:
    """A cost table whose NS time of a TP shard is its whole matrix's, in the mode the runtime runs it,
    priced by dmuon.plan.tp.price_tp_modes on the simulator's NVLink (simulator.split_links): dmuon the
    mode of fewer rank-seconds (`TPModePrice.best`, as build_tp_plan picks it): group (every TP rank runs
    the distributed Gram NS: group_s each) or gather (one owner: gather + NS + scatter, spread over the tp
    ranks: / tp); naive duplicated (every TP rank all-gathers and runs the whole NS). A batch of b same-shape
    shards: gather / duplicated run one batched NS of b whole matrices and b gathers, group b calls.
    Everything else is `base`'s."""

    def __init__(self, base, full: dict, tp: int, links, elem_bytes: int, duplicated: bool):
        self.base, self.full, self.tp, self.links = base, full, tp, links
        self.elem_bytes, self.duplicated = elem_bytes, duplicated
        self.modes: dict = {}  # whole (rows, cols) -> the mode dmuon picks (provenance, tests)
        self.name = f"{getattr(base, 'name', type(base).__name__)} + TP{tp} " + (
            "duplicated" if duplicated else "modes of dmuon.plan.tp")

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
        if self.duplicated:
            return CostAnswer(a.time_s + batch * (price.duplicated_s - price.ns_s), a.measured,
                              f"{a.detail}; whole {R}x{C} on every TP rank + TP all-gather (duplicated)")
        mode = self.modes[(R, C)] = price.best(self.tp)
        if mode == "group":
            return CostAnswer(batch * price.group_s, a.measured,
                              f"TP-group distributed NS of the whole {R}x{C} (dmuon.plan.tp)")
        return CostAnswer((a.time_s + batch * price.gather_comm_s) / self.tp, a.measured,
                          f"{a.detail}; whole {R}x{C} gathered to one of {self.tp} TP ranks, scattered back, "
                          "/ tp (dmuon.plan.tp)")


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
    if lay.tp > 1 and cfg.strategy in ("naive", "dmuon") and full:
        from .costs import load_cost

        base = cost if cost is not None else load_cost(profile.cost_profiles)
        from .split_links import SimulatorLinks
        from .step import DTYPE_BYTES

        links = SimulatorLinks(profile.network, lay.per_node, source=f"simulator profile {profile.name}")
        cost = TPCost(base, _shard_shapes(stage_wl, full), lay.tp, links,
                      DTYPE_BYTES[cfg.grad_comm_dtype or profile.dtype], cfg.strategy == "naive")
    # the stage's compute is parallel_run's (with the profile's memory-bound passes, which need the model's
    # heads); the DP step's own layer times only set how much of its communication they hide
    dp_profile = replace(dp_profile, activation_rw_passes=0.0)
    return replace(cfg, workload=stage_wl, model=None, per_head=False, gpus=lay.dp,
                   gpus_per_node=lay.dp_per_node, gpu=dp_profile, cluster=None, nic_gbps=None,
                   overlap_slowdown=None, cost=cost, tp=1, pp=1, vpp=1, sp=False, microbatches=None,
                   recompute="none")


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
    modes: dict = {}  # dmuon on TP: whole shape -> the mode dmuon.plan.tp picks
    f_s, b_s, first_extra, last_extra, dp_res, tp_s, blocks_of = [], [], [], [], [], [], []
    for s, chunks in enumerate(stages):
        layers = [l for c in chunks for l in c]
        stage_wl, full = stage_workload(workload, layers, lay.tp, f"{workload.name} stage {s}")
        sig = tuple((p.matrix, p.rows, p.cols, p.count, p.optimizer, p.layer, p.matmuls_per_token,
                     p.attn_width, p.block is None) for p in stage_wl.params)
        if sig not in cache:
            dcfg = _dp_config(cfg, stage_wl, lay, profile, cfg.cost, full)
            r, built = run_dp(dcfg, all_ranks=False)
            modes.update(getattr(dcfg.cost, "modes", {}))
            fc, bc = sum(built.spec.layer_fwd_s), sum(built.spec.layer_bwd_s)
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
        f"step; bubble {pipe.bubble_s * 1e3:.1f} ms (simulator.parallel_run)"]
    if lay.tp > 1 and cfg.strategy in ("naive", "dmuon"):
        notes.append("Muon on TP shards: " + ("every TP rank gathers and orthogonalizes each matrix "
                                             "(duplicated)"
                                             if cfg.strategy == "naive" else
                                             "the mode dmuon.plan.tp picks per shape: " + ", ".join(
                                                 f"{R}x{C} {k}" for (R, C), k in sorted(modes.items()))
                                             + " (ASSUMPTION: a TP group's matrices balance over its ranks)"))
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
        plan_balancer=r.plan_balancer, plan_method=r.plan_method, settings=settings, provenance=r.provenance,
        notes=tuple(notes), step_p90_s=step)
