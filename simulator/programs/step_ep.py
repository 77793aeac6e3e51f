"""Expert parallelism (EP) in the step programs: where experts live, their groups, the token all-to-alls.

With `StepSpec.ep` = E > 1 (`SimConfig.ep`), N ranks, p per node (the layout of `dmuon.plan.ep`):
  EP group       rank r is EP rank r % E of EP group r // E (E consecutive ranks: inside a node when
                 E <= p, whole nodes when E is a multiple of p); group "ep"
  replica group  the N / E ranks with one EP rank (r % E): the data-parallel copies of the same experts;
                 group "rep" (E < p: p / E of them per node, E such groups share the node's NICs; E >= p:
                 one per node, p groups share the NICs)
  experts        each rank holds E_l / E of layer l's experts (expert e on EP rank e // (E_l / E),
                 `dmuon.plan.ep.expert_placement`); shared experts and every other parameter are dense
  FSDP           dense parameters are gathered / reduce-scattered over the world as without EP (HSDP: over
                 the node, then all-reduced across nodes, as without EP). adamw: the local experts over the
                 replica group too (HSDP too: the replica group already spans the nodes, so no all-reduce
                 across nodes follows), its optimizer pass over its dense shards and its own experts only
                 (experts / E sharded over N / E ranks = experts / N; `_local_muon`); no runtime runs adamw
                 with EP: a convention. naive: its experts whole on each rank in every layout, as the
                 runtime's `NaiveMuon(model, ep=E)` keeps them out of fully_shard
                 (`dmuon.runtime.ep.NaiveExperts`): never gathered, per MoE layer one all-reduce of the
                 rank's experts over its replica group in backward, momentum over the rank's whole experts
                 (experts / E) and NS on each of them with nothing gathered (`whole_experts`: the ddp code
                 path below). DMuon's experts are never FSDP's (the runtime's `DMuon(model, ep=E)` keeps
                 them out of fully_shard in every layout, HSDP too)
  ddp            (replicated) the dense gradients all-reduced over the world, the rank's experts over its
                 replica group (adamw, naive: no gathers; naive runs NS on every dense matrix and its own
                 experts; optimizer state for the dense parameters and experts / ep, whole)
  sharded        adamw, naive: as fsdp-keep (the layout changes only dmuon's optimizer)
  dmuon          the plan is `dmuon.plan.ep.build_ep_plan`'s (expert owners inside their replica group):
                 per bucket the dense matrices' owner exchange and publication over the world, the EP rank's
                 experts' over its replica group only, as `DMuon(model, ep=E)` runs them in every layout
                 (`ExpertMuon`: per bucket an OwnerUnit over the replica group, launched from backward hooks
                 as the bucket's expert gradients are ready; flat, the group has no node_size, its mode
                 "auto" picked with the group's ranks per node: `simulator.programs.step_comm.owner_coll`).
                 fsdp / hsdp / ddp: both parts in the bucket's reduce in backward, the dense part's
                 publication before the layers that need it. sharded: the dense matrices go by FSDP2 and the
                 per-bucket all-to-alls at the step. Every layout: the experts' per-bucket reduces in
                 backward, their batches after the dense batches and the AdamW pass (ExpertMuon.step runs
                 after DMuon's Muon and AdamW updates, once every expert sum is in), then per bucket their
                 broadcast; each layer of the next forward waits for its buckets'
                 (`simulator.programs.step_optimizer._expert_step`; the experts are plain tensors: never regathered)
  tokens         per MoE layer (a layer holding routed experts) the forward pass is the layer's non-expert
                 compute, the dispatch all-to-all, the expert compute, the combine all-to-all; backward
                 mirrors it (the combine's gradient all-to-all, expert backward, the dispatch's gradient
                 all-to-all, the rest), so 2 all-to-alls forward and 2 backward over the EP group, each of
                 T x hidden x top_k activations (T = seq_len x micro_batch tokens per rank, activation
                 dtype = the profile's). This is the dispatch / combine of GShard (Lepikhin et al. 2020,
                 arXiv:2006.16668: an AllToAll before and after the experts of each MoE layer) and
                 DeepSpeed-MoE (Rajbhandari et al. 2022, arXiv:2201.05596: two all-to-alls per MoE layer
                 in forward, their backward two more); each routed copy of a token (top_k per token)
                 is one row sent (Megatron-Core's alltoall token dispatcher permutes T x top_k rows). They
                 run on their own stream ("ep", the EP communicator) and the compute waits for them (the
                 critical path: exposed communication unless other ranks are slower).
  ASSUMPTION     balanced routing: every rank's experts get T x top_k tokens in all, i.e. the same expert
                 FLOPs as without EP (no capacity-factor padding or dropped tokens), and all-to-all rows
                 spread evenly over the EP group; gradients of a layer are reduced after its whole backward.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from simulator.fabric.collectives import Group
from simulator.engine.engine import Op

# layouts the simulator runs with ep > 1 (the runtime runs DMuon with EP on each: dmuon.runtime.ep)
EP_LAYOUTS = ("fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free", "ddp", "sharded")


@dataclass(frozen=True)
class EPSpec:
    """What EP adds to a `simulator.programs.step.StepSpec` (built by `ep_spec`)."""

    ep: int
    muon_ep: tuple  # per Muon matrix: the EP rank holding it, None for a dense matrix
    layer_expert_numel: tuple  # per layer: Muon elements of all its routed experts (every EP rank's)
    layer_a2a_bytes: tuple  # per layer: bytes of one dispatch / combine all-to-all per rank (0: no MoE)
    layer_expert_fwd_s: tuple  # per layer: forward seconds of its expert matmuls (backward: x bwd ratio)
    layer_expert_bwd_s: tuple


def _moe_layer_shape(params) -> tuple[int, int, int]:
    """(experts, top_k, hidden) of one layer's routed-expert parameters (simulator.models.hf_config names)."""
    from dmuon.plan.ep import expert_index

    by_expert: dict[int, list] = {}
    for p in params:
        by_expert.setdefault(expert_index(p.name), []).append(p)
    n = len(by_expert)
    first = by_expert[min(by_expert)]
    top_k = max(1, round(first[0].matmuls_per_token * n))  # hf_config: uses = top_k / experts
    dims = set.intersection(*({p.rows, p.cols} for p in first))  # hidden: the side every matrix shares
    return n, top_k, max(dims) if dims else first[0].cols


