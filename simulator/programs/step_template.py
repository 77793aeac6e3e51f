"""Program templates: one step's forward and backward ops of a rank, recorded once and replayed for the
other ranks (a mixin of `simulator.programs.step._Programs`).

Why: a MoE step program at 4096 ranks is ~7 M ops; building each through the step logic (`_forward`,
`_backward`: parts, buckets, group look-ups) cost about 1 us of Python per op on top of creating it.

Why a replay issues the same ops: a step's forward and backward depend on the rank only through (a) the group
instances of its collectives, (b) which parts its owner exchange has (EP: the replica group's experts,
`_owner_parts`, by r % ep) and (c) the ops of its previous optimizer step they wait for (`prev`: the op the
gathers wait for, per bucket the owner's batches its publication waits for, the publications of overlap=False
or, with EP, the experts' publications of the step: `_expert_step`). Layer times, parts, buckets and the
plan's bucket layers are the same on every rank. So the first rank of each (step, (b), (c)'s keys) builds them
through the step logic with a placeholder op for each of (c) and records the result: per stream the ops (name,
phase, step, duration, the collective's key and group) and per op its dependencies (earlier ops of the record
or a placeholder). (b) is the replica group's owner-exchange signature (`_exchange_key`, `_ep_signature`:
payload, largest share, owners per local index per bucket, what `owner_coll` prices), so the replica groups
with equal parts share a template (Kimi-K2-like at 4096 GPUs: 2 signatures for 64 replica groups). A replay
creates the same ops on the same streams in the same order, the collectives looked up for its own group
instances, and each placeholder replaced by that rank's ops (None dropped, as `Cluster.compute` does). Where
its instance of some collective does not exist yet (it would create it: the first rank of a group), the replay
creates it first (`_create_missing`): the record logs every collective the step logic looks up, in call order
(`CommPrograms._log`; its caches are bypassed while it records), and the missing ones are made in that order
with the record's fields and the rank's own instance (participants, copies, group name), as the step logic
would make them (tests/test_sim_template.py compares both, collectives included). With stragglers
(`jitter`) every compute op draws its time in program order: nothing is replayed then. A replay's ops are
created in C where the compiled event loop loads (simulator/engine/engine_native_replay.h, the loop of
`_replay_ops`; tests/test_sim_symmetry_replay.py compares both): ~0.25 us per op instead of ~1 us.
"""

from __future__ import annotations

from simulator.engine import engine_native
from simulator.engine.engine import Op

REPLAY = {"mode": "auto"}  # "python": replays by the Python loop even where the compiled one loads; "off":
# every step built by the step logic, nothing recorded (tests)
_OPT = -1  # placeholder references: the op the gathers wait for; -2 - b: bucket b's publication deps;
# -2 - n_buckets - k: the k-th publication of overlap=False


