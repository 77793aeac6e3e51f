"""Memory per rank of one training step: a breakdown and the peak over the step (`breakdown`, called by
simulator.api.memory_of).

What a rank holds (bytes; n = a parameter's elements, S = its shard group: fsdp-* and sharded all
data-parallel ranks, hsdp-* the ranks of a node, ddp 1; expert parameters: n / ep over S / ep ranks;
with tensor / pipeline parallelism (`tp`, `pp` where the config has them) every parameter / (tp pp)):

  parameters      master weights in `param_dtype` (default fp32, FSDP2 mixed precision's sharded
                  parameter): n / S; DMuon's owner layouts (fsdp-*, hsdp-*, ddp: the Muon matrices stay
                  outside FSDP2, `dmuon.runtime` fsdp2-owner / replicated) every Muon matrix whole (keep);
                  memory 'free' layouts only the owned ones plus the two units in use (param_copies)
  gradients       FSDP / HSDP / sharded: n / S in param_dtype (FSDP2 keeps sharded gradients in the
                  parameter's dtype); ddp and DMuon's owner-layout Muon matrices: n (every rank computes the
                  whole gradient before it is reduced; the FSDP2 owner layouts drop it once packed into
                  the unit's buffer, `consume_grads`: one layer's in flight)
  optimizer       AdamW: 2 moments (exp_avg, exp_avg_sq) of its parameters' local elements, fp32;
                  DMuon's ddp layout updates AdamW parameters in 1/N pieces (`shard_adamw`): their moments / N;
                  Muon momentum (fp32): naive and sharded on the local shard (n / S), DMuon owner layouts
                  on the owner only (`plan.owners`: the rank's owned elements; summed over the ranks they
                  are the whole momentum once); adamw strategy: the Muon matrices on AdamW (2 moments)
  param_copies    compute-dtype copies the forward / backward read: FSDP keep every layer's gathered
                  parameters after forward (FSDP2 reshard_after_forward=False), free the root unit
                  (embeddings, head, final norm: FSDP2 never reshards the root after forward) and two
                  blocks (the one running and one prefetched); DMuon 'free' two owner units; ddp / owner layouts with a
                  param_dtype wider than the compute dtype: autocast's casts of every weight, saved for
                  backward
  activations     `simulator.models.memory_activations.activation_bytes` (Korthikanti et al. 2022's count per
                  layer, any recompute, TP / SP, PP in-flight micro-batches, the output layer and fp32 loss)
  comm_buckets    the runtime's exchange buffers (`dmuon.runtime.units`): ddp one persistent flat buffer per
                  unit over every parameter it reduces (grad_comm_dtype; DMuon's units a second one it
                  publishes from, param_comm_dtype); the FSDP2 owner layouts' DMuon units are transient
                  (`build_units`: transient=True): a unit's buffers live while it is in flight, and each
                  rank keeps its owned chunk of the summed gradients (the reduce job's result, grad_comm_dtype)
                  until the next step's reduction; the publications (every Muon matrix, param_comm_dtype)
                  follow the rank's NS in the optimizer phase. Plus FSDP2's reduction in flight (torch's
                  `_fsdp_collectives.foreach_reduce`: a unit's unsharded gradients, compute dtype, copied
                  into the reduce-scatter input, grad_comm_dtype, then cleared): the largest unit, the root
                  (fully_shard(model): embeddings, head, final norm, reduced last) or a block; and in the
                  owner layouts one layer's Muon gradients and their packed buffer
  ns_workspace    one NS call at a time: its input stack in param_dtype, X, the result and the m x m
                  products in the NS dtype: k (2 m n e_param + e_ns (2 m n + c m^2)), k matrices of the
                  short side m, long side n, c = 3 standard (A, A^2, B), 4 Gram (R, Z, Q, RZ)
                  (`dmuon.newton_schulz._standard_ns` / `_gram_ns`); split NS over g ranks: X's blocks / g;
                  naive: the all-gathered whole gradient of the matrix (grad_comm_dtype) + its NS; with
                  naive_batching (`dmuon.NaiveMuon`: one call per shape over all its matrices) every input
                  and every update (2 x the Muon elements, param_dtype) + the largest shape's call; DMuon:
                  its owner's largest batch
Peaks (the step's two phases; `peak_phase` names the larger):
  forward/backward = parameters + optimizer + the runtime's persistent buffers
                     + max(param_copies + activations,            (backward starts: every copy held)
                           end of backward)
                     end of backward, FSDP layouts: the root unit's copies (FSDP2 reshards each block after
                     its backward; the root, gathered, reduces last) + gradients other than the root's
                     shard + the reduction in flight; ddp: param_copies + gradients. Measured on this CPU
                     (the fsdp2-owner rows of scripts/memory_cpu.py, bench model and HF Llama, the resident
                     set sampled every 0.2 ms per phase): adamw and dmuon peak at the root's reduce-scatter,
                     after every Muon unit's reduction.
  optimizer        = parameters + optimizer + gradients + the runtime's buffers + ns_workspace
                     (owner layouts with transient units: the owned gradient chunk + max(NS workspace,
                     the publications))
Capacity: the profile's `memory_gib` (datasheets; CPU: the host's RAM, shared by the node's ranks).
ASSUMPTION (shown in notes): no allocator fragmentation or caching (PyTorch's caching allocator reserves
more than it allocates: `harness validate`'s memory section compares both where published).
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass

from .memory_activations import activation_bytes

GIB = 1 << 30
PARTS = ("parameters", "gradients", "optimizer", "param_copies", "activations", "comm_buckets",
         "ns_workspace")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the rank with the largest peak (`rank`), per part (see the module docstring)."""

    parameters: float
    gradients: float
    optimizer: float
    param_copies: float
    activations: float
    comm_buckets: float
    ns_workspace: float
    peak_bytes: float
    peak_phase: str  # "forward/backward" | "optimizer"
    capacity_bytes: float  # what one rank may use (0: the profile states none)
    rank: int
    notes: tuple[str, ...] = ()

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def fits(self) -> bool:
        return self.capacity_bytes <= 0 or self.peak_bytes <= self.capacity_bytes

    def gib(self) -> dict[str, float]:
        """{part: GiB} of the breakdown, then peak."""
        return {**{p: getattr(self, p) / GIB for p in PARTS}, "peak": self.peak_gib}

    def to_dict(self) -> dict:
        return {**asdict(self), "peak_gib": self.peak_gib, "fits": self.fits}

    def table(self) -> str:
        """The breakdown as text lines (harness simulate / plan print it)."""
        cap = f" of {self.capacity_bytes / GIB:.2f} GiB" if self.capacity_bytes > 0 else ""
        flag = "" if self.fits else "  DOES NOT FIT"
        lines = [f"memory per rank (rank {self.rank}): peak {self.peak_gib:.2f} GiB{cap} "
                 f"({self.peak_phase}){flag}"]
        lines += [f"  {p:<13} {getattr(self, p) / GIB:9.3f} GiB" for p in PARTS]
        return "\n".join(lines)


