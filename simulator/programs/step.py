"""Step programs: what every rank issues on its streams in one training step, per strategy and layout.

Strategies: `adamw` (all parameters AdamW), `naive` (gather-then-compute Muon), `dmuon` (owner-centric
Muon from a `dmuon.plan.Plan`); non-matrix parameters (embeddings, heads) are AdamW in all three.

Layouts (shard group / replicate group):
  fsdp-keep   FSDP over all ranks, parameters kept after forward (ZeRO-2-like, FSDP2 reshard=False)
  fsdp-free   FSDP over all ranks, parameters freed after forward and re-gathered for backward (ZeRO-3)
  hsdp-keep   sharded inside a node, replicated across nodes; -free as above (dmuon: the Muon matrices
              are the runtime's, owned over every rank with a two-level exchange: NS once in the job)
  ddp         replicated; gradients all-reduced
  sharded     Muon matrices stay FSDP-sharded: momentum on local shards, per bucket one packed
              all_to_all to the owners, owners run NS, one all_to_all back (adamw / naive: as fsdp-keep)

Per rank and step ("gather" = all-gather of parameters, or for dmuon the owners' broadcast of their
matrices, i.e. the publication). Streams: compute, comm (every collective of the shard group, in program
order) and, for HSDP, inter (the all-reduces across nodes: they use the NICs, not NVLink, so they run
beside the node's gathers and reduce-scatters):
  forward    gather(l+1) is issued before compute(l) and may start once compute(l-1) is done (one
             layer of prefetch, as FSDP2); compute(l) waits for gather(l)
  backward   free layouts re-gather the same way in reverse; after compute(l) its gradients are
             reduced: reduce-scatter (FSDP), reduce-scatter in the node + all-reduce of the shard
             across nodes (HSDP), all-reduce (DDP); dmuon sends each complete bucket of Muon gradients
             to the owners instead (owner reduces = reduce-scatter into owner-aligned buffers)
  optimizer  a fixed per-step overhead, then
             adamw: the AdamW pass over the local parameters
             naive: the AdamW pass over local AdamW parameters, momentum over local shards, then per
                    matrix: all-gather of the full gradient (not overlapped with the previous NS,
                    as in the published FSDP2+Muon) and standard NS (bf16, Jordan) on every rank,
                    keeping its own shard (naive_batching: each matrix carries an equal share of its
                    shape's one batched NS call, as dmuon.NaiveMuon runs them); above
                    NAIVE_MERGE_ABOVE matrices the matrices of one shape are one gather and one NS op
                    of their summed time (the same timing: see _naive_runs)
             dmuon: each owner runs its plan batches in the plan's order (the batch's share of one
                    momentum pass over the owner's elements + the batch's cost-table NS time), each
                    once the buckets holding its members have arrived, then the AdamW pass;
                    publication per bucket from the owners: overlapped with the next forward (each
                    layer waits for its buckets) when `overlap`, else before the next forward
             sharded dmuon: per bucket (backward order) its share of one momentum pass over the
                    local shards, all_to_all to the owners, owners' batches, all_to_all back (EP: then
                    the owners' expert batches and per bucket the experts' publication,
                    `OptimizerPrograms._sharded_optimizer`)
An elementwise pass (AdamW, momentum, gradient preparation) is priced once per step over all the
elements it covers, so a cost table's per-call intercept is paid once, not per batch, plus the table's
measured cost per extra tensor (`CostTable.per_tensor_time`) for the tensors it runs over: AdamW the
rank's parameters, momentum its Muon matrices (EP: the dense ones and its own experts only,
`simulator.programs.step_ep._local_muon`), gradient preparation one per reduction unit (layer).
The programs are generated per rank; ranks with identical programs are simulated once
(`simulator.programs.step_comm.CommPrograms.select`: exact). Collectives are priced in `simulator.programs.step_comm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dmuon.errors import InputError

from simulator.fabric.collectives import Group
from simulator.engine.engine import Cluster, Op, paused_gc
from .step_comm import CommPrograms
from .step_ep import EPPrograms
from .step_optimizer import OptimizerPrograms
from .published_host import HostPrograms
from .step_published import PublishedPrograms, check_published
from .step_template import TemplatePrograms
from simulator.engine.symmetry import Unsupported

LAYOUTS = ("fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free", "ddp", "sharded")
STRATEGIES = ("adamw", "naive", "dmuon")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
NAIVE_MERGE_ABOVE = 4096  # Muon matrices above which naive's same-shape runs are simulated as one op each


@dataclass
class StepSpec:
    """Everything a step program needs, resolved to numbers (built by `simulator.api`)."""

    strategy: str
    layout: str
    n_ranks: int
    per_node: int  # ranks per node
    layer_fwd_s: list[float]
    layer_bwd_s: list[float]
    layer_muon: list[list[int]]  # per layer: indices into `muon_numel` (matrices in forward order)
    muon_numel: list[int]  # per Muon matrix
    muon_shape: list[tuple[int, int]]
    layer_adamw_numel: list[int]
    layer_adamw_tensors: list[int]  # per layer: AdamW parameters (one tensor each in the AdamW pass)
    ns_naive_s: list[float]  # per Muon matrix: standard NS seconds (naive)
    elementwise_s: object  # callable (numel, op, tensors=1) -> seconds
    optimizer_overhead_s: float
    network: object
    hierarchical: bool
    overlap: bool
    param_bytes: int
    grad_bytes: int
    plan: object = None  # dmuon.plan.Plan (dmuon only)
    split_exchange: str = "lead"  # split batches: "lead" | "blocks" (simulator.programs.step_split)
    ns_stretch: float = 1.0  # CPU contention applied to plan batch times
    steps: int = 2
    sm_share: float = 0.0  # share of a GPU's SMs each running collective takes (simulator.engine.engine)
    sm_share_net: float | None = None  # the same over one GPU per node (HSDP's replicate group); None: sm_share
    ep_spec: object = None  # simulator.programs.step_ep.EPSpec with ep > 1 (expert parallelism), else None
    published: frozenset = frozenset()  # system 'published': its mechanisms on (simulator.programs.step_published)
    published_adamw_tensors: int = 0  # published adamw_unfused: the public AdamW loop's tensors (published_host)

    @property
    def n_layers(self) -> int:
        return len(self.layer_fwd_s)


@dataclass
class Built:
    """The cluster plus the handles the metrics need."""

    cluster: Cluster
    spec: StepSpec
    notes: list[str] = field(default_factory=list)


class _Programs(OptimizerPrograms, CommPrograms, EPPrograms, TemplatePrograms, PublishedPrograms, HostPrograms):
    def __init__(self, spec: StepSpec, cluster: Cluster):
        self.s = spec
        self.c = cluster
        self.pub = spec.published  # system 'published' (simulator.programs.step_published); empty: ours
        n, p = spec.n_ranks, spec.per_node
        self.nodes = n // p
        self.world = Group(self.nodes, p)
        self.intra = Group(1, p)
        self.inter = Group(self.nodes, 1, share=p)
        self.colls: dict = {}
        self._col_lists: dict = {}  # (call site's key, instances) -> its collectives (_cols)
        self._templates: dict = {}  # a step's forward and backward per key (simulator.programs.step_template)
        self._col_ids: dict = {}  # (key, group) of every collective -> an integer id (coll)
        self._col_keys: list = []  # per id its key
        self._col_of: dict = {}  # id(collective) -> (group, its key's id)
        self._col_by_inst: dict = {}  # (group, instance) -> {key's id: collective}
        lay = spec.layout
        self.shard = {"ddp": None}.get(lay, "intra" if lay.startswith("hsdp") else "world")
        self.replicate = "world" if lay == "ddp" else ("inter" if lay.startswith("hsdp") else None)
        self.free = lay.endswith("-free")
        self.sharded = lay == "sharded" and spec.strategy == "dmuon"
        # memory='free': the runtime publishes from forward / backward hooks on its own thread and process
        # groups (dmuon.runtime.base: _pub_worker, _pub_groups), i.e. its own NCCL stream
        self.pub_stream = "pub" if self.free and spec.strategy == "dmuon" and not self.sharded else "comm"
        self.shard_size = {None: 1, "world": n, "intra": p}[self.shard]
        # per-layer and total Muon elements, summed once (MoE workloads have ~10^5 matrices)
        self.layer_muon_numel = [sum(spec.muon_numel[i] for i in ms) for ms in spec.layer_muon]
        self.muon_total = sum(spec.muon_numel)
        self._prepare_ep()
        self.naive_runs = self._naive_runs()
        self._prepare_plan()
        self._prepare_ep_plan()
        self._gparts: dict = {}  # per layer: its gathers' parts (_gather_parts)
        if self.dm:  # per layer: the buckets whose first / last layer it is (publication points)
            lb, bl = self.layer_buckets, self.bucket_layers
            self._first_b = {l: [b for b in bs if bl[b][0] == l] for l, bs in lb.items()}
            self._last_b = {l: [b for b in bs if bl[b][-1] == l] for l, bs in lb.items()}

    def _naive_runs(self) -> list[tuple[int, int]]:
        """naive's per-matrix chain (gather, NS, gather, NS, ...) as (matrix, count) runs: one matrix each,
        or, above NAIVE_MERGE_ABOVE matrices (MoE workloads: ~10^5 experts), the matrices of each (shape,
        NS time) as one gather and one NS op of their summed time, in first-seen order. Exact: the chain is
        serial, so its end does not depend on the order of its members, nothing else runs on the rank
        meanwhile and every rank runs it alike; only the trace shows one op per shape."""
        s = self.s
        if s.strategy != "naive":
            return []
        n = len(s.muon_numel)
        mine = [i for i in range(n) if self._is_local(i)]  # EP: dense and EP rank 0's experts (same shapes)
        if len(mine) <= NAIVE_MERGE_ABOVE:
            return [(i, 1) for i in mine]
        runs: dict[tuple, list[int]] = {}
        for i in mine:
            key = (s.muon_shape[i], s.ns_naive_s[i], self._muon_group(i))
            if key in runs:
                runs[key][1] += 1
            else:
                runs[key] = [i, 1]
        return [(i, k) for i, k in runs.values()]

    # ---- one rank's program ---------------------------------------------------------------------
    def program(self, r: int) -> None:
        """Issue rank r's ops for every step, in program order."""
        prev = {"opt_last": None, "adam": None, "pub_deps": {}, "pubs": {}}
        q = self.c.queues
        self._qs = {st: q[(r, st)] for st in self.c.stream_names}  # rank r's queues (_cop, _cmp)
        self._rank = r
        # the group instances rank r's collectives are looked up by (_cols): ranks with the same ones share
        # each call site's list of collectives
        p, e = self.s.per_node, self.ep
        shard = r // p if self.shard == "intra" else 0
        self._gk = (shard, r % e)  # FSDP gathers: shard group, replica group (EP)
        self._rk = (shard, r % e, r % p if self.replicate == "inter" else 0)  # reductions (+ HSDP's inter)
        self._ok = r % e  # dmuon's owner exchange: the world, the replica group (EP)
        for step in range(self.s.steps):
            fwd, red = self._fwd_bwd(r, step, prev)  # _forward, _backward (or their replay)
            self._optimizer(r, step, prev, red)

    def _gathered_numel(self, l: int) -> tuple[int, int]:
        """(elements, of which Muon) all-gathered for layer l: dmuon publishes its Muon matrices instead
        (sharded: FSDP2 gathers the dense ones; the experts are never FSDP's, their owners publish them)."""
        if self.dm and not self.sharded:
            return self.s.layer_adamw_numel[l], 0
        ex = self._layer_experts(l) if self.dm else 0
        return self._layer_numel(l) - ex, self._layer_muon(l) - ex

    def _cop(self, col, r: int, phase: str, step: int, deps: tuple, stream: str = "comm") -> Op:
        """`Cluster.collective` for the rank `program` is issuing (deps: a tuple), without its lookups."""
        if None in deps:
            deps = tuple([d for d in deps if d is not None])
        op = Op(r, stream, col.name, phase, step, 0.0, col, deps)
        self._qs[stream].append(op)
        return op

    def _cmp(self, r: int, name: str, dur: float, phase: str, step: int, deps: tuple) -> Op:
        """`Cluster.compute` on the compute stream of the rank `program` is issuing (deps: a tuple)."""
        if dur < 0 or self.c._noise is not None:
            return self.c.compute(r, name, dur, phase=phase, step=step, deps=deps)
        if None in deps:
            deps = tuple([d for d in deps if d is not None])
        op = Op(r, "compute", name, phase, step, dur, None, deps)
        self._qs["compute"].append(op)
        return op

    def _cols(self, key: tuple, make) -> list:
        """The collectives of one call site for the rank `program` is issuing: `make()` (a list, in issue
        order) for the first rank with these group instances (the last item of `key`), then that list (the
        same objects `coll` would look up for every later rank). While a template is recorded, `make()` runs
        anyway, so the record logs every collective it looks up (simulator.programs.step_template)."""
        cols = self._col_lists.get(key)
        if cols is None:
            cols = self._col_lists[key] = make()
        elif self._log is not None:
            make()
        return cols

    def _gather_parts(self, l: int) -> list[tuple]:
        """[(group, elements, Muon fraction, key tag)] of layer l's gathers (the same on every rank)."""
        parts = self._gparts.get(l)
        if parts is None:
            numel, mu = self._gathered_numel(l)
            parts = self._gparts[l] = ([(g, k, m / k, tag)
                                        for g, k, m, tag in self._fsdp_parts(l, numel, mu, gather=True)]
                                       if numel else [])
        return parts

    def _forward(self, r: int, step: int, prev: dict) -> list[Op]:
        s = self.s
        L = s.n_layers
        publish_here = self.dm and not self.sharded and (s.overlap or step == 0)
        gathers: dict[int, list[Op]] = {}
        pubs: dict[int, Op] = {}
        fwd: list[Op] = []

        opt_dep = prev["adam"] if (self.dm and not self.sharded) else prev["opt_last"]
        cop, coll, pb = self._cop, self.coll, s.param_bytes

        def gather(l: int, dep: Op | None) -> None:
            ops = []
            if self.shard is not None:
                cols = self._cols(("ag", step, "fwd", l, self._gk), lambda: [
                    coll(r, ("ag", step, "fwd", l, *tag), grp, "all_gather", k * pb, muon_fraction=mf,
                         step=step) for grp, k, mf, tag in self._gather_parts(l)])
                ops = [cop(col, r, "fwd", step, (dep, opt_dep)) for col in cols]
            if publish_here:
                for b in self._first_b.get(l, ()):
                    if self.pub:  # system 'published' (simulator.programs.step_published)
                        pubs[b] = self._pub_broadcast(r, b, step, prev["pub_deps"].get(b, ()),
                                                      phase="pub" if step else "fwd", tag="pub", issue=dep)
                        continue
                    pubs[b] = self._publish(r, b, step, prev["pub_deps"].get(b, ()),
                                            phase="pub" if step else "fwd", stream=self.pub_stream,
                                            which="dense")
            gathers[l] = ops

        gather(0, None)
        wait: list[Op] = []  # EP: the previous MoE layer's combine all-to-all
        for l in range(L):
            if l + 1 < L:
                gather(l + 1, fwd[l - 1] if l >= 1 else None)
            deps = list(gathers[l])
            if publish_here:
                deps += [pubs[b] for b in self.layer_buckets.get(l, ())]
                if "prefetch_wait" in self.pub and l + 1 < L:  # waits the next group's unshard (published)
                    deps += [pubs[b] for b in self.layer_buckets.get(l + 1, ())]
            if l == 0 and "sync_publish" in self.pub:  # one post-step publish phase (published)
                deps += list(prev["pubs"].values())
            if self.dm and not self.sharded and not s.overlap:
                if l == 0:  # dmuon without overlap: everything published first
                    deps += list(prev["pubs"].values())
            elif self.dm and self.ep > 1:  # the experts' publications of its buckets (_expert_step)
                got = prev["pubs"]
                deps += [got[k] for b in self.layer_buckets.get(l, ()) if (k := ("ep", b)) in got]
            op, wait = self._layer_op(r, step, l, "fwd", s.layer_fwd_s[l], deps + wait)
            fwd.append(op)
        return fwd

    def _backward(self, r: int, step: int, fwd: list[Op]) -> dict:
        s = self.s
        L = s.n_layers
        regather = self.free and self.shard is not None
        gathers: dict[int, list[Op]] = {}
        pubs: dict[int, Op] = {}
        bwd: dict[int, Op] = {}
        red = {"last": None, "adamw_last": None, "bucket": {}, "layer": {}, "bucket_last": None}
        stage1: list = []  # published 'drain': the groups' stage-1 reduces, latest last

        def gather(l: int, dep: Op | None) -> None:
            cols = self._cols(("ag", step, "bwd", l, self._gk), lambda: [
                self.coll(r, ("ag", step, "bwd", l, *tag), grp, "all_gather", k * s.param_bytes,
                          muon_fraction=mf, step=step) for grp, k, mf, tag in self._gather_parts(l)])
            ops = [self._cop(col, r, "bwd", step, (dep,)) for col in cols]
            if self.dm and not self.sharded:
                for b in self._last_b.get(l, ()):
                    pubs[b] = (self._pub_broadcast(r, b, step, (dep,), phase="bwd", tag="regather")
                               if self.pub else
                               self._publish(r, b, step, (dep,), phase="bwd", tag="regather",
                                             stream=self.pub_stream, which="dense"))
            gathers[l] = ops

        if regather:
            gather(L - 1, fwd[L - 1])
        for l in range(L - 1, -1, -1):
            deps: list[Op] = []
            if regather:
                if l >= 1:
                    gather(l - 1, bwd[l + 1] if l + 1 < L else fwd[L - 1])
                deps = list(gathers[l])
                if self.dm and not self.sharded:
                    deps += [pubs[b] for b in self.layer_buckets.get(l, ())]
            if "drain" in self.pub and len(stage1) >= 2:  # published: the previous group's stage 1
                deps.append(stage1[-2])
            bwd[l] = self._layer_op(r, step, l, "bwd", s.layer_bwd_s[l], deps,
                                    bwd[l + 1] if l + 1 < L else fwd[L - 1])[0]
            numel, mu = self._gathered_numel(l)  # reduced like it is gathered
            if numel:
                op = self._reduce_layer(r, step, l, numel, mu, bwd[l])
                red["last"] = red["layer"][l] = op
                if s.layer_adamw_numel[l]:
                    red["adamw_last"] = op
            if self.dm and (not self.sharded or self.ep > 1):  # sharded: the experts' part only
                for b in self._first_b.get(l, ()):
                    if self.pub:  # system 'published' (simulator.programs.step_published)
                        first, op = self._pub_reduce(r, b, step, bwd[l])
                        stage1.append(first)
                        red["bucket_last"] = op or red["bucket_last"]
                    else:
                        op = self._reduce_bucket(r, b, step, bwd[l])
                    red["bucket"][b] = op
                    red["last"] = op or red["last"]
        return red

    # ---- pieces ---------------------------------------------------------------------------------

    def _adamw_s(self, numel: float, tensors: int, units: int) -> float:
        """The AdamW pass over `numel` elements in `tensors` parameters (one tensor each: whole, an FSDP2
        shard or a ZeRO piece) with its gradient preparation, one per reduction unit (`units` layers)."""
        return (self.s.elementwise_s(numel, "adamw", tensors)
                + self.s.elementwise_s(numel, "grad_prep", max(units, 1)))

    def _adamw_tensors(self) -> int:
        return sum(self.s.layer_adamw_tensors)

    def _adamw_layers(self) -> int:
        return sum(1 for n in self.s.layer_adamw_numel if n)

    def _layer_numel(self, l: int) -> int:
        return self.s.layer_adamw_numel[l] + self._layer_muon(l)

    def _layer_muon(self, l: int) -> int:
        return self.layer_muon_numel[l]

    def _local_fraction(self) -> float:
        return 1.0 / self.shard_size


