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
Muon on TP shards (naive and dmuon): a TP-split matrix must be orthogonalized whole. dmuon: the runtime's
gather-to-one-TP-owner mode (the TP group gathers each matrix its DP owner owns to one of its tp ranks, NS
there, scatters back): priced as the full matrix's NS plus a gather and a scatter of it over NVLink, spread
evenly over the tp ranks (ASSUMPTION: a TP group's matrices balance over its ranks). naive: duplicated,
every TP rank all-gathers the matrix over NVLink and orthogonalizes it whole. Both enter the step programs
as the shard's NS time (`TPCost`), so they run where NS runs.
With tp = pp = 1, one micro-batch and no recomputation, simulator.api.run runs today's step unchanged.
"""

from __future__ import annotations

from dataclasses import replace

from dmuon.errors import InputError
from dmuon.plan.cost import CostAnswer

from .collectives import Group, collective_time_s
from .compute import layer_flops, layer_times
from .parallel import (hidden_of, layout_of, model_heads, p2p_time, stage_layers, stage_workload,
                       tp_layer_comm)
from .pipeline import simulate_pipeline


class TPCost:
    """A cost table whose NS time of a TP shard is that of the whole matrix, as naive and dmuon run it on
    a TP group (module docstring); everything else is `base`'s."""

    def __init__(self, base, full: dict, tp: int, net, elem_bytes: int, duplicated: bool):
        self.base, self.full, self.tp, self.net = base, full, tp, net
        self.elem_bytes, self.duplicated = elem_bytes, duplicated
        self.name = f"{getattr(base, 'name', type(base).__name__)} + TP{tp} " + (
            "duplicated" if duplicated else "gather-to-owner")

    def __getattr__(self, k):
        return getattr(self.base, k)

    def ns_time(self, rows: int, cols: int, batch: int = 1, *args, **kw) -> CostAnswer:
        whole = self.full.get((rows, cols))
        if whole is None:  # a replicated matrix: as today
            return self.base.ns_time(rows, cols, batch, *args, **kw)
        a = self.base.ns_time(whole[0], whole[1], batch, *args, **kw)
        size = whole[0] * whole[1] * batch * self.elem_bytes
        g = Group(1, self.tp)
        ag = collective_time_s("all_gather", size, g, self.net, nccl=True)
        if self.duplicated:  # every TP rank gathers and orthogonalizes the whole matrix
            return CostAnswer(a.time_s + ag, a.measured, f"{a.detail}; x1 on every TP rank + TP all-gather")
        return CostAnswer((a.time_s + 2 * ag) / self.tp, a.measured,
                          f"{a.detail}; gather to one of {self.tp} TP ranks, scatter back, /tp")


def _shard_shapes(stage_wl, full: dict) -> dict:
    """{shard (rows, cols): whole (rows, cols)} of the stage's TP-split Muon matrices, both orientations;
    InputError if one shard shape stands for two whole shapes (the cost table is asked by shape)."""
    out: dict = {}
    for p in stage_wl.params:
        if p.optimizer != "muon" or p.name not in full:
            continue
        R, C = full[p.name]
        for k, v in (((p.rows, p.cols), (R, C)), ((p.cols, p.rows), (C, R))):
            if out.setdefault(k, v) != v:
                raise InputError(f"TP shards of shape {k[0]}x{k[1]} come from matrices {out[k][0]}x{out[k][1]} "
                                 f"and {v[0]}x{v[1]}; not modelled: accepted: another tp")
    return out


def _dp_config(cfg, stage_wl, lay, profile, cost, full):
    from .api import SimConfig

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
        from .step import DTYPE_BYTES

        cost = TPCost(base, _shard_shapes(stage_wl, full), lay.tp, profile.network,
                      DTYPE_BYTES[cfg.grad_comm_dtype or profile.dtype], cfg.strategy == "naive")
    return replace(cfg, workload=stage_wl, model=None, per_head=False, gpus=lay.dp,
                   gpus_per_node=lay.dp_per_node, gpu=dp_profile, cluster=None, nic_gbps=None,
                   overlap_slowdown=None, cost=cost, tp=1, pp=1, vpp=1, sp=False, microbatches=None,
                   recompute="none")


def run_parallel(cfg):
    """(SimResult, None) of a TP x PP x DP step (module docstring); cfg validated by simulator.api."""
    from .api import SimResult, asdict_shallow, node_shape, profile_of
    from .api import run as run_dp
    from .step import DTYPE_BYTES
    from .workload import resolve_workload

    workload = resolve_workload(cfg.workload, cfg.model, cfg.per_head)
    profile = profile_of(cfg)
    per_node_cap = cfg.gpus_per_node or profile.gpus_per_node
    nodes, per_node = node_shape(cfg.gpus, per_node_cap)
    lay = layout_of(cfg, per_node, model_heads(cfg.model))
    stages = stage_layers(workload, lay.pp, lay.vpp)
    hidden = hidden_of(workload)
    elem = DTYPE_BYTES[profile.dtype]
    tokens = cfg.micro_batch * cfg.seq_len
    k = cfg.speed_scale
    net = profile.network_for(per_node, k if profile.cpu_cores else 1.0)
    tp_f, tp_fb = tp_layer_comm(lay, tokens, hidden, elem, net, backward=False)
    tp_b, tp_bb = tp_layer_comm(lay, tokens, hidden, elem, net, backward=True)
    across = lay.pp > 1 and cfg.gpus // lay.pp >= per_node
    send = p2p_time(lay, tokens, hidden, elem, net, across) if lay.pp > 1 else 0.0

    cache: dict = {}
    f_s, b_s, first_extra, last_extra, dp_res, tp_s, blocks_of = [], [], [], [], [], [], []
    for s, chunks in enumerate(stages):
        layers = [l for c in chunks for l in c]
        stage_wl, full = stage_workload(workload, layers, lay.tp, f"{workload.name} stage {s}")
        sig = tuple((p.matrix, p.rows, p.cols, p.count, p.optimizer, p.layer, p.matmuls_per_token,
                     p.attn_width, p.block is None) for p in stage_wl.params)
        if sig not in cache:
            r, built = run_dp(_dp_config(cfg, stage_wl, lay, profile, cfg.cost, full), all_ranks=False)
            fc, bc = sum(built.spec.layer_fwd_s), sum(built.spec.layer_bwd_s)
            cache[sig] = (r, max(0.0, r.forward_s - fc), max(0.0, r.backward_s - bc))
        r, ef, eb = cache[sig]
        dp_res.append(r)
        first_extra.append(ef)
        last_extra.append(eb)
        times = [(a * k, b * k) for a, b in layer_times(stage_wl, profile, cfg.seq_len, cfg.micro_batch,
                                                         per_node, cfg.cpu_threads)]
        flops = layer_flops(stage_wl, cfg.seq_len, cfg.micro_batch)
        is_block = [any(p.block is not None for p in ps) for ps in stage_wl.layer_params()]
        fs, bs, pos, nb = [], [], 0, 0
        for c in chunks:
            idx = range(pos, pos + len(c))
            pos += len(c)
            blocks = sum(is_block[i] for i in idx)
            nb += blocks
            fwd = sum(times[i][0] for i in idx)
            rec = {"none": 0.0, "full": fwd,
                   "selective": sum(flops[i].attention_flops / profile.fwd_flops for i in idx) * k}[lay.recompute]
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
    settings = {k2: v for k2, v in asdict_shallow(cfg).items() if k2 not in ("workload", "plan", "cost", "gpu")}
    settings.update(nodes=nodes, ranks_per_node=per_node, dp=lay.dp, microbatches=m,
                    bubble_s=pipe.bubble_s, bubble_fraction=pipe.bubble_s / max(1e-30, pipe.makespan_s
                                                                                  - pipe.bubble_s),
                    tp_comm_s=tp_s[s_max], p2p_send_s=send, slowest_stage=s_max,
                    stage_optimizer_s=[x.optimizer_s for x in dp_res], stage_end_s=list(pipe.end_s))
    notes = list(r.notes) + [
        f"TP x PP x DP: tp={lay.tp}{' + SP' if lay.sp else ''}, pp={lay.pp}, vpp={lay.vpp}, dp={lay.dp}, "
        f"{m} micro-batches of {cfg.micro_batch} sequences, recompute {lay.recompute}; stage {s_max} sets the "
        f"step; bubble {pipe.bubble_s * 1e3:.1f} ms (simulator.parallel_run)"]
    if lay.tp > 1 and cfg.strategy in ("naive", "dmuon"):
        notes.append("Muon on TP shards: " + ("every TP rank gathers and orthogonalizes each matrix (duplicated)"
                                             if cfg.strategy == "naive" else
                                             "gather to one TP owner, NS, scatter back (ASSUMPTION: a TP "
                                             "group's matrices balance over its ranks)"))
    result = SimResult(
        workload=workload.name, gpus=cfg.gpus, gpus_per_node=per_node_cap, strategy=cfg.strategy,
        layout=cfg.layout, profile=profile.name, step_s=step, forward_s=fwd,
        backward_s=step - fwd - r.optimizer_s, optimizer_s=r.optimizer_s, grad_sync_tail_s=r.grad_sync_tail_s,
        exposed_comm_s=r.exposed_comm_s + tp_s[s_max], exposed_comm_mean_s=r.exposed_comm_mean_s + tp_s[s_max],
        tokens_per_s=lay.dp * m * tokens / step if step > 0 else 0.0,
        comm_bytes_per_rank=r.comm_bytes_per_rank + tp_bytes + send_bytes,
        muon_comm_bytes_per_rank=r.muon_comm_bytes_per_rank, muon_comm_volume=r.muon_comm_volume,
        ns_makespan_s=max(x.ns_makespan_s for x in dp_res), ns_busy_max_s=max(x.ns_busy_max_s for x in dp_res),
        plan_balancer=r.plan_balancer, plan_method=r.plan_method, settings=settings, provenance=r.provenance,
        notes=tuple(notes), step_p90_s=step)
    return result, None