def ns_workspace_bytes(k: int, rows: int, cols: int, method: str, e_param: int, e_ns: int,
                       split: int = 1) -> float:
    """Bytes one batched NS call of k rows x cols matrices holds at its peak (module docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    c = 4 if method.startswith("gram") else 3
    return k * (2.0 * m * n * e_param / (split if split > 1 else 1) + e_ns * (2.0 * m * n / split + c * m * m))


def _even_owners(muon, world: int, max_batch: int, batching: bool) -> tuple[list[int], list[tuple]]:
    """Owners without a plan: same-shape matrices in batches of max_batch (batching), largest first onto
    the rank owning the fewest elements (LPT by elements). Returns (owner of each matrix, batches as
    (owner, k, rows, cols, split))."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(muon):
        by_shape.setdefault((m.rows, m.cols), []).append(i)
    chunks = []
    for (r, c), idx in by_shape.items():
        step = max_batch if batching else 1
        for s in range(0, len(idx), step):
            part = idx[s:s + step]
            chunks.append((sum(muon[i].rows * muon[i].cols * muon[i].count for i in part), r, c, part))
    chunks.sort(key=lambda t: -t[0])
    heap = [(0, r) for r in range(min(world, len(chunks)))]  # LPT fills empty ranks first: no more needed
    owners = [0] * len(muon)
    batches = []
    for numel, r, c, part in chunks:
        load, rank = heapq.heappop(heap)
        for i in part:
            owners[i] = rank
        batches.append((rank, sum(muon[i].count for i in part), r, c, 1))
        heapq.heappush(heap, (load + numel, rank))
    return owners, batches


