"""The step programs' collectives: process-group instances, how each collective is priced, the gradient
reductions of backward, the owner exchange, and which ranks need simulating at all.

Pricing (`simulator.fabric.collectives.collective_time_s`, every collective NCCL-native, `nccl=True`):
  FSDP's all-gathers and reduce-scatters, naive's full-gradient all-gathers, DDP's and HSDP's all-reduces:
      what NCCL picks itself: flat rings for all-gather / reduce-scatter (their latency grows with every
      rank of the ring: (n - M) NVLink steps + (M - 1) network steps), ring or double binary tree for
      all-reduce, whichever its tuner model prices lower.
  dmuon's owner exchange (gradients to owners in backward, publication of the new weights), as the
      runtime's `dmuon.runtime.exchange` issues it: per bucket the mode the runtime's "auto" picks on
      NCCL (`exchange.choose_mode`, the same function `units.auto_mode` calls, given the profile's fabric:
      largest measured intra-node busbw, NIC x inter efficiency, NCCL latencies): "reduce_scatter" (one
      reduce-scatter / all-gather of the owner chunks padded to the largest, n x C bytes) where its
      alpha-beta estimate is lower, else "reduce" (one reduce / broadcast per owner with a chunk, issued
      one after another on one communicator: latency once per owner); two-level (intra, then inter per
      local index) where `StepSpec.hierarchical` (the runtime's node_size), else flat over the group;
      EP's replica group always flat (`ExpertMuon`'s process groups have no node_size).
  Each collective holds `StepSpec.sm_share` of its participants' SMs while it runs (simulator.engine.engine);
  one over a group of one GPU per node (HSDP's replicate group) `StepSpec.sm_share_net` (`_sm_share`).

Which ranks are simulated: one per class of ranks whose programs are the same and whose collectives meet
the same classes (`select`, `rank_signature`, `group_kinds`; simulator.engine.symmetry and docs/simulator.md,
"Rank symmetry"). Exact: each collective counts only its simulated participants (`Collective.size` keeps
the real group size for bytes, `copies` the real instances it stands for) and the metrics read every
rank's times from its class's representative (`Cluster.weight`, `Cluster.rep_of`).
"""

from __future__ import annotations

from collections import Counter

from dmuon.errors import InputError
from dmuon.plan.exchange_cost import LinkEstimate, choose_mode

from simulator.fabric.collectives import Group, bytes_per_rank, collective_time_s
from simulator.engine.engine import Op
from simulator.engine.symmetry import Unsupported, rank_classes

GROUP_KINDS = ("world", "intra", "inter", "ep", "rep")  # what `_real_instance` knows