def ep_spec(workload, muon, ep: int, seq_len: int, micro_batch: int, profile, stretch: float,
            act_bytes: int) -> EPSpec:
    """The EP view of `workload` (see the module docstring). stretch: the layer compute's multiplier
    (CPU contention x speed_scale), as simulator.models.compute.layer_times applies it."""
    from dmuon.errors import InputError
    from dmuon.plan.ep import expert_index, expert_placement

    where = expert_placement(muon, ep)
    if all(w is None for w in where):
        raise InputError(f"ep={ep}: workload {workload.name!r} has no routed experts (matrices named "
                         "'experts.<e>.'); accepted: ep=1 for a dense model")
    n_layers = workload.n_layers
    ex_numel = [0] * n_layers
    for m, w in zip(muon, where, strict=True):
        if w is not None:
            ex_numel[m.layer] += m.numel
    tokens = seq_len * micro_batch
    a2a = [0.0] * n_layers
    fwd = [0.0] * n_layers
    bwd = [0.0] * n_layers
    for layer, params in enumerate(workload.layer_params()):
        routed = [p for p in params if p.optimizer == "muon" and expert_index(p.name) is not None]
        if not routed:
            continue
        _, top_k, hidden = _moe_layer_shape(routed)
        a2a[layer] = float(tokens * hidden * top_k * act_bytes)
        flops = sum(2.0 * p.numel * tokens * p.matmuls_per_token for p in routed)
        fwd[layer] = stretch * flops / profile.fwd_flops
        bwd[layer] = stretch * 2.0 * flops / profile.bwd_flops
    return EPSpec(ep, tuple(where), tuple(ex_numel), tuple(a2a), tuple(fwd), tuple(bwd))