def owner_momentum_bytes(muon, owners, world: int, model_split: int = 1, ep: int = 1) -> list[float]:
    """fp32 momentum bytes each rank holds when matrix i's momentum lives on owners[i] only (DMuon):
    summed over the ranks, the whole momentum once (per tp x pp model group; experts / ep)."""
    owned = [0.0] * world
    for i, m in enumerate(muon):
        owned[owners[i]] += m.rows * m.cols * m.count / model_split / (
            ep if ep > 1 and ".experts." in m.name else 1) * 4
    return owned


def _dims(cfg) -> tuple[int, int, int, int]:
    """(tp, pp, virtual stages, pipeline micro-batches) of the config (1s where it has no such fields)."""
    tp = int(getattr(cfg, "tp", 1) or 1)
    pp = int(getattr(cfg, "pp", 1) or 1)
    # SimConfig's names (simulator.programs.parallel: vpp, microbatches; None = its default), else the older ones
    virtual = int(getattr(cfg, "vpp", None) or getattr(cfg, "virtual_stages", 1) or 1)
    if hasattr(cfg, "microbatches"):
        from simulator.programs.parallel import default_microbatches

        micro = int(cfg.microbatches or default_microbatches(pp))
    else:
        micro = int(getattr(cfg, "micro_batches", pp) or pp)
    return tp, pp, virtual, micro