class CommPrograms:
    """Collectives of the step programs (mixed into `simulator.programs.step._Programs`)."""

    present: dict = {}  # (group, instance) -> simulated participants (set by `select`)
    copies: dict = {}  # (group, quotient instance) -> the real instances it stands for (set by `select`)
    _quot = None  # group kind -> {real instance: quotient instance} with rank symmetry (set by `select`)
    _log = None  # while a template is recorded: every (collective, key, group) looked up, in call order

    # ---- groups ----------------------------------------------------------------------------------
    def _real_instance(self, group: str, rank: int) -> tuple[Group, int]:
        if group == "world":
            return self.world, 0
        if group == "intra":
            return self.intra, rank // self.s.per_node
        if group == "ep":  # simulator.programs.step_ep: E consecutive ranks
            return self.ep_group, rank // self.ep
        if group == "rep":  # the ranks holding the same experts
            return self.rep_group, rank % self.ep
        if group == "inter":
            return self.inter, rank % self.s.per_node
        raise InputError(f"unknown process group kind {group!r}; accepted: {', '.join(GROUP_KINDS)}")

    def _instance(self, group: str, rank: int) -> tuple[Group, int]:
        """The group and the instance of it `rank` joins: the real one, or with rank symmetry its quotient
        instance (simulator.engine.symmetry: the instances holding the same classes are one)."""
        g, inst = self._real_instance(group, rank)
        q = self._quot
        if q is not None:
            if group not in q:
                raise Unsupported(group)
            inst = q[group][inst]
        return g, inst

    def coll(self, rank: int, key: tuple, group: str, kind: str, size_bytes: float, *, muon_fraction: float,
             max_share: float = 0.0, step: int = 0, repeat: int = 1, nccl: bool = True, owners: int = 1,
             owners_per_local: int = 1, flat: bool = False, coalesced: bool = False):
        """The collective `key` of rank's group instance (created once per instance); repeat: it stands for
        that many back-to-back collectives of `size_bytes` (their summed time and bytes); flat: never
        two-level (owner reduces / broadcasts issued as plain torch.distributed calls)."""
        if group == "world":
            g, inst = self.world, 0
        else:
            g, inst = self._instance(group, rank)
        full = (key, group, inst)
        c = self.colls.get(full)
        if c is None:
            n = g.size
            # priced once per shape: the instances of a group kind repeat the same arguments (a pure function)
            how = (kind, type(size_bytes), size_bytes, g, self.s.hierarchical and not flat, max_share, nccl,
                   owners, owners_per_local, coalesced)
            cost = self._costs.get(how) if hasattr(self, "_costs") else None
            if cost is None:
                cost = self.__dict__.setdefault("_costs", {})[how] = collective_time_s(
                    kind, size_bytes, g, self.s.network, hierarchical=self.s.hierarchical and not flat,
                    max_share_bytes=max_share, nccl=nccl, owners=owners, owners_per_local=owners_per_local,
                    coalesced=coalesced)
            c = self._new_coll(key, group, inst, n, kind, cost * repeat, bytes_per_rank(kind, size_bytes, n) * repeat,
                               muon_fraction, step, self._sm_share(g))
        if self._log is not None:  # a template's record (simulator.programs.step_template)
            self._log.append((c, key, group))
        return c

    def _new_coll(self, key: tuple, group: str, inst: int, n: int, kind: str, cost_s: float, per_rank: float,
                  muon_fraction: float, step: int, sm_share: float, name: str | None = None):
        """Create the collective `key` of a group instance (`coll`, or a replay making its rank's instance
        from the record's: simulator.programs.step_template), registered for the look-ups and replays; name:
        `key` joined by "/" (an instance's collective has the same name as the record's)."""
        c = self.c.new_collective(name or "/".join(str(k) for k in key), kind,
                                  self.present.get((group, inst), n), cost_s, bytes_per_rank=per_rank,
                                  muon_fraction=muon_fraction, group=f"{group}{inst}",
                                  step=step, sm_share=sm_share, size=n)
        c.copies = self.copies.get((group, inst), 1)  # the real instances it stands for (symmetry)
        self.colls[(key, group, inst)] = c
        kid = self._col_ids.setdefault((key, group), len(self._col_ids))  # simulator.programs.step_template
        if kid == len(self._col_keys):
            self._col_keys.append(key)  # key's id -> key
        self._col_of[id(c)] = (group, kid)
        self._col_by_inst.setdefault((group, inst), {})[kid] = c
        return c

    def _sm_share(self, g: Group) -> float:
        """SMs a collective over `g` holds: a network-only ring (one GPU per node, e.g. HSDP's replicate
        all-reduce) has NCCL's NIC-sized channel count (`StepSpec.sm_share_net`), else `sm_share`."""
        net = self.s.sm_share_net
        return net if net is not None and g.per_node == 1 and g.nodes > 1 else self.s.sm_share

    # ---- dmuon's owner exchange ------------------------------------------------------------------
    def owner_coll(self, r: int, key: tuple, b: int, kind: str, elem_bytes: int, group: str, step: int,
                   part: tuple | None = None):
        """Bucket b's owner exchange (kind "reduce": gradients to owners; "broadcast": publication), in the
        mode and shape the runtime issues it (module docstring). part: (payload, largest owner's share,
        {owner: numel}) of a part of the bucket (expert parallelism, simulator.programs.step_ep), else the bucket."""
        g, inst = self._instance(group, r)
        c = self.colls.get((key, group, inst))  # created by an earlier rank of this instance (as in coll)
        if c is not None:
            if self._log is not None:  # a template's record (simulator.programs.step_template)
                self._log.append((c, key, group))
            return c
        ck = (b, kind, group) if part is None else (b, kind, group, inst)
        # the experts' replica group (EP) is flat: ExpertMuon's process group has no node_size
        two_level = self.s.hierarchical and group != "rep"
        shape = self._owner_shapes.get(ck) if hasattr(self, "_owner_shapes") else None
        if shape is None:
            n = g.size
            whole = (self.bucket_numel[b], self.max_owned[b], self.owned[b])
            payload, chunk, owners = whole if part is None else part
            per_local = Counter(o % self.s.per_node for o in owners) if g.nodes > 1 else Counter()
            k_local = max(per_local.values(), default=1)
            mode = choose_mode(payload * elem_bytes, chunk * elem_bytes, len(owners), k_local, n,
                               g.per_node, two_level, self._links(), self.s.network.backend)
            if mode == "reduce_scatter":  # one reduce-scatter / all-gather of padded chunks
                shape = ("reduce_scatter" if kind == "reduce" else "all_gather", n * chunk, 0, 1, 1)
            else:
                shape = (kind, payload, chunk, len(owners), k_local)
            self.__dict__.setdefault("_owner_shapes", {})[ck] = shape
        k, numel, chunk, owners, per_local = shape
        if k != kind:
            return self.coll(r, key, group, k, numel * elem_bytes, muon_fraction=1.0, step=step,
                             nccl=not two_level, flat=not two_level)
        return self.coll(r, key, group, kind, numel * elem_bytes, muon_fraction=1.0,
                         max_share=chunk * elem_bytes, step=step, owners=owners, owners_per_local=per_local,
                         flat=not two_level)

    def _links(self) -> LinkEstimate:
        """The fabric estimate the exchange mode is chosen with: the profile's own numbers (largest
        measured intra-node busbw, NIC x inter efficiency, NCCL latencies), as `auto_mode` would be given."""
        net = self.s.network
        nic = net.nic_Bps_per_node * net.inter_efficiency
        return LinkEstimate(net.curves["all_gather"].busbw_Bps[-1], nic, net.base_latency_s,
                            net.intra_alpha_s, net.inter_alpha_s)

    # ---- backward's gradient reductions ----------------------------------------------------------
    def _reduce_layer(self, r: int, step: int, l: int, numel: int, mu: int, dep: Op) -> Op | None:
        op = None  # EP: the dense part over the shard group, the local experts over the replica group
        pairs = self._cols(("red", step, l, self._rk), lambda: [  # simulator.programs.step._cols
            self._reduce_colls(r, step, (l, *tag), grp, k, m)
            for grp, k, m, tag in self._fsdp_parts(l, numel, mu)])
        for col, inter in pairs:
            op = self._cop(col, r, "bwd", step, (dep,))
            if inter is not None:
                op = self._cop(inter, r, "bwd", step, (op,), stream="inter")
        return op

    def _reduce_colls(self, r: int, step: int, lk: tuple, grp, numel: int, mu: int) -> tuple:
        """(the reduction of one part of a layer's gradients on the comm stream, HSDP's all-reduce of the
        shard across nodes on the inter stream, else None)."""
        s = self.s
        frac = mu / numel
        size = numel * s.grad_bytes
        # ddp: all-reduced; EP: the experts over their replica group, all-reduced where they are whole
        if self.shard is None or (grp == "rep" and self.whole_experts):
            col = self.coll(r, ("ar", step, *lk), grp or "world", "all_reduce", size, muon_fraction=frac,
                            step=step)
            return col, None
        col = self.coll(r, ("rs", step, *lk), grp, "reduce_scatter", size, muon_fraction=frac, step=step)
        inter = None
        if self.replicate == "inter" and grp != "rep":  # EP's replica group spans the nodes already
            inter = self.coll(r, ("ar", step, *lk), "inter", "all_reduce", size / s.per_node,
                              muon_fraction=frac, step=step)
        return col, inter

    def _reduce_bucket(self, r: int, b: int, step: int, dep: Op) -> Op:
        """Muon gradients of bucket b to their owners (dmuon, replicated or FSDP/HSDP layouts)."""
        s = self.s
        # HSDP too: the runtime reduces each owner's chunk over every rank (two-level: in the node to the
        # owner's local index, then across nodes to the owner), so each NS runs once in the job
        op = None  # EP: the dense matrices over the world, this EP rank's experts over its replica group
        for col in self._cols(("reduce", step, b, self._ok), lambda: [  # simulator.programs.step._cols
                self.owner_coll(r, ("reduce", step, b, *tag), b, "reduce", s.grad_bytes, group, step, part)
                for group, tag, part in self._owner_parts(r, b)]):
            op = self._cop(col, r, "bwd", step, (dep,))
        return op

    # ---- which ranks to simulate (simulator.engine.symmetry) --------------------------------------------
    def rank_signature(self, rank: int) -> tuple:
        """Everything rank-specific rank's program is built from, apart from the group instances it joins
        (those refine the classes: simulator.engine.symmetry): dmuon's owned plan batches and, with EP, its replica
        group's owner exchange (`_opt_signature`, `_ep_signature`). A new rank-specific input of the
        programs must be added here, or the classes would merge ranks whose programs differ."""
        return (self._opt_signature(rank), self._ep_signature(rank))

    def group_kinds(self) -> tuple[str, ...]:
        """The group kinds the programs' collectives run over, apart from the world (one instance)."""
        kinds = ("intra", "inter") if self.s.layout.startswith("hsdp") else ()
        return kinds + (("ep", "rep") if getattr(self, "ep", 1) > 1 else ())

    def _mean_groups(self, plan) -> list[tuple[int, int]]:
        """[(first rank, ranks)] the exposed-communication mean sums, in rank order, each group's time x
        its size: the groups of identical ranks the simulator used before rank symmetry (every rank of
        EP DMuon or split plans; one node per distinct tuple of owners with HSDP; else each owner and one
        rank for the rest), so the mean keeps its floating-point sum, bit for bit, whichever ranks are
        simulated (the ranks of a group have equal times: they are of one class)."""
        s = self.s
        n, p = s.n_ranks, s.per_node
        if plan is not None and (getattr(self, "ep", 1) > 1 or getattr(plan, "split_batches", None)):
            return [(r, 1) for r in range(n)]
        owners = set(plan.owners) if plan is not None else set()
        if s.layout.startswith("hsdp"):
            first: dict = {}
            count: Counter = Counter()
            for node in range(n // p):
                sig = tuple((r,) if r in owners else () for r in range(node * p, node * p + p))
                count[first.setdefault(sig, node)] += 1
            return [(node * p + i, count[node]) for node in sorted(count) for i in range(p)]
        count = Counter(r if r in owners else -1 for r in range(n))
        firsts = {k: (k if k >= 0 else next(r for r in range(n) if r not in owners)) for k in count}
        return sorted((firsts[k], c) for k, c in count.items())

    def select(self, all_ranks: bool = False) -> tuple[list[int], list[int]]:
        """(ranks to simulate, how many ranks each stands for); sets the quotient instances, their
        participants (`present`) and what each stands for (`copies`)."""
        n = self.s.n_ranks
        self._quot, self.present, self.copies = None, {}, {}
        plan = self.s.plan if getattr(self, "dm", False) else None
        self.mean_groups = self._mean_groups(plan)
        if all_ranks or (plan is not None and getattr(plan, "split_batches", None)):
            self.rep_of = list(range(n))
            return list(range(n)), [1] * n
        kinds = self.group_kinds()
        color, quot = rank_classes(n, kinds, lambda g, r: self._real_instance(g, r)[1], self.rank_signature)
        first: dict = {}
        weight = [0] * n
        for r, c in enumerate(color):
            f = first.setdefault(c, r)
            weight[f] += 1
        self.rep_of = [first[c] for c in color]
        reps = sorted(first.values())
        self._quot = {"world": {0: 0}, **quot}
        self.present = {("world", 0): len(reps)}
        for g in kinds:
            for q in quot[g].values():
                self.copies[(g, q)] = self.copies.get((g, q), 0) + 1
            for r in reps:
                key = (g, quot[g][self._real_instance(g, r)[1]])
                self.present[key] = self.present.get(key, 0) + 1
        return reps, weight