class TemplatePrograms:
    """`_fwd_bwd`: one step's forward and backward for the rank `program` is issuing."""

    def _fwd_bwd(self, r: int, step: int, prev: dict) -> tuple[list[Op], dict]:
        """(forward's layer ops, backward's reductions) of rank r's step, as `_forward` / `_backward`."""
        if self.c._noise is not None or self.pub or REPLAY["mode"] == "off":  # published: per-rank programs
            fwd = self._forward(r, step, prev)
            return fwd, self._backward(r, step, fwd)
        key = (step, self._exchange_key(r), tuple(prev["pubs"]))
        t = self._templates.get(key)
        if t is not None:
            got = self._replay(r, t, prev)
            if got is not None:
                return got
            fwd = self._forward(r, step, prev)
            return fwd, self._backward(r, step, fwd)
        return self._record(key, step, prev)

    def _exchange_key(self, r: int):
        """What of rank r's owner exchange its forward and backward read (b): with EP, DMuon's replica group's
        parts as `owner_coll` prices them (`_ep_signature`: the replica groups with equal parts share one
        template), else nothing (0)."""
        return self._ep_signature(r) if getattr(self, "ep", 1) > 1 and self.dm else 0

    def _placeholders(self, step: int, prev: dict) -> tuple[dict, dict]:
        nb = getattr(self, "n_buckets", 0)
        ph = {_OPT: Op(-1, "", "placeholder", "", step)}
        ph.update({-2 - b: Op(-1, "", "placeholder", "", step) for b in range(nb)})
        ph.update({-2 - nb - k: Op(-1, "", "placeholder", "", step) for k in range(len(prev["pubs"]))})
        fake = {"adam": ph[_OPT], "opt_last": ph[_OPT], "pub_deps": {b: (ph[-2 - b],) for b in range(nb)},
                "pubs": {b: ph[-2 - nb - k] for k, b in enumerate(prev["pubs"])}}
        return ph, fake

    def _record(self, key: tuple, step: int, prev: dict) -> tuple[list[Op], dict]:
        r = self._rank
        ph, fake = self._placeholders(step, prev)
        qs = self._qs
        before = {st: len(q) for st, q in qs.items()}
        self._log = log = []  # every collective looked up, in call order (CommPrograms.coll)
        try:
            fwd = self._forward(r, step, fake)
            red = self._backward(r, step, fwd)
        finally:
            self._log = None
        where = {id(o): k for k, o in ph.items()}
        streams, flat = [], []
        for st, q in qs.items():
            new = q[before[st]:]
            if new:
                streams.append((st, new))
                flat += new
        where.update((id(o), i) for i, o in enumerate(flat))
        deps = [tuple(where.get(id(d)) for d in o.deps) for o in flat]
        ex = self._expansions(prev, ph)
        for o, refs in zip(flat, deps, strict=True):  # this rank's own ops wait on its own previous ones
            if any(i is not None and i < 0 for i in refs):
                o.deps = tuple([x for i, d in zip(refs, o.deps, strict=True)
                                for x in (ex[i] if i is not None and i < 0 else (d,))])
        outs = [*fwd, red["last"], red["adamw_last"], *red["bucket"].values(), *red["layer"].values()]
        if (all(o.coll is None or id(o.coll) in self._col_of for o in flat)
                and all(None not in refs for refs in deps)
                and all(o is None or where.get(id(o), -1) >= 0 for o in outs)):
            self._templates[key] = self._template(streams, deps, where, fwd, red, flat, log)
        return fwd, red

    def _template(self, streams: list, deps: list, where: dict, fwd: list, red: dict, flat: list,
                  log: list) -> tuple:
        """What `_replay` reads: per stream its name, op count and collectives ((index in `groups`, key's
        id) each); the ops in the order the record's lie in memory (~ the order they were created: replayed
        in it, each rank's ops of all its streams stay close together, as the event loop reads them), each
        as (index in the record, stream index, position, name, phase, step, duration, index of its
        collective or -1, dependency references); the placeholders used; the outputs' references; the
        collectives the step logic looks up, in its order, as (group index, key, the record's collective),
        None where some op's collective is not among them; and the (group index, instance) pairs known to
        hold all of them (`_replay`)."""
        out_streams, groups, loc, cis = [], [], [], []
        for si, (st, ops) in enumerate(streams):
            crefs = []
            for pos, o in enumerate(ops):
                loc.append((si, pos))
                ci = -1
                if o.coll is not None:
                    ci = len(crefs)
                    g, kid = self._col_of[id(o.coll)]
                    if g not in groups:
                        groups.append(g)
                    crefs.append((groups.index(g), kid))
                cis.append(ci)
            out_streams.append((st, len(ops), crefs))
        first: dict = {}  # the collectives looked up, each at its first look-up
        for c, k, g in log:
            if id(c) not in first:
                if g not in groups:
                    groups.append(g)
                first[id(c)] = (groups.index(g), k, c)
        protos = list(first.values()) if all(o.coll is None or id(o.coll) in first for o in flat) else None
        same: dict = {}  # equal references as one tuple: the compiled replay gives their ops one deps tuple
        seq = [(fi, *loc[fi], o.name, o.phase, o.step, o.dur, cis[fi], same.setdefault(deps[fi], deps[fi]))
               for fi, o in sorted(enumerate(flat), key=lambda x: id(x[1]))]
        used = sorted({i for refs in deps for i in refs if i < 0})  # placeholders the record waits on

        def ref(o):
            return None if o is None else where[id(o)]

        out = ([ref(o) for o in fwd], {k: ref(red[k]) for k in ("last", "adamw_last")},
               {b: ref(o) for b, o in red["bucket"].items()}, {l: ref(o) for l, o in red["layer"].items()})
        return out_streams, groups, seq, used, out, protos, set()

    def _expansions(self, prev: dict, refs) -> dict:
        """Placeholder reference -> the ops of this rank's `prev` it stands for (None dropped, as
        `Cluster.compute` drops it)."""
        nb = getattr(self, "n_buckets", 0)
        pubs = list(prev["pubs"].values())
        pub_deps = prev["pub_deps"]
        ex = {}
        for i in refs:
            if i == _OPT:
                d = prev["adam"] if (self.dm and not self.sharded) else prev["opt_last"]
                ex[i] = () if d is None else (d,)
            elif i >= -1 - nb:
                d = pub_deps.get(-2 - i, ())  # a tuple (`_optimizer`), kept as it is unless it holds None
                ex[i] = d if type(d) is tuple and None not in d else tuple([x for x in d if x is not None])
            else:
                d = pubs[-2 - nb - i]
                ex[i] = () if d is None else (d,)
        return ex

    def _replay(self, r: int, t: tuple, prev: dict):
        streams, groups, seq, used, (fwd, last, bucket, layer), protos, complete = t
        insts = [self._instance(g, r)[1] for g in groups]
        if protos is not None:
            missing = {gi for gi, i in enumerate(insts) if (gi, i) not in complete}
            if missing:
                self._create_missing(protos, groups, insts, missing)
                complete.update((gi, insts[gi]) for gi in missing)
        by_inst = [self._col_by_inst.get((g, i), {}) for g, i in zip(groups, insts, strict=True)]
        names = [st for st, _, _ in streams]
        ex = self._expansions(prev, used)
        native = self._native_replay()
        if native is not None:  # the same loop in C (simulator/engine/engine_native_replay.h)
            got = native.replay(Op, seq, r, names, [crefs for _, _, crefs in streams], by_inst, ex, len(seq),
                                [n for _, n, _ in streams])
            if got is None:  # a collective of this rank's instances is missing
                return None
            flat, lists = got
        else:
            mine = []
            for _, _, crefs in streams:  # this rank's instance of every collective, or None if one is missing
                cs = [by_inst[gi].get(kid) for gi, kid in crefs]
                if None in cs:
                    return None
                cs.append(None)  # index -1: a compute op
                mine.append(cs)
            flat, lists = self._replay_ops(r, seq, names, mine, ex, [n for _, n, _ in streams])
        for st, new in zip(names, lists, strict=True):
            self._qs[st].extend(new)

        red = {k: None if i is None else flat[i] for k, i in last.items()}
        red["bucket"] = {b: None if i is None else flat[i] for b, i in bucket.items()}
        red["layer"] = {l: None if i is None else flat[i] for l, i in layer.items()}
        return [flat[i] for i in fwd], red

    def _create_missing(self, protos: list, groups: list, insts: list, missing: set) -> None:
        """The record's collectives of rank r's instances (`insts`) of the groups `missing` that do not exist
        yet, created in the order the step logic would create them (its first look-ups, `protos`), each
        with the record's fields but its own instance's participants, copies and name
        (`CommPrograms._new_coll`).
        Exact: their arguments are the same for every rank of the template's key (module docstring)."""
        colls = self.colls
        for gi, key, c in protos:
            if gi in missing:
                g, inst = groups[gi], insts[gi]
                if (key, g, inst) not in colls:
                    self._new_coll(key, g, inst, c.size, c.kind, c.cost_s, c.bytes_per_rank, c.muon_fraction,
                                   c.step, c.sm_share, c.name)

    @staticmethod
    def _replay_ops(r: int, seq: list, names: list, mine: list, ex: dict, sizes: list) -> tuple[list, list]:
        """(ops by record index, per stream its ops) of a replay: the Python loop the compiled one mirrors."""
        flat: list = [None] * len(seq)
        lists = [[None] * n for n in sizes]
        late = []
        for fi, si, pos, name, phase, step, dur, ci, refs in seq:
            if not refs:
                deps = ()
            elif len(refs) == 1 and refs[0] >= 0:
                deps = (flat[refs[0]],)
            else:
                deps = tuple([x for i in refs for x in (ex[i] if i < 0 else (flat[i],))])
            if None in deps:  # it lay before an op it waits on: set below
                late.append((fi, refs))
            flat[fi] = lists[si][pos] = Op(r, names[si], name, phase, step, dur, mine[si][ci], deps)
        for fi, refs in late:
            flat[fi].deps = tuple([x for i in refs for x in (ex[i] if i < 0 else (flat[i],))])
        return flat, lists

    def _native_replay(self):
        """The compiled module whose `replay` creates a replay's ops, or None (the Python loop): the event
        loop's module (`simulator.engine.engine_native.load`: None with DMUON_SIM_ENGINE=python or where it
        cannot be built), unless REPLAY=python."""
        if REPLAY["mode"] == "python":
            return None
        got = getattr(self, "_native_mod", False)
        if got is False:
            got = self._native_mod = engine_native.load()
        return got