def breakdown(cfg, workload, profile, per_node: int, plan=None, *, recompute: str | None = None,
              loss_fp32: bool = True, free: bool | None = None) -> MemoryBreakdown:
    """Memory per rank of `cfg` (a simulator.api.SimConfig, validated) on its resolved workload, profile
    and ranks per node: `simulator.api.memory_of` resolves them and calls this. DMuon's owners come from
    `plan` (or cfg.plan), else from an LPT balance of elements over the ranks (`_even_owners`; the
    simulated plan balances NS time, so owners may differ: `simulate` reports the memory of its own plan).
    recompute: instead of cfg.recompute, also 'op' (torchtitan's per-op policy,
    `memory_activations.op_sac_bytes_per_token`: its published rows); loss_fp32: the loss upcasts the
    logits to fp32 (`memory_activations.head_bytes`); free: parameters freed after forward (None: the
    layout's -free; True with 'sharded': FSDP2 reshard_after_forward)."""
    from simulator.programs.step import DTYPE_BYTES

    tp, pp, virtual, micro = _dims(cfg)
    e_m = DTYPE_BYTES[getattr(cfg, "param_dtype", None) or "fp32"]
    e_c = DTYPE_BYTES[profile.dtype]
    e_g = DTYPE_BYTES[cfg.grad_comm_dtype or profile.dtype]
    e_ns = DTYPE_BYTES[cfg.ns_dtype or profile.dtype]
    recompute = recompute or getattr(cfg, "recompute", "none") or "none"
    notes = ["ASSUMPTION: memory counts allocated tensors (no allocator fragmentation or cache)"]
    world = cfg.gpus
    dp = max(1, world // (tp * pp))
    model_split = tp * pp  # every parameter's share on one rank of a tp x pp model group
    layout, strategy = cfg.layout, cfg.strategy
    shard = {"ddp": 1, "hsdp-keep": min(per_node, dp), "hsdp-free": min(per_node, dp)}.get(layout, dp)
    if cfg.ep > 1:
        workload = workload.experts_apart()
    owner_layout = strategy == "dmuon" and layout != "sharded"
    free = layout.endswith("-free") if free is None else free

    params = grads = states = copies = root = 0.0
    layer_numel: dict[int, float] = {}
    layer_muon: dict[int, float] = {}
    block_numel: dict[int, float] = {}
    ep, with_muon, s_expert = cfg.ep, strategy != "adamw", max(1, shard // cfg.ep)  # per parameter below
    for p in workload.params:
        expert = ep > 1 and ".experts." in p.name
        n = p.rows * p.cols * p.count / model_split / (ep if expert else 1)  # p.numel
        s = s_expert if expert else shard
        muon = with_muon and p.optimizer == "muon"
        layer_numel[p.layer] = layer_numel.get(p.layer, 0.0) + n
        if p.block is None and not (muon and owner_layout):
            root += n  # FSDP2's root unit: embeddings, head, final norm (never resharded after forward)
        elif p.block is not None:
            block_numel[p.layer] = block_numel.get(p.layer, 0.0) + n
        if muon and owner_layout:  # whole on every rank (keep); owned + units in use (free)
            layer_muon[p.layer] = layer_muon.get(p.layer, 0.0) + n
            params += 0.0 if free else n * e_m
            # FSDP2 owner layouts drop each gradient once packed into its unit's buffer (consume_grads)
            grads += n * e_m if layout == "ddp" else 0.0
            continue
        params += n / s * e_m
        grads += n / s * e_m
        # DMuon's replicated layout updates the AdamW parameters in 1/N pieces (shard_adamw)
        s_state = world if (owner_layout and layout == "ddp" and not muon) else s
        states += (1 if muon else 2) * n / s_state * 4
    if owner_layout and free:
        notes.append("DMuon memory 'free': non-owned Muon matrices held only while a layer runs")
    # compute-dtype copies the forward / backward read
    sharded_numel = sum(layer_numel.values()) - sum(layer_muon.values())
    largest = max(layer_numel.values(), default=0.0)
    if layout == "ddp":
        copies = sum(layer_numel.values()) * e_c if e_c != e_m else 0.0
    elif free:  # the root unit stays gathered (FSDP2 skips its reshard after forward) + two blocks
        copies = (root + 2 * max(block_numel.values(), default=0.0)) * e_c
    else:
        copies = sharded_numel * e_c + (sum(layer_muon.values()) * e_c if owner_layout and e_c != e_m else 0)
    if owner_layout and free:
        copies = 2 * largest * max(e_c, e_m)
    # the runtime's exchange buffers (dmuon.runtime.units): ddp one persistent flat buffer per unit of every
    # parameter it reduces (DMuon's units a second one it publishes from); the FSDP2 owner layouts'
    # units are transient (build_units: transient=True): a unit's buffer lives while it is in flight,
    # then the rank keeps its owned chunk of the summed gradients (the reduce job's result) until the
    # next step's reduction (per rank, below: owned elements x grad_comm_dtype)
    e_pc = DTYPE_BYTES[cfg.param_comm_dtype or profile.dtype]
    total = sum(layer_numel.values())
    owner_numel = sum(layer_muon.values())  # DMuon's owner-layout Muon matrices: its own units
    transient = owner_layout and layout != "ddp"
    # keep: step() launches every unit's publication at its end (dmuon.runtime.base: each allocates its whole
    # buffer at launch); free: the residency publishes a unit from its hooks (fsdp_memory: the two units
    # in use, counted in param_copies)
    publish = owner_numel * e_pc if transient and not free else 0.0
    in_flight = 0.0  # the largest reduction in flight at the end of backward
    end_fb = copies + grads  # ddp: every gradient with the weights (and autocast's copies) at backward's end
    if layout == "ddp":
        buckets = total * (e_g + (e_pc if strategy == "dmuon" else 0))
    else:
        buckets = 0.0
        # FSDP2's reduce-scatter of one unit (torch's _fsdp_collectives.foreach_reduce: the unit's unsharded
        # gradients (compute dtype) are copied into the reduce-scatter input (grad_comm_dtype) and then
        # cleared, before the sharded output exists): the root unit (fully_shard(model): embeddings, head,
        # final norm) reduces last, after every block resharded (FSDP2's post-backward), with the root
        # still gathered; a block's unit while its own backward runs
        unit = max(root, max(block_numel.values(), default=0.0))
        in_flight = unit * (e_c + e_g) if total > owner_numel else 0.0
        if transient:  # one Muon unit: the layer's whole gradients, then its packed buffer (consume_grads)
            in_flight = max(in_flight, max(layer_muon.values(), default=0.0) * (e_m + e_g))
        root_shard = root / max(1, shard) * e_m if total > owner_numel else 0.0
        end_fb = root * e_c + grads - root_shard + in_flight

    sp = bool(getattr(cfg, "sp", tp > 1))  # sequence parallelism where the config says (else with any TP)
    acts = activation_bytes(workload, cfg.seq_len, cfg.micro_batch, e_c, tp=tp, sp=sp, pp=pp,
                            micro_batches=micro, virtual=virtual, recompute=recompute,
                            loss_fp32=loss_fp32)
    act_total = acts["layers"] + acts["recompute_layer"] + acts["head"]

    # Muon momentum and NS workspace per rank
    muon = workload.muon_matrices if strategy != "adamw" else ()
    owned = [0.0] * world if owner_layout and muon else []
    work = [0.0] * world if owner_layout and muon else []
    ns_base = 0.0
    if owner_layout and muon:
        plan = plan if plan is not None else cfg.plan
        from simulator.setup import ns_method_of

        method = ns_method_of(cfg, profile)
        if plan is not None:
            owners = list(plan.owners)
            batches = [(b.owner, sum(muon[i].count for i in b.members), b.rows, b.cols,
                        max(1, len(b.group)), b.group) for b in plan.batches]
        else:
            owners, raw = _even_owners(muon, world, cfg.max_batch, cfg.batching)
            batches = [(*b, ()) for b in raw]
        owned = owner_momentum_bytes(muon, owners, world, model_split, cfg.ep)
        for owner, k, r, c, g, group in batches:
            w = ns_workspace_bytes(k, r, c, method, e_m, e_ns, g)
            for rank in (group or (owner,)):
                work[rank] = max(work[rank], w)
    elif muon:  # naive (every rank runs every NS on the gathered matrix) or dmuon sharded
        method = cfg.naive_ns_method if strategy == "naive" else "gram"
        shapes: dict[tuple[int, int], int] = {}
        for m in muon:
            shapes[(m.rows, m.cols)] = shapes.get((m.rows, m.cols), 0) + m.count
        batched = strategy == "naive" and cfg.naive_batching
        for (r, c), count in shapes.items():
            k = count if batched else 1
            if strategy == "dmuon":
                k = min(count, cfg.max_batch) if cfg.batching else 1
            gathered = 0.0 if batched else k * r * c * e_g / model_split
            ns_base = max(ns_base, gathered + ns_workspace_bytes(k, r, c, method, e_m, e_ns) / model_split)
        if batched:  # dmuon.NaiveMuon: every matrix's input gathered, then every update, before applying
            ns_base += 2.0 * sum(m.rows * m.cols * m.count for m in muon) / model_split * e_m

    base_opt = params + states + grads + buckets
    # activations peak as backward starts (every copy held), gradients at its end (end_fb)
    fb = params + states + buckets + max(copies + act_total, end_fb)
    opt = base_opt + ns_base
    best = (max(fb, opt), 0, fb >= opt, owned[0] if owned else 0.0, work[0] if work else ns_base, 0.0)
    ranks = range(len(owned))
    if len(owned) > 64:  # ranks owning nothing share one peak: the first stands for them (ties keep it)
        idle = next((r for r in ranks if not (owned[r] or work[r])), None)
        ranks = sorted([r for r in ranks if owned[r] or work[r]] + ([] if idle is None else [idle]))
    for rank in ranks:
        extra_fb, extra_opt = owned[rank], owned[rank] + work[rank]
        chunk = 0.0
        if transient:  # the owned chunk of the summed gradients; the publications after the rank's NS
            chunk = owned[rank] / 4 * e_g
            extra_fb += chunk
            extra_opt = owned[rank] + chunk + max(work[rank], publish)
        if owner_layout and free:  # the rank's owned matrices, whole
            own_w = owned[rank] / 4 * e_m
            extra_fb += own_w
            extra_opt += own_w
        peak = max(fb + extra_fb, opt + extra_opt)
        if peak > best[0]:
            best = (peak, rank, fb + extra_fb >= opt + extra_opt, owned[rank], work[rank], chunk)
    peak, rank, fb_wins, own_states, ns_ws, chunk = best
    params_r = params + (own_states / 4 * e_m if owner_layout and free else 0.0)
    cap = profile_capacity(profile, per_node)
    return MemoryBreakdown(parameters=params_r, gradients=grads, optimizer=states + own_states,
                           param_copies=copies, activations=act_total, comm_buckets=buckets + in_flight + chunk + publish,
                           ns_workspace=ns_ws, peak_bytes=peak,
                           peak_phase="forward/backward" if fb_wins else "optimizer",
                           capacity_bytes=cap, rank=rank, notes=tuple(notes))


def profile_capacity(profile, ranks_per_node: int) -> float:
    """Bytes one rank may use: the profile's memory_gib (a GPU's; a CPU host's RAM shared by its ranks)."""
    gib = getattr(profile, "memory_gib", 0.0) or 0.0
    if gib <= 0:
        return 0.0
    return gib * GIB / (ranks_per_node if profile.cpu_cores else 1)


__all__ = ["GIB", "MemoryBreakdown", "PARTS", "breakdown", "ns_workspace_bytes", "owner_momentum_bytes",
           "profile_capacity"]
