"""Tensor, sequence and pipeline parallelism: the layout of a TP x PP x DP job, its checks, the TP shards
of a workload, the pipeline stages, and the TP / stage-to-stage communication of one micro-batch.

Rank order (Megatron-LM's `initialize_model_parallel`: TP fastest, then DP, then PP): a stage holds
gpus / pp consecutive GPUs; a TP group is tp consecutive GPUs of one node (NVLink); the DP group of one
(stage, TP index) is every tp-th GPU of the stage, so each node holds gpus_per_node / tp of its ranks and
the node's NICs carry the tp DP groups of its GPUs at once (each gets 1 / tp of them).

TP shards (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3): column-parallel matrices (q, k, v,
gate, up, fc1, the vocabulary-parallel embedding and output head) keep rows / tp; row-parallel ones (o,
down, fc2, dense) keep cols / tp; norm weights and biases of row-parallel layers are replicated.

TP communication per transformer layer and micro-batch, B = micro_batch x seq_len x hidden x bytes
(Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2: "tensor parallelism requires four all-reduces
in a single forward and backward pass whereas tensor together with sequence parallelism requires four
all-gathers and four reduce-scatters"): forward 2 all-reduces of B (after attention, after the MLP),
backward 2; with sequence parallelism each all-reduce is an all-gather + a reduce-scatter of B (the same
bytes). Full recomputation re-runs the forward in backward, its 2 all-reduces included. These collectives
sit between dependent matmuls: they are on the critical path (Narayanan et al. 2021, arXiv:2104.04473,
Sec. 3.3: tensor-parallel all-reduces "on the critical path"), so each adds to its layer's time.

Stage-to-stage sends: each micro-batch's activation (micro_batch x seq_len x hidden x bytes) forward and
its gradient backward, point to point; with tp > 1 each TP rank sends 1 / tp of it and the next stage
all-gathers it over NVLink (Narayanan et al. 2021, Sec. 4.1, scatter/gather optimisation). Priced as
base latency + one network step + bytes / (the node's NICs x inter efficiency / GPUs per node): every
GPU of a node sends at once. Inside one node (a stage smaller than a node): NVLink's broadcast curve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from dmuon.errors import InputError, choice_error

from .collectives import Group, bytes_per_rank, collective_time_s
from .workload_spec import ParamSpec, Workload

RECOMPUTE = ("none", "selective", "full")
# row-parallel matrix kinds (input dimension split): Megatron's RowParallelLinear layers
ROW_PARALLEL = ("o_proj", "down_proj", "dense", "c_proj", "out_proj", "wo", "w2", "fc2", "dense_4h_to_h")


@dataclass(frozen=True)
class Layout:
    """Resolved degrees of one TP x PP x DP job."""

    tp: int
    pp: int
    vpp: int
    dp: int  # data-parallel ranks of one (stage, TP index)
    microbatches: int
    sp: bool
    recompute: str
    per_node: int  # GPUs per node

    @property
    def dp_per_node(self) -> int:
        """DP ranks of one TP index on one node (its DP group's ranks per node)."""
        return min(self.dp, max(1, self.per_node // self.tp))


def default_microbatches(pp: int) -> int:
    """SimConfig.microbatches=None: 1 without PP (no gradient accumulation), else 4 x pp (a default, not a
    measurement: the 1F1B bubble is then (pp - 1) / (4 pp) of the ideal time; set it for your batch)."""
    return 1 if pp == 1 else 4 * pp


def is_parallel(cfg) -> bool:
    """True when `cfg` asks for more than today's data-parallel step (tp, pp, micro-batches, recompute)."""
    return (cfg.tp, cfg.pp, cfg.vpp) != (1, 1, 1) or cfg.sp or cfg.microbatches not in (None, 1) \
        or cfg.recompute != "none"


def _int(name: str, v, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {v!r}")


def check_fields(cfg) -> None:
    """The parallelism fields alone (simulator.api.validate_config calls it)."""
    for name in ("tp", "pp", "vpp"):
        _int(name, getattr(cfg, name))
    if cfg.microbatches is not None:
        _int("microbatches", cfg.microbatches)
    if not isinstance(cfg.sp, bool):
        raise InputError(f"sp must be true or false, got {cfg.sp!r}")
    if cfg.recompute not in RECOMPUTE:
        raise choice_error("recompute", cfg.recompute, RECOMPUTE)
    if cfg.sp and cfg.tp == 1:
        raise InputError("sp (sequence parallelism) splits the TP group's activations; accepted: sp with "
                         "tp > 1")
    if cfg.vpp > 1 and cfg.pp == 1:
        raise InputError(f"vpp={cfg.vpp} interleaves pipeline stages; accepted: vpp=1 or pp > 1")
    m = default_microbatches(cfg.pp) if cfg.microbatches is None else cfg.microbatches
    if cfg.pp > 1 and m < cfg.pp:
        raise InputError(f"microbatches={m} < pp={cfg.pp}: 1F1B needs at least pp micro-batches; accepted: "
                         f"microbatches >= {cfg.pp}")
    if cfg.vpp > 1 and m % cfg.pp:
        raise InputError(f"pp={cfg.pp} does not divide microbatches={m}: the interleaved schedule runs "
                         "micro-batches in groups of pp; accepted: a multiple of pp")
    if cfg.tp > 1 and cfg.ep > 1:
        raise InputError("tp > 1 with ep > 1 is not modelled (expert tensor parallelism); accepted: tp=1 "
                         "with ep, or ep=1 with tp")
    if (cfg.tp > 1 or cfg.pp > 1) and cfg.plan is not None:
        raise InputError("a given plan is for a data-parallel step; accepted: plan=None with tp or pp > 1 "
                         "(each stage's plan is built)")


def layout_of(cfg, per_node: int, heads: tuple[int, int] | None) -> Layout:
    """The Layout of `cfg` on nodes of `per_node` GPUs; InputError naming what must divide what.
    heads: (attention heads, KV heads) of a config.json model, else None."""
    tp, pp = cfg.tp, cfg.pp
    if per_node % tp:
        raise InputError(f"tp={tp} does not divide the {per_node} GPUs per node; accepted: a divisor of "
                         f"{per_node} (TP runs on NVLink inside a node)")
    if cfg.gpus % (tp * pp):
        raise InputError(f"tp x pp = {tp * pp} does not divide gpus={cfg.gpus}; accepted: gpus a multiple "
                         "of tp x pp")
    dp = cfg.gpus // (tp * pp)
    stage = cfg.gpus // pp
    if pp > 1 and stage > per_node and stage % per_node:
        raise InputError(f"gpus / pp = {stage} GPUs per stage is not a whole number of {per_node}-GPU nodes; "
                         f"accepted: gpus / pp a multiple of {per_node} or at most {per_node}")
    if cfg.ep > 1 and dp % cfg.ep:
        raise InputError(f"ep={cfg.ep} does not divide the data-parallel size gpus / (tp x pp) = {dp}; "
                         "accepted: a divisor of it")
    if heads is not None and tp > 1:
        for what, n in zip(("attention heads", "KV heads"), heads, strict=True):
            if n % tp:
                raise InputError(f"tp={tp} does not divide the model's {n} {what}; accepted: a divisor of "
                                 f"{n}")
    m = default_microbatches(pp) if cfg.microbatches is None else cfg.microbatches
    return Layout(tp, pp, cfg.vpp, dp, m, cfg.sp, cfg.recompute, per_node)


def model_heads(model) -> tuple[int, int] | None:
    """(attention heads, KV heads) from a config.json model's file, or None (catalog workloads)."""
    if model is None:
        return None
    from .hf_config import model_path

    path = model_path(model)
    if path is None:
        return None
    raw = json.loads(path.read_text())
    raw = raw.get("text_config", raw) if "num_attention_heads" not in raw else raw
    h = raw.get("num_attention_heads") or raw.get("n_head")
    if not isinstance(h, int):
        return None
    kv = raw.get("num_key_value_heads") or h
    return h, kv


# ---- TP shards ------------------------------------------------------------------------------------
def _row_parallel(p: ParamSpec) -> bool:
    return p.matrix.split(".")[-1] in ROW_PARALLEL or p.matrix.split(".")[0] in ROW_PARALLEL


def shard(p: ParamSpec, tp: int) -> tuple[ParamSpec, tuple[int, int] | None]:
    """(p's TP shard, the full (rows, cols) of each of its matrices, None where p is replicated)."""
    if tp == 1:
        return p, None
    vector = p.matmuls_per_token == 0 and (p.rows == 1 or p.cols == 1)
    if vector and (p.matrix.endswith(".bias") and not _row_parallel(p)):  # a column-parallel bias is split
        n = p.rows * p.cols
        if n % tp:
            raise InputError(f"tp={tp} does not divide {p.name} ({n} elements); accepted: a divisor of it")
        return replace(p, cols=p.cols // tp if p.cols > 1 else 1,
                       rows=p.rows // tp if p.rows > 1 else 1), None
    if vector:
        return p, None  # norm weights, row-parallel biases: replicated
    rows, cols = p.rows, p.cols
    if _row_parallel(p):
        if cols % tp:
            raise InputError(f"tp={tp} does not divide {p.name}'s {cols} columns (row-parallel); accepted: a "
                             f"divisor of {cols}")
        cols //= tp
    else:
        if rows % tp:
            raise InputError(f"tp={tp} does not divide {p.name}'s {rows} rows (column-parallel); accepted: "
                             f"a divisor of {rows}")
        rows //= tp
    return replace(p, rows=rows, cols=cols, attn_width=p.attn_width / tp), (p.rows, p.cols)


# ---- pipeline stages ------------------------------------------------------------------------------
def stage_layers(workload: Workload, pp: int, vpp: int) -> list[list[list[int]]]:
    """Per stage, its model chunks (vpp of them, in schedule order), each a list of global layer indices.
    The transformer blocks (layers holding a ParamSpec with a block index) split into pp x vpp equal chunks
    (or, where only blocks + 2 divides, the first and last one layer fewer), chunk c on stage c mod pp
    (Megatron's interleaving); layers before the first block (embeddings) join
    the first chunk, layers after the last (final norm, head) the last chunk."""
    layers = workload.layer_params()
    blocks = [i for i, ps in enumerate(layers) if any(p.block is not None for p in ps)]
    chunks = pp * vpp
    if not blocks:
        raise InputError(f"workload {workload.name!r} has no transformer blocks to split into pipeline "
                         "stages; "
                         "accepted: pp=1")
    n = len(blocks)
    if n % chunks == 0:
        sizes = [n // chunks] * chunks
    elif chunks > 2 and (n + 2) % chunks == 0:
        # one layer fewer on the first and the last chunk, where the embedding and the head sit: Llama 3's
        # 126 layers on 16 stages (Dubey et al. 2024, arXiv:2407.21783, Sec. 3.3.2: "we reduce one
        # Transformer layer each from the first and the last stages"; Megatron-LM's
        # --decoder-first/last-pipeline-num-layers)
        sizes = [(n + 2) // chunks - 1] + [(n + 2) // chunks] * (chunks - 2) + [(n + 2) // chunks - 1]
    else:
        raise InputError(f"pp x vpp = {chunks} does not divide the {n} transformer layers (nor {n} + 2, "
                         f"one fewer on the first and last stage); accepted: pp x vpp a divisor of {n} or "
                         f"of {n + 2}")
    cuts = [sum(sizes[:i]) for i in range(chunks + 1)]
    parts = [blocks[cuts[i]:cuts[i + 1]] for i in range(chunks)]
    parts[0] = list(range(blocks[0])) + parts[0]
    parts[-1] = parts[-1] + list(range(blocks[-1] + 1, len(layers)))
    return [[parts[k * pp + s] for k in range(vpp)] for s in range(pp)]


def stage_workload(workload: Workload, layers: list[int], tp: int, name: str) -> tuple[Workload, dict]:
    """The TP shard of the params of `layers` (renumbered 0..), and {param name: full (rows, cols)} of its
    TP-split matrices."""
    where = {l: i for i, l in enumerate(layers)}
    params, full = [], {}
    for p in workload.params:
        if p.layer in where:
            q, f = shard(replace(p, layer=where[p.layer]), tp)
            params.append(q)
            if f is not None:
                full[q.name] = f
    return Workload(name=name, params=tuple(params), notes=workload.notes, source=workload.source), full


def hidden_of(workload: Workload) -> int:
    """The model width: the input width of the first block's first Muon / AdamW matrix that multiplies."""
    for p in workload.params:
        if p.block is not None and p.matmuls_per_token > 0 and p.rows > 1 and p.cols > 1:
            return p.cols
    raise InputError(f"workload {workload.name!r}: no transformer block matrix to read the hidden size from")


# ---- communication of one micro-batch -------------------------------------------------------------
def tp_layer_comm(lay: Layout, tokens: int, hidden: int, elem_bytes: int, net,
                  backward: bool) -> tuple[float, float]:
    """(seconds, bytes each rank sends) of one transformer layer's TP collectives for one micro-batch of
    `tokens` tokens, forward or backward (module docstring)."""
    if lay.tp == 1:
        return 0.0, 0.0
    size = tokens * hidden * elem_bytes
    g = Group(1, lay.tp)
    n = 2 + (2 if backward and lay.recompute == "full" else 0)
    if lay.sp:
        t = sum(collective_time_s(k, size, g, net, nccl=True) for k in ("all_gather", "reduce_scatter"))
        b = sum(bytes_per_rank(k, size, lay.tp) for k in ("all_gather", "reduce_scatter"))
    else:
        t = collective_time_s("all_reduce", size, g, net, nccl=True)
        b = bytes_per_rank("all_reduce", size, lay.tp)
    return n * t, n * b


def p2p_time(lay: Layout, tokens: int, hidden: int, elem_bytes: int, net, across_nodes: bool) -> float:
    """Seconds of one stage-to-stage send of a micro-batch's activation (or its gradient) (module
    docstring)."""
    size = tokens * hidden * elem_bytes / lay.tp
    if not across_nodes:
        return collective_time_s("broadcast", size, Group(1, 2), net, nccl=True)
    t = net.base_latency_s + net.inter_alpha_s + size / (net.nic_Bps_per_node * net.inter_efficiency
                                                         / lay.per_node)
    if lay.tp > 1:  # the receiving stage all-gathers the 1/tp pieces over NVLink
        t += collective_time_s("all_gather", size * lay.tp, Group(1, lay.tp), net, nccl=True)
    return t
