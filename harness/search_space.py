"""The layouts `harness search` considers: every combination of the parallel dimensions and step settings
that the model, the cluster and the global batch allow, each combination the simulator cannot run (or that
is another one under a second name) dropped with the rule that drops it.

    space = Space(gpus=1024, global_batch=512, seq_len=4096, per_node=8, dims=model_dims(model))
    kept, dropped = enumerate_layouts(space)   # kept: simulate settings (dicts); dropped: (layout, reason)

Dimensions (gpus = tp x pp x dp; ep inside dp):
  strategy    adamw | dmuon | naive
  layout      how dp holds the model (simulator.programs.step.LAYOUTS): fsdp-keep | fsdp-free | hsdp-keep |
              hsdp-free | ddp | sharded
  tp, sp      tensor parallelism (sequence parallelism on top of it)       when the simulator has them
  pp, vpp     pipeline stages, virtual stages per rank (interleaved 1F1B)   when the simulator has them
  ep          expert parallelism (MoE models), inside the data-parallel group
  micro_batch sequences per micro-batch per data-parallel rank; micro-batches per step =
              global_batch / (dp x micro_batch) (gradient accumulation), when the simulator has them
  recompute   none | selective | full activation recomputation              when the simulator has it

Rules (a dropped layout names the first it breaks):
  tp    divides the attention heads, the KV heads (Megatron's query groups), the MLP width and every
        matrix it splits (simulator.programs.parallel.shard), and divides the GPUs per node (TP's all-reduces on
        every layer need NVLink, Narayanan et al. 2021, sec. 3.3)
  sp    only with tp > 1 (it splits TP's all-reduce into all-gather + reduce-scatter)
  pp    divides the decoder layers; pp x vpp divides them (every virtual stage the same number of layers)
  vpp   > 1 only with pp > 1 and micro-batches a multiple of pp (Megatron's interleaved schedule)
  pp    at least pp micro-batches per step (fewer leave a stage idle for the whole step); a stage is at
        most one node or whole nodes
  dp    tp x pp divides the GPU count; dp x micro_batch divides the global batch
  ep    MoE models only; divides the routed experts and dp; an EP group fits a node or spans whole nodes
        (simulator.api.run's rule); not with tp > 1 (expert tensor parallelism is not modelled)
  hsdp  only when the data-parallel group spans several nodes (in one node it is fsdp)
  sharded  dmuon only (adamw and naive run it as fsdp-keep: the same layout twice)
Last, every kept layout passes the simulator's own checks (simulator.api.validate_config and, with tp or
pp, simulator.programs.parallel.layout_of); one that does not is dropped with the simulator's message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from dmuon.errors import InputError

LAYOUTS = ("fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free", "ddp", "sharded")  # simulator.programs.step.LAYOUTS
STRATEGIES = ("adamw", "dmuon", "naive")
RECOMPUTE = ("none", "selective", "full")


def sim_fields() -> frozenset[str]:
    """The SimConfig fields this simulator has (tp, pp, vpp, sp, microbatches, recompute where it has them)."""
    from simulator.api import SimConfig

    return frozenset(f.name for f in fields(SimConfig))


# which SimConfig field each search dimension needs beyond data and expert parallelism
NEEDS = {"tp": "tp", "sp": "sp", "pp": "pp", "vpp": "vpp", "microbatches": "microbatches",
         "recompute": "recompute"}


@dataclass(frozen=True)
class ModelDims:
    """What the rules need from a model: decoder layers, heads, KV heads, MLP widths, routed experts."""

    name: str
    layers: int
    heads: int | None = None
    kv_heads: int | None = None
    mlp_widths: tuple[int, ...] = ()  # intermediate sizes TP splits (dense MLP, experts, shared experts)
    experts: int = 0  # routed experts (0: dense)
    source: str | None = None  # the config.json (None: a catalog workload)


def model_dims(model: str | None = None, workload=None) -> ModelDims:
    """ModelDims of a Hugging Face config.json (`model`: path, folder or shipped name), or of a catalog
    workload (`workload`: only its layer count is known, so tp > 1 is dropped for it)."""
    if model is not None:
        from simulator.models.hf_config import load_model, model_path

        wl = load_model(model)  # validates the config (one clear error for a bad file)
        raw = json.loads(model_path(model).read_text(encoding="utf-8"))
        heads = int(raw["num_attention_heads"])
        kv = int(raw.get("num_key_value_heads") or heads)
        widths = tuple(int(raw[k]) for k in ("intermediate_size", "moe_intermediate_size",
                                             "shared_expert_intermediate_size") if raw.get(k))
        experts = next((int(raw[k]) for k in ("n_routed_experts", "num_experts", "num_local_experts")
                        if raw.get(k)), 0)
        return ModelDims(wl.name, int(raw["num_hidden_layers"]), heads, kv, widths, experts, str(model))
    from simulator.models.workload import resolve_workload

    wl = resolve_workload(workload)
    return ModelDims(wl.name, wl.n_layers)  # no head / expert counts: tp and ep stay 1


def _pow2_upto(n: int) -> tuple[int, ...]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return tuple(out)


@dataclass(frozen=True)
class Space:
    """The search space: fixed settings, then one tuple of candidate values per dimension (None: every
    value the rules allow: powers of two up to the limit, or every strategy / layout / recompute mode)."""

    gpus: int
    global_batch: int  # sequences per optimizer step
    seq_len: int
    per_node: int
    dims: ModelDims
    fixed: dict = field(default_factory=dict)  # other SimConfig settings every row shares (model, gpu, ...)
    strategies: tuple[str, ...] = STRATEGIES
    layouts: tuple[str, ...] = LAYOUTS
    tp: tuple[int, ...] | None = None
    sp: tuple[bool, ...] | None = None  # None: sp on wherever tp > 1 (Megatron's recommendation)
    pp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] | None = None  # None: 1 and 2
    ep: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None
    have: frozenset[str] = field(default_factory=sim_fields)  # SimConfig fields of this simulator


def check_space(space: Space) -> None:
    """InputError for a value no layout can take, or a dimension the simulator does not have."""
    for name, v in (("gpus", space.gpus), ("global_batch", space.global_batch), ("seq_len", space.seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be an integer >= 1, got {v!r}")
    for name, values, accepted in (("strategy", space.strategies, STRATEGIES),
                                   ("layout", space.layouts, LAYOUTS),
                                   ("recompute", space.recompute or (), RECOMPUTE)):
        bad = [v for v in values if v not in accepted]
        if bad:
            raise InputError(f"{name} {bad[0]!r} is not one of {', '.join(accepted)}")
    for name in ("tp", "pp", "vpp", "ep", "micro_batch"):
        values = getattr(space, name)
        bad = [v for v in values or () if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise InputError(f"{name} values must be integers >= 1, got {bad[0]!r}")
    for name, values, plain in (("tp", space.tp, (1,)), ("pp", space.pp, (1,)), ("vpp", space.vpp, (1,)),
                                ("sp", space.sp if space.tp and set(space.tp) != {1} else (), ()),
                                ("recompute", space.recompute, ("none",))):
        if values and set(values) - set(plain) and NEEDS[name] not in space.have:
            raise InputError(f"{name}={sorted(set(values) - set(plain))[0]!r}: this simulator has no "
                             f"{name} (SimConfig has no field {NEEDS[name]!r}); accepted: "
                             f"{' / '.join(map(str, plain)) or 'leave it out'}")


def axis_values(space: Space) -> dict[str, tuple]:
    """Each dimension's candidate values (defaults filled in from the simulator's capabilities)."""
    have = space.have
    d = space.dims
    return {
        "strategy": tuple(space.strategies),
        "tp": space.tp or (_pow2_upto(space.per_node) if "tp" in have else (1,)),
        "pp": space.pp or (_pow2_upto(min(d.layers, space.gpus)) if "pp" in have else (1,)),
        "vpp": space.vpp or ((1, 2) if "vpp" in have else (1,)),
        "sp": space.sp or ((True,) if "sp" in have else (False,)),
        "ep": space.ep or (_pow2_upto(min(d.experts, space.gpus)) if d.experts else (1,)),
        "micro_batch": space.micro_batch or _pow2_upto(space.global_batch),
        "recompute": space.recompute or (RECOMPUTE if "recompute" in have else ("none",)),
        "layout": tuple(space.layouts),
    }


def _tp_rule(tp: int, sp: bool, space: Space) -> str | None:
    d = space.dims
    if space.per_node % tp:
        return f"tp={tp} does not divide the {space.per_node} GPUs per node: TP stays inside a node (NVLink)"
    if tp > 1 and d.heads is None:
        return f"tp={tp}: workload {d.name!r} has no attention head counts (give a config.json model)"
    if tp > 1 and d.heads % tp:
        return f"tp={tp} does not divide the {d.heads} attention heads"
    if tp > 1 and d.kv_heads % tp:
        return f"tp={tp} does not divide the {d.kv_heads} KV heads"
    bad = [w for w in d.mlp_widths if w % tp]
    if bad:
        return f"tp={tp} does not divide the MLP width {bad[0]}"
    if tp > 1 and d.source is not None and "tp" in space.have:
        from simulator.models.hf_config import load_model
        from simulator.programs.parallel import shard

        try:
            for p in load_model(d.source).params:
                shard(p, tp)
        except InputError as e:
            return f"simulator: {e}"
    if sp and tp == 1:
        return "sp needs tp > 1"
    return None


def _pp_rule(pp: int, vpp: int, gpus_left: int, space: Space) -> str | None:
    layers = space.dims.layers
    if gpus_left % pp:
        return f"tp x pp does not divide gpus={space.gpus}"
    stage = space.gpus // pp
    if pp > 1 and stage > space.per_node and stage % space.per_node:
        return f"gpus / pp = {stage} GPUs per stage is not a whole number of {space.per_node}-GPU nodes"
    if vpp > 1 and pp == 1:
        return f"vpp={vpp} needs pp > 1"
    if layers % (pp * vpp):
        return f"pp x vpp = {pp * vpp} does not divide the {layers} decoder layers"
    return None


def _dp_rule(dp: int, mb: int, pp: int, vpp: int, space: Space) -> tuple[int | None, str | None]:
    """(micro-batches per step, None) or (None, the reason this micro-batch size does not fit)."""
    if space.global_batch % (dp * mb):
        return None, f"dp x micro_batch = {dp} x {mb} does not divide the global batch {space.global_batch}"
    m = space.global_batch // (dp * mb)
    if m > 1 and "microbatches" not in space.have:
        return None, (f"needs {m} micro-batches per step (gradient accumulation): this simulator runs one "
                      "(SimConfig has no field 'microbatches')")
    if pp > 1 and m < pp:
        return None, f"{m} micro-batches < pp={pp}: a stage would idle the whole step"
    if vpp > 1 and m % pp:
        return None, f"{m} micro-batches not a multiple of pp={pp} (interleaved schedule)"
    return m, None


def _ep_rule(ep: int, dp: int, tp: int, space: Space) -> str | None:
    d = space.dims
    if ep == 1:
        return None
    if not d.experts:
        return f"ep={ep}: {d.name} has no routed experts"
    if d.experts % ep:
        return f"ep={ep} does not divide the {d.experts} routed experts"
    if dp % ep:
        return f"ep={ep} does not divide dp={dp}"
    if tp > 1:
        return f"ep={ep} with tp={tp}: expert tensor parallelism is not modelled"
    if space.per_node % ep and ep % space.per_node:
        return f"ep={ep}: an EP group must fit a {space.per_node}-GPU node or span whole nodes"
    return None


def _layout_rule(layout: str, strategy: str, dp: int, tp: int, space: Space) -> str | None:
    if layout.startswith("hsdp") and dp * tp <= space.per_node:
        return f"{layout}: dp={dp} fits one node, where hsdp is fsdp"
    if layout == "sharded" and strategy != "dmuon":
        return f"sharded with {strategy} runs as fsdp-keep (the same layout twice)"
    return None


def enumerate_layouts(space: Space) -> tuple[list[dict], list[tuple[dict, str]]]:
    """(kept, dropped): kept = one settings dict per valid layout (SimConfig keys, plus dp and
    global_batch); dropped = (layout, reason) for every combination a rule removes."""
    check_space(space)
    ax = axis_values(space)
    have = space.have
    kept: list[dict] = []
    dropped: list[tuple[dict, str]] = []
    for tp in ax["tp"]:
        for sp in (ax["sp"] if tp > 1 else (False,)):
            point = {"tp": tp, "sp": sp}
            why = _tp_rule(tp, sp, space) or (None if space.gpus % tp == 0 else
                                               f"tp={tp} does not divide gpus={space.gpus}")
            if why:
                dropped.append((point, why))
                continue
            for pp in ax["pp"]:
                for vpp in ax["vpp"]:
                    p2 = {**point, "pp": pp, "vpp": vpp}
                    why = _pp_rule(pp, vpp, space.gpus // tp, space)
                    if why:
                        dropped.append((p2, why))
                        continue
                    dp = space.gpus // (tp * pp)
                    _expand_dp(space, ax, have, {**p2, "dp": dp}, kept, dropped)
    out = []
    heads = None
    if "tp" in have and space.dims.source is not None:
        from simulator.programs.parallel import model_heads

        heads = model_heads(space.dims.source)
    for row in kept:
        why = simulator_reason(row, space.per_node, heads)
        if why:
            dropped.append(({k: row.get(k) for k in LAYOUT_KEYS if k in row}, why))
        else:
            out.append(row)
    return out, dropped


def simulator_reason(row: dict, per_node: int, heads: tuple[int, int] | None) -> str | None:
    """The simulator's own objection to a row (validate_config, and layout_of with tp or pp), or None.
    per_node: GPUs per node; heads: (attention heads, KV heads) of a config.json model, else None."""
    from simulator.api import SimConfig, validate_config

    names = {f.name for f in fields(SimConfig)}
    try:
        cfg = SimConfig(**{k: v for k, v in row.items() if k in names})
        validate_config(cfg)
        if row.get("tp", 1) > 1 or row.get("pp", 1) > 1:
            from simulator.programs.parallel import layout_of

            layout_of(cfg, per_node, heads)
    except InputError as e:
        return f"simulator: {e}"
    return None


def _expand_dp(space, ax, have, p2, kept, dropped) -> None:
    dp, tp, pp, vpp = p2["dp"], p2["tp"], p2["pp"], p2["vpp"]
    for ep in ax["ep"]:
        p3 = {**p2, "ep": ep}
        why = _ep_rule(ep, dp, tp, space)
        if why:
            dropped.append((p3, why))
            continue
        for mb in ax["micro_batch"]:
            p4 = {**p3, "micro_batch": mb}
            m, why = _dp_rule(dp, mb, pp, vpp, space)
            if why:
                dropped.append((p4, why))
                continue
            for strategy in ax["strategy"]:
                for layout in ax["layout"]:
                    p5 = {**p4, "strategy": strategy, "layout": layout}
                    why = _layout_rule(layout, strategy, dp, tp, space)
                    if why:
                        dropped.append((p5, why))
                        continue
                    for rc in ax["recompute"]:
                        kept.append(row_settings(space, {**p5, "recompute": rc, "microbatches": m}, have))


def row_settings(space: Space, p: dict, have: frozenset[str]) -> dict:
    """A layout as the settings of one `simulate` row: the SimConfig keys this simulator has (dimensions
    it lacks are at their plain value by construction), then dp and global_batch (columns only)."""
    gpus = space.gpus
    row = {**space.fixed, "gpus": gpus, "seq_len": space.seq_len, "strategy": p["strategy"],
           "layout": p["layout"], "micro_batch": p["micro_batch"], "ep": p["ep"]}
    for k in ("tp", "sp", "pp", "vpp", "microbatches", "recompute"):
        if NEEDS[k] in have:
            row[k] = p[k]
    row.update(dp=p["dp"], global_batch=space.global_batch)
    return row


LAYOUT_KEYS = ("strategy", "tp", "sp", "pp", "vpp", "dp", "ep", "layout", "micro_batch", "microbatches",
               "recompute")


def describe(row: dict) -> str:
    """'tp8 pp4 vpp2 dp32 fsdp-keep mb1x16 full' (the parts that are not plain)."""
    parts = []
    for k, tag in (("tp", "tp"), ("pp", "pp"), ("vpp", "vpp"), ("dp", "dp"), ("ep", "ep")):
        v = row.get(k, 1)
        if v not in (None, 1) or k == "dp":
            parts.append(f"{tag}{v}")
    if row.get("sp"):
        parts.append("sp")
    parts.append(str(row.get("layout")))
    parts.append(f"mb{row.get('micro_batch')}x{row.get('microbatches', 1)}")
    if row.get("recompute", "none") != "none":
        parts.append(f"rc-{row['recompute']}")
    return " ".join(parts)


__all__ = ["LAYOUTS", "LAYOUT_KEYS", "ModelDims", "RECOMPUTE", "STRATEGIES", "Space", "axis_values",
           "check_space", "describe", "enumerate_layouts", "model_dims", "row_settings", "sim_fields"]
