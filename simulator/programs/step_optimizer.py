"""The optimizer part of the step programs (`simulator.programs.step`): the dmuon plan's views (buckets, owners,
batches per rank), each strategy's optimizer phase, the dmuon publication and the sharded layout's
all_to_all exchange. A mixin of `simulator.programs.step._Programs`: it uses the program's streams, collectives
(`coll`) and elementwise pricing (`_adamw_s`, ...); see `simulator.programs.step` for what each phase models."""

from __future__ import annotations

from simulator.engine.engine import Op
from .step_split import SplitPrograms
from .step_template import REPLAY


class OptimizerPrograms(SplitPrograms):
    """The optimizer phase of one rank's step program (mixed into `simulator.programs.step._Programs`)."""

    # ---- dmuon plan views --------------------------------------------------------------------------
    def _prepare_plan(self) -> None:
        s = self.s
        self.dm = s.strategy == "dmuon"
        if not self.dm:
            return
        plan = s.plan
        mats = plan.matrices
        size = [m.numel for m in mats]  # each matrix's elements, read once (EP: ~70,000 matrices)
        self.bucket_of = bucket_of = [0] * len(mats)
        self.bucket_layers: list[list[int]] = []
        for b in plan.buckets:
            for i in b.members:
                bucket_of[i] = b.index
            self.bucket_layers.append(sorted({mats[i].layer for i in b.members}))
        self.n_buckets = len(plan.buckets)
        self.layer_buckets: dict[int, list[int]] = {}
        for b, layers in enumerate(self.bucket_layers):
            for layer in layers:
                self.layer_buckets.setdefault(layer, []).append(b)
        self.bucket_numel = [sum([size[i] for i in b.members]) for b in plan.buckets]
        # bucket -> {plan rank: numel}; split batches (simulator.programs.step_split): with exchange "blocks" a member
        # owns its column block (1/k of each matrix): its gradient block is reduced to it, it keeps that
        # block's momentum and publishes it; with "lead" the lead owns the whole matrix, as unsplit
        blocks = s.split_exchange == "blocks"
        self.owned = [dict() for _ in plan.buckets]
        for i, (m, g) in enumerate(zip(size, plan.groups if blocks else [(o,) for o in plan.owners],
                                       strict=True)):
            d = self.owned[bucket_of[i]]
            for o in g:
                d[o] = d.get(o, 0) + (m if len(g) == 1 else m / len(g))
        self.max_owned = [max(d.values()) for d in self.owned]  # largest single owner's share
        self.batches_of: dict[int, list] = {}
        for k, bt in enumerate(plan.batches):  # the plan's order (build_plan: readiness order per owner)
            bks = sorted({bucket_of[i] for i in bt.members})
            numel = sum([size[i] for i in bt.members])
            for o in bt.ranks:  # every member of a split batch runs its share (simulator.programs.step_split)
                share = numel / len(bt.ranks) if bt.group and blocks else (numel if o == bt.owner else 0)
                self.batches_of.setdefault(o, []).append((k, bt, bks, share))

    def _opt_signature(self, rank: int) -> tuple:
        """What rank's optimizer program reads of the plan (simulator.engine.symmetry): per owned batch, in the
        plan's order, its NS time, buckets, elements, matrices and whether it is an expert batch."""
        if not self.dm:
            return ()
        ex = self.expert_batch if self.ep > 1 else None
        return tuple((bt.ns_s, tuple(bks), share, len(bt.members), ex is not None and ex[k])
                     for k, bt, bks, share in self.batches_of.get(self.plan_rank(rank), ()))

    def plan_rank(self, rank: int) -> int:
        return rank  # the plan spans every rank in every layout (HSDP too, as the runtime plans)

    def _optimizer(self, r: int, step: int, prev: dict, red: dict) -> None:
        s, c = self.s, self.c
        cm = c.compute
        last = cm(r, "opt_overhead", s.optimizer_overhead_s, phase="opt", step=step)
        local = self._local_fraction()
        adam_numel = sum(s.layer_adamw_numel) * local
        # every pass over gradients a rank reads is preceded by the runtime's gradient preparation (sum ->
        # mean in place, one-pass non-finite check: the cost table's grad_prep), priced with the pass
        if s.strategy == "adamw":
            muon_local, muon_tensors = self._local_muon()  # simulator.programs.step_ep (EP with ddp: own experts)
            adam_numel += muon_local
            units = sum(1 for l in range(len(s.layer_adamw_numel)) if self._layer_numel(l))
            dur = self._adamw_s(adam_numel, self._adamw_tensors() + muon_tensors, units)
            last = prev["adam"] = cm(r, "adamw", dur, phase="opt", step=step, deps=(red["last"],))
        elif s.strategy == "naive":
            if adam_numel:
                last = cm(r, "adamw", self._adamw_s(adam_numel, self._adamw_tensors(), self._adamw_layers()),
                          phase="opt", step=step, deps=(red["last"],))
            prev["adam"] = last
            muon_local, muon_tensors = self._local_muon()
            muon_layers = sum(1 for ms in s.layer_muon if ms)
            last = cm(r, "momentum", s.elementwise_s(muon_local, "muon_momentum", muon_tensors)
                      + s.elementwise_s(muon_local, "grad_prep", muon_layers), phase="opt", step=step,
                      deps=(red["last"],))
            for i, k in self.naive_runs:
                numel = s.muon_numel[i]
                deps = (last,)
                grp = self._muon_group(i)  # None: whole on the rank (ddp; EP: naive's experts)
                if grp is not None:
                    col = self.coll(r, ("ag", step, "opt", i), grp, "all_gather",
                                    numel * s.grad_bytes,
                                    muon_fraction=1.0, step=step, repeat=k)
                    deps = (c.collective(col, r, phase="opt", step=step, deps=(last,)),)
                last = cm(r, f"ns{i}" if k == 1 else f"ns{i}x{k}", s.ns_naive_s[i] * k, phase="opt",
                          step=step, deps=deps)
        elif self.sharded:
            last = prev["adam"] = self._sharded_optimizer(r, step, adam_numel, red, prev)
        else:
            # the owner's batches first (their buckets arrive during backward), then the AdamW pass
            # (the embeddings' gradients are the last to be reduced); EP: the dense batches only, the
            # experts' after the AdamW pass (`_expert_step`)
            by_bucket: dict[int, list[Op]] = {}
            mine = self.batches_of.get(self.plan_rank(r), ())
            if "opt_order" in self.pub:  # published: the groups walked in the next forward's order
                mine = sorted(mine, key=lambda t: t[2])
            owned = sum(t[3] for t in mine) or 1  # a split member of exchange "lead" owns nothing
            n_owned = sum(len(t[1].members) for t in mine)
            n_buckets = len({b for t in mine for b in t[2]})
            momentum_s = (s.elementwise_s(owned, "muon_momentum", n_owned)  # one pass per step, pro rata
                          + s.elementwise_s(owned, "grad_prep", n_buckets))
            host = self._host_loop()  # published: the eager host loop (simulator.programs.published_host)
            for k, bt, bks, numel in mine:
                if self.ep > 1 and self.expert_batch[k]:
                    continue
                deps = [red["bucket"][b] for b in bks if red["bucket"].get(b) is not None]
                if "opt_order" in self.pub:  # published: no NS before the last group's reduce
                    deps.append(red["bucket_last"])
                if "fsdp2_tail" in self.pub and self._published_active():  # published: FSDP2's root
                    deps.append(red["adamw_last"])  # post-backward callback waits its reduces first
                if bt.group:
                    last = self._split_batch(r, step, k, bt, momentum_s * numel / owned, deps)
                else:
                    # the plan's batch time includes its momentum share (Batch.momentum_s) for balancing;
                    # the momentum is priced here, once, with this step's elementwise pricing
                    last = cm(r, f"batch{k}", self._host_batch(host, bt.ns_s * s.ns_stretch
                                                                + momentum_s * numel / owned, len(bt.members)),
                              phase="opt", step=step, deps=deps)
                for b in bks:
                    by_bucket.setdefault(b, []).append(last)
            prev["pub_deps"] = {b: tuple(v) for b, v in by_bucket.items()}
            if self._published_active() and self._hsdp_stages():  # simulator.programs.step_published
                self._pub_replicate(r, step, by_bucket, prev)
            elif "sync_publish" in self.pub:
                prev["pubs"] = {("sync", b): v[-1] for b, v in by_bucket.items()}
            if adam_numel:
                last = cm(r, "adamw", self._host_adamw(host, self._adamw_s(adam_numel, self._adamw_tensors(),
                                                                            self._adamw_layers())),
                          phase="opt", step=step, deps=(red["adamw_last"],))
            prev["adam"] = last
            if "sync_publish" not in self.pub:
                prev["pubs"] = {}
            if not s.overlap:
                prev["pubs"] = {b: self._publish(r, b, step + 1, prev["pub_deps"].get(b, ()), phase="opt",
                                                 op_step=step, which="dense") for b in range(self.n_buckets)}
            if self.ep > 1:
                last = self._expert_step(r, step, [t for t in mine if self.expert_batch[t[0]]], last, red,
                                         momentum_s, owned, prev)
        prev["opt_last"] = last

    def _publish(self, r: int, b: int, step: int, deps, *, phase: str, tag: str = "pub",
                 op_step: int | None = None, stream: str = "comm", which: str | None = None) -> Op:
        s = self.s
        # HSDP too: the runtime's two-level publication over every rank ("world"); EP: the dense matrices'
        # (which "dense") and the experts' over their replica group (which "experts": `_expert_step`)
        op = None
        st = step if op_step is None else op_step
        deps = tuple(deps)
        for col in self._publish_cols(r, b, step, tag, st, which):
            op = self._cop(col, r, phase, st, deps, stream)
        return op

    def _publish_cols(self, r: int, b: int, step: int, tag: str, st: int, which: str | None) -> list:
        """The collectives of bucket b's publication for the rank `program` is issuing (`_cols`)."""
        key = (tag, step, b, self._ok, which)
        cols = self._col_lists.get(key)  # simulator.programs.step._cols, without a closure per call
        if cols is None or self._log is not None:  # (a record logs its look-ups: step_template)
            s = self.s
            cols = self._cols(key, lambda: [
                self.owner_coll(r, (tag, step, b, *ptag), b, "broadcast", s.param_bytes, group, st, part)
                for group, ptag, part in self._owner_parts(r, b, which)])  # simulator.programs.step_ep
        return cols

    def _sharded_optimizer(self, r: int, step: int, adam_numel: float, red: dict, prev: dict) -> Op:
        """The sharded layout's optimizer; EP: the dense matrices only (buckets' dense parts,
        `simulator.programs.step_ep._dense_bucket`), then `ExpertMuon.step` (`_expert_step`, as in every layout;
        here after the Muon and AdamW updates, which wait for every bucket's return)."""
        s, c, cm = self.s, self.c, self.c.compute
        n = s.n_ranks
        last = None
        if adam_numel:
            last = cm(r, "adamw", self._adamw_s(adam_numel, self._adamw_tensors(), self._adamw_layers()),
                      phase="opt", step=step, deps=(red["adamw_last"],))
        dense = [self._dense_bucket(b) for b in range(self.n_buckets)]
        total = sum(d[0] for d in dense)
        n_dense = len(s.muon_numel) if self.ep == 1 else self.n_dense_muon
        to_owner: dict[int, Op] = {}
        mine = self.batches_of.get(r, ())
        ex_mine = [t for t in mine if self.ep > 1 and self.expert_batch[t[0]]]
        # one momentum pass, pro rata: the local shards of the dense matrices (EP: and the experts the rank
        # owns, whose momentum ExpertMuon keeps on their owner)
        ex_numel = sum(t[3] for t in ex_mine)
        momentum_s = s.elementwise_s(total / n + ex_numel, "muon_momentum",
                                     n_dense + sum(len(t[1].members) for t in ex_mine))
        pass_numel = total / n + ex_numel
        for b in range(self.n_buckets - 1, -1, -1):
            numel, most = dense[b]
            if not numel:
                continue
            share = momentum_s * numel / total if not ex_mine else momentum_s * (numel / n) / pass_numel
            mom = cm(r, f"momentum_b{b}", share, phase="opt", step=step,
                     deps=(red["layer"].get(self.bucket_layers[b][0]),))
            col = self.coll(r, ("a2a_to", step, b), "world", "all_to_all", numel / n * s.grad_bytes,
                            muon_fraction=1.0, max_share=most * s.grad_bytes, step=step)
            to_owner[b] = c.collective(col, r, phase="opt", step=step, deps=(mom,))
            last = mom
        by_bucket: dict[int, list[Op]] = {}
        for k, bt, bks, _numel in mine:
            if self.ep > 1 and self.expert_batch[k]:
                continue
            deps = [to_owner[b] for b in bks]
            op = (self._split_batch(r, step, k, bt, 0.0, deps) if bt.group
                  else cm(r, f"batch{k}", bt.ns_s * s.ns_stretch, phase="opt", step=step, deps=deps))
            for b in bks:
                by_bucket.setdefault(b, []).append(op)
            last = op
        for b in range(self.n_buckets - 1, -1, -1):
            numel, most = dense[b]
            if not numel:
                continue
            col = self.coll(r, ("a2a_back", step, b), "world", "all_to_all", numel / n * s.param_bytes,
                            muon_fraction=1.0, max_share=most * s.param_bytes, step=step)
            last = c.collective(col, r, phase="opt", step=step, deps=tuple(by_bucket.get(b, ())))
        prev["pubs"] = {}
        return last if self.ep == 1 else self._expert_step(r, step, ex_mine, last, red, momentum_s,
                                                           pass_numel, prev)

    def _expert_step(self, r: int, step: int, ex_mine: list, last: Op | None, red: dict, momentum_s: float,
                     pass_numel: float, prev: dict) -> Op | None:
        """`ExpertMuon.step`, which `DMuon.step` calls after its Muon and AdamW updates in every layout
        (`last`: the rank's last op of them): the owner's expert batches in plan order once every expert
        sum is in (`wait_reduce` of every unit; their reduces ran per bucket in backward), each with its
        share (numel / pass_numel) of the momentum pass `momentum_s`; then per bucket, in forward order,
        the broadcast of its experts over the replica group, after the bucket's batches (`prev["pubs"]`
        under ("ep", bucket): the next forward's layers wait for their buckets'). Returns the last batch."""
        s, cm = self.s, self._cmp  # simulator.programs.step: Cluster.compute's op, without its look-ups
        ex_by_bucket: dict[int, list[Op]] = {}
        for k, bt, bks, numel in ex_mine:
            last = cm(r, f"batch{k}", bt.ns_s * s.ns_stretch + momentum_s * numel / pass_numel, "opt", step,
                      (last, red["last"]))
            for b in bks:
                ex_by_bucket.setdefault(b, []).append(last)
        # per bucket the experts' publication (`_publish`, which "experts"), made as a template replay
        # (simulator.programs.step_template: the compiled loop where it loads): ~180,000 ops at
        # Kimi-K2-like, 4096 GPUs, the same on every rank of a replica group but for their dependencies
        key = ("ep_pubs", step, self._ok)
        tpl = self._col_lists.get(key)
        if tpl is None:  # the first rank of its replica group: the collectives, in bucket order
            tpl = self._col_lists[key] = self._rep_pub_template(r, step)
        buckets, seq, cols, lasts, crefs, by_inst = tpl
        if not seq:
            return last
        ex = {-1 - k: tuple(ex_by_bucket.get(b, ())) for k, b in enumerate(buckets)}
        native = self._native_replay()
        if native is not None:
            flat = native.replay(Op, seq, r, ["comm"], crefs, by_inst, ex, len(seq), [len(seq)])[0]
        else:
            flat = self._replay_ops(r, seq, ["comm"], [[*cols, None]], ex, [len(seq)])[0]
        self._qs["comm"].extend(flat)
        pubs = prev["pubs"]
        for b, i in zip(buckets, lasts, strict=True):
            pubs[("ep", b)] = flat[i]
        return last

    def _rep_pub_template(self, r: int, step: int) -> tuple:
        """`_pub_template` of rank r's replica group: built by `_publish_cols` for the first group with its
        owner-exchange signature (`_ep_signature`); for a later one with the same signature, the same
        template with that group's own collectives, made from the first's (`_create_missing`: their
        arguments are the signature's, so the same fields; created in the same bucket order)."""
        skey = ("ep_pubs_sig", step, self._ep_signature(r))
        base = self._col_lists.get(skey)
        if base is None or REPLAY["mode"] == "off":
            tpl = self._pub_template(step, [
                (b, cols) for b in range(self.n_buckets)
                if (cols := self._publish_cols(r, b, step + 1, "pub", step, "experts"))])
            self._col_lists.setdefault(skey, tpl)
            return tpl
        buckets, seq, cols, lasts, crefs, _ = base
        inst = self._instance("rep", r)[1]
        keys = [self._col_keys[self._col_of[id(c)][1]] for c in cols]
        self._create_missing([(0, k, c) for k, c in zip(keys, cols, strict=True)], ["rep"], [inst], {0})
        mine = [self.colls[(k, "rep", inst)] for k in keys]
        return buckets, seq, mine, lasts, crefs, [dict(enumerate(mine))]

    @staticmethod
    def _pub_template(step: int, pub_cols: list) -> tuple:
        """The experts' publications of one step as a template (`_expert_step`): the buckets, per op
        (index, stream 0, position, its collective's name, phase 'opt', step, 0 s, collective index, the
        placeholder of its bucket's batches: -1 - k for the k-th bucket), the collectives, per bucket the
        index of its last op (what the next forward waits for), and the replay's collective references."""
        buckets, seq, cols, lasts = [], [], [], []
        for k, (b, bcols) in enumerate(pub_cols):
            refs = (-1 - k,)
            for col in bcols:
                i = len(seq)
                seq.append((i, 0, i, col.name, "opt", step, 0.0, i, refs))
                cols.append(col)
            buckets.append(b)
            lasts.append(len(seq) - 1)
        return buckets, seq, cols, lasts, [[(0, j) for j in range(len(cols))]], [dict(enumerate(cols))]