class EPPrograms:
    """EP groups, FSDP parts, the dmuon exchange split and the token all-to-alls (mixed into
    `simulator.programs.step._Programs`)."""

    def _prepare_ep(self) -> None:
        s = self.s
        e = s.ep_spec
        self.ep = e.ep if e is not None else 1
        self._layer_info: dict = {}  # (phase, layer) -> its op names, all-to-all bytes, expert time
        # naive's experts are whole on each rank, all-reduced over the replica group in every layout
        # (`dmuon.runtime.ep.NaiveExperts`): never gathered, never reduce-scattered
        self.whole_experts = self.ep > 1 and (s.strategy == "naive" or self.shard is None)
        if self.ep == 1:
            return
        n, p, ep = s.n_ranks, s.per_node, self.ep
        reps = n // ep
        self.ep_group = Group(1, ep) if ep <= p else Group(ep // p, p)
        per = max(1, p // ep)  # replica-group members per node
        self.rep_group = Group(reps // per, per, share=p // per)
        self.ep_of = e.muon_ep
        self.n_dense_muon = sum(1 for w in e.muon_ep if w is None)  # dense Muon matrices (every rank's)
        self._a2a_colls: dict = {}

    def _is_local(self, i: int, ep_rank: int = 0) -> bool:
        """Whether Muon matrix i is held by (a rank of) EP rank `ep_rank`: dense or its expert."""
        return self.ep == 1 or self.ep_of[i] is None or self.ep_of[i] == ep_rank

    def _layer_experts(self, l: int) -> int:
        """Muon elements of all layer l's routed experts (every EP rank's; 0 without EP)."""
        return self.s.ep_spec.layer_expert_numel[l] if self.ep > 1 else 0

    def _local_muon(self) -> tuple[float, int]:
        """(Muon elements, Muon tensors) a rank's adamw / naive optimizer keeps state for and runs its
        elementwise passes over (AdamW, momentum): without EP its shard of every matrix (`_local_fraction`);
        with EP its share of every dense matrix (the shard group's: 1 / N FSDP, 1 / GPUs per node HSDP,
        whole ddp) and of its own experts only (experts / ep, as `DMuon(model, ep=E)` holds them), sharded
        as the layout moves them (`_fsdp_parts`: adamw's over the replica group of N / ep ranks, i.e.
        experts / N; `whole_experts`, ddp and naive in every layout: whole). One tensor per dense matrix
        and per own expert matrix, as ep = 1 counts every matrix (an FSDP shard is one tensor of the pass)."""
        s = self.s
        if self.ep == 1:
            return self.muon_total * self._local_fraction(), len(s.muon_numel)
        ex = sum(s.ep_spec.layer_expert_numel)
        own = ex / self.ep if self.whole_experts else ex / s.n_ranks
        return ((self.muon_total - ex) * self._local_fraction() + own,
                self.n_dense_muon + (len(s.muon_numel) - self.n_dense_muon) // self.ep)

    def _muon_group(self, i: int):
        """The group that shards Muon matrix i (naive's gradient gathers; None: whole on the rank, nothing
        to gather): an expert is whole (`whole_experts`, naive's in every layout)."""
        return self.shard if self.ep == 1 or self.ep_of[i] is None else None

    def _fsdp_parts(self, l: int, numel: int, mu: int, gather: bool = False) -> list[tuple]:
        """[(group, elements, of which Muon, key tag)] of layer l's FSDP gather (`gather`) / reduction: one
        part over the shard group without EP; with EP the dense part over it and the rank's experts over
        the replica group (dmuon publishes its Muon matrices instead: its parts are dense AdamW only;
        `whole_experts`: the experts are all-reduced there, never gathered, `_reduce_colls`)."""
        ex = self._layer_experts(l)
        if not ex or self.dm:  # dmuon's experts are never FSDP's (numel, mu: without them)
            return [(self.shard, numel, mu, ())]
        parts = [(self.shard, numel - ex, mu - ex, ())] if numel > ex else []
        if gather and self.whole_experts:
            return parts
        return parts + [("rep", ex // self.ep, ex // self.ep, ("ep",))]

    # ---- token all-to-alls -------------------------------------------------------------------------
    def _a2a_pair(self, r: int, step: int, l: int, phase: str) -> tuple:
        """Layer l's two all-to-alls of `phase` in rank r's EP group, in issue order (forward: dispatch,
        combine; backward: the combine's gradient, the dispatch's), each created once per group instance."""
        key = (step, phase, l, r // self.ep)
        cols = self._a2a_colls.get(key)
        if cols is None or self._log is not None:  # a record logs its look-ups (step_template)
            whats = ("dispatch", "combine") if phase == "fwd" else ("combine_grad", "dispatch_grad")
            cols = self._a2a_colls[key] = tuple(
                self.coll(r, ("a2a", step, what, l), "ep", "all_to_all", self.s.ep_spec.layer_a2a_bytes[l],
                          muon_fraction=0.0, step=step) for what in whats)
        return cols

    def _layer_op(self, r: int, step: int, l: int, phase: str, dur: float, deps: list,
                  prev: Op | None = None) -> tuple[Op, list]:
        """Layer l's compute: (its last compute op, what the next layer's compute waits for). A MoE layer
        with EP runs as its non-expert part, dispatch, experts, combine (backward: mirrored); prev = the
        compute op before it (backward: the combine's gradient all-to-all waits for it)."""
        cm = self._cmp  # simulator.programs.step: Cluster.compute on this rank's compute stream
        info = self._layer_info.get((phase, l))  # one string per layer for every rank's ops
        if info is None:
            e = self.s.ep_spec
            a2a = e.layer_a2a_bytes[l] if self.ep > 1 else 0.0
            ex = (e.layer_expert_fwd_s[l] if phase == "fwd" else e.layer_expert_bwd_s[l]) if a2a else 0.0
            info = self._layer_info[(phase, l)] = (f"{phase}{l}", f"{phase}{l}.experts", a2a, ex)
        name, ex_name, a2a, ex = info
        if not a2a:
            return cm(r, name, dur, phase, step, tuple(deps)), []
        first, second = self._a2a_pair(r, step, l, phase)
        cop = self._cop  # simulator.programs.step: Cluster.collective on this rank's ep stream
        if phase == "fwd":
            pre = cm(r, name, dur - ex, phase, step, tuple(deps))
            dispatch = cop(first, r, phase, step, (pre,), "ep")
            experts = cm(r, ex_name, ex, phase, step, (dispatch,))
            return experts, [cop(second, r, phase, step, (experts,), "ep")]
        g_combine = cop(first, r, phase, step, (prev,), "ep")
        experts = cm(r, ex_name, ex, phase, step, (*deps, g_combine))
        g_dispatch = cop(second, r, phase, step, (experts,), "ep")
        return cm(r, name, dur - ex, phase, step, (g_dispatch,)), []

    # ---- dmuon's owner exchange, split by where the matrices live --------------------------------
    def _prepare_ep_plan(self) -> None:
        """Per bucket: (payload, largest owner's share, {owner: numel}) of its dense matrices, and of
        each EP rank's experts; per plan batch whether it is an expert batch."""
        if self.ep == 1 or not self.dm:
            return
        from dmuon.plan.ep import expert_placement

        mats = self.s.plan.matrices
        owners = self.s.plan.owners
        where = expert_placement(mats, self.ep)  # in the plan's matrix order
        self.expert_batch = [where[bt.members[0]] is not None for bt in self.s.plan.batches]
        self.ep_parts = []
        for b in self.s.plan.buckets:
            parts: dict = {}
            for i in b.members:
                d = parts.setdefault(where[i], {})
                d[owners[i]] = d.get(owners[i], 0) + mats[i].numel
            self.ep_parts.append({k: (sum(d.values()), max(d.values()), d) for k, d in parts.items()})
        self._ep_sigs: dict = {}  # EP rank -> its `_ep_signature`
        self._ep_sig_ids: dict = {}  # signature -> its number

    def _ep_signature(self, rank: int):
        """What rank's program reads of its replica group's owner exchange (simulator.engine.symmetry): per
        bucket the part of its EP rank's experts as `owner_coll` prices it (payload, largest share, owners
        per local index), None where it has none; as a number, equal for equal signatures (a ~60-bucket
        tuple hashed once per replica group instead of once per rank and template look-up)."""
        if self.ep == 1 or not self.dm:
            return ()
        sig = self._ep_sigs.get(rank % self.ep)
        if sig is None:
            p = self.s.per_node
            full = tuple(None if (part := parts.get(rank % self.ep)) is None
                         else (part[0], part[1], tuple(sorted(Counter(o % p for o in part[2]).values())))
                         for parts in self.ep_parts)
            sig = self._ep_sigs[rank % self.ep] = self._ep_sig_ids.setdefault(full, len(self._ep_sig_ids))
        return sig

    def _owner_parts(self, r: int, b: int, which: str | None = None) -> list[tuple]:
        """[(group, key tag, part)] of bucket b's owner exchange for rank r (part None: the whole bucket);
        sharded: its experts only (the dense matrices go by the all-to-alls). which "dense" / "experts":
        that part only (EP publications: the dense matrices' as DMuon's, the experts' from ExpertMuon.step,
        `simulator.programs.step_optimizer._expert_step`; the experts are plain tensors, never freed or regathered)."""
        if self.ep == 1:
            return [("world", (), None)]
        parts = self.ep_parts[b]
        dense = None in parts and not self.sharded and which != "experts"
        out = [("world", (), parts[None])] if dense else []
        mine = parts.get(r % self.ep) if which != "dense" else None
        return out + ([("rep", ("ep",), mine)] if mine is not None else [])

    def _dense_bucket(self, b: int) -> tuple[float, float]:
        """(elements, largest owner's share) of bucket b's dense matrices (the whole bucket without EP)."""
        if self.ep == 1:
            return self.bucket_numel[b], self.max_owned[b]
        part = self.ep_parts[b].get(None)
        return (part[0], part[1]) if part is not None else (0, 0)