def build(spec: StepSpec, overlap_slowdown: float = 0.0, comm_overlap_slowdown: float = 0.0,
          all_ranks: bool = True, jitter: tuple[float, int] = (0.0, 0)) -> Built:
    """Every rank's program for `spec.steps` steps, ready to run. all_ranks=False: only one rank of each
    set of identical programs (`CommPrograms.select`; the same times, far fewer events). jitter = (cv,
    seed): every compute op's time x a lognormal draw of that coefficient of variation (simulator.engine.engine)."""
    if spec.strategy not in STRATEGIES:
        raise InputError(f"unknown strategy {spec.strategy!r}; accepted: {', '.join(STRATEGIES)}")
    if spec.layout not in LAYOUTS:
        raise InputError(f"unknown layout {spec.layout!r}; accepted: {', '.join(LAYOUTS)}")
    if spec.strategy == "dmuon" and spec.plan is None:
        raise InputError("the dmuon strategy needs a plan")
    check_published(spec)
    streams = ("compute", "comm", "inter") if spec.layout.startswith("hsdp") else ("compute", "comm")
    if spec.strategy == "dmuon" and spec.layout.endswith("-free"):
        streams += ("pub",)  # the publications of memory='free' (see _Programs.pub_stream)
    if spec.ep_spec is not None and spec.ep_spec.ep > 1:
        streams += ("ep",)  # the EP communicator's token all-to-alls (simulator.programs.step_ep)
    if spec.strategy == "dmuon" and spec.plan.split_batches:
        streams += ("split",)  # the owner groups' collectives (simulator.programs.step_split)
    cluster = Cluster(spec.n_ranks, streams=streams, overlap_slowdown=overlap_slowdown,
                      comm_overlap_slowdown=comm_overlap_slowdown, jitter=jitter[0], seed=jitter[1])
    notes: list[str] = []
    with paused_gc():
        progs = _Programs(spec, cluster)
        reps, cluster.weight = progs.select(all_ranks)
        try:
            for r in reps:
                progs.program(r)
        except Unsupported as e:  # a group kind the classes were not refined over: every rank
            full = build(spec, overlap_slowdown, comm_overlap_slowdown, True, jitter)
            full.notes.insert(0, f"rank symmetry off: a collective over group kind {e.args[0]!r}, which "
                              "simulator.engine.symmetry does not refine over; every rank simulated")
            return full
    cluster.rep_of, cluster.mean_groups = progs.rep_of, progs.mean_groups
    if spec.layout == "sharded" and spec.strategy != "dmuon":
        notes.append(f"layout 'sharded' only changes the dmuon optimizer; {spec.strategy} runs as fsdp-keep")
    return Built(cluster, spec, notes)
