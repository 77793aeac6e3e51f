"""Program templates: one step's forward and backward ops of a rank, recorded once and replayed for the
other ranks (a mixin of `simulator.step._Programs`).

Why: a MoE step program at 4096 ranks is ~7 M ops; building each through the step logic (`_forward`,
`_backward`: parts, buckets, group look-ups) cost about 1 us of Python per op on top of creating it.

Why a replay issues the same ops: a step's forward and backward depend on the rank only through (a) the
group instances of its collectives, (b) which parts its owner exchange has (EP: the replica group's
experts, `_owner_parts`, by r % ep) and (c) the ops of its previous optimizer step they wait for (`prev`:
the op the gathers wait for, per bucket the owner's batches its publication waits for, the publications of
overlap=False). Layer times, parts, buckets and the plan's bucket layers are the same on every rank. So the
first rank of each (step, r % ep) builds them through the step logic with a placeholder op for each of (c)
and records the result: per stream the ops (name, phase, step, duration, the collective's key and group)
and per op its dependencies (earlier ops of the record or a placeholder). A replay creates the same ops
on the same streams in the same order, the collectives looked up for its own group instances, and each
placeholder replaced by that rank's ops (None dropped, as `Cluster.compute` does). A rank whose instance
of some collective does not exist yet (it would create it: the first rank of a group) is built through the
step logic, so collectives are created in the same order as without templates. With stragglers (`jitter`)
every compute op draws its time in program order: nothing is replayed then.
"""

from __future__ import annotations

from .engine import Op

_OPT = -1  # placeholder references: the op the gathers wait for; -2 - b: bucket b's publication deps;
# -2 - n_buckets - k: the k-th publication of overlap=False


class TemplatePrograms:
    """`_fwd_bwd`: one step's forward and backward for the rank `program` is issuing."""

    def _fwd_bwd(self, r: int, step: int, prev: dict) -> tuple[list[Op], dict]:
        """(forward's layer ops, backward's reductions) of rank r's step, as `_forward` / `_backward`."""
        if self.c._noise is not None:
            fwd = self._forward(r, step, prev)
            return fwd, self._backward(r, step, fwd)
        key = (step, self._ok, tuple(prev["pubs"]))
        t = self._templates.get(key)
        if t is not None:
            got = self._replay(r, t, prev)
            if got is not None:
                return got
            fwd = self._forward(r, step, prev)
            return fwd, self._backward(r, step, fwd)
        return self._record(key, step, prev)

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
        fwd = self._forward(r, step, fake)
        red = self._backward(r, step, fwd)
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
            self._templates[key] = self._template(streams, deps, where, fwd, red)
        return fwd, red

    def _template(self, streams: list, deps: list, where: dict, fwd: list, red: dict) -> tuple:
        """What `_replay` reads: per stream (name, phase, step, duration, index of its collective in the
        stream's collectives or -1) and the collectives' (index in `groups`, key's id); the dependencies as
        (op, op) pairs, (op, refs) with only ops of the record, (op, refs) with placeholders; the places
        placeholders are used; the outputs' references."""
        out_streams, groups = [], []
        for st, ops in streams:
            entries, crefs = [], []
            for o in ops:
                ci = -1
                if o.coll is not None:
                    ci = len(crefs)
                    g, kid = self._col_of[id(o.coll)]
                    if g not in groups:
                        groups.append(g)
                    crefs.append((groups.index(g), kid))
                entries.append((o.name, o.phase, o.step, o.dur, ci))
            out_streams.append((st, entries, crefs))
        single, multi, mixed = [], [], []
        for j, refs in enumerate(deps):
            if not refs:
                continue
            if min(refs) < 0:
                mixed.append((j, refs))
            elif len(refs) == 1:
                single.append((j, refs[0]))
            else:
                multi.append((j, refs))

        def ref(o):
            return None if o is None else where[id(o)]

        out = ([ref(o) for o in fwd], {k: ref(red[k]) for k in ("last", "adamw_last")},
               {b: ref(o) for b, o in red["bucket"].items()}, {l: ref(o) for l, o in red["layer"].items()})
        used = sorted({i for _, refs in mixed for i in refs if i < 0})  # placeholders the record waits on
        return out_streams, groups, single, multi, mixed, used, out

    def _expansions(self, prev: dict, refs) -> dict:
        """Placeholder reference -> the ops of this rank's `prev` it stands for (None dropped, as
        `Cluster.compute` drops it)."""
        nb = getattr(self, "n_buckets", 0)
        pubs = list(prev["pubs"].values())
        ex = {}
        for i in refs:
            if i == _OPT:
                d = prev["adam"] if (self.dm and not self.sharded) else prev["opt_last"]
                ex[i] = () if d is None else (d,)
            elif i >= -1 - nb:
                ex[i] = tuple([d for d in prev["pub_deps"].get(-2 - i, ()) if d is not None])
            else:
                d = pubs[-2 - nb - i]
                ex[i] = () if d is None else (d,)
        return ex

    def _replay(self, r: int, t: tuple, prev: dict):
        streams, groups, single, multi, mixed, used, (fwd, last, bucket, layer) = t
        p, e = self.s.per_node, self.ep
        inst = {"world": 0, "intra": r // p, "inter": r % p, "ep": r // e, "rep": r % e}
        by_inst = [self._col_by_inst.get((g, inst[g]), {}) for g in groups]
        mine = []
        for _, _, crefs in streams:  # this rank's instance of every collective, or None if one is missing
            cs = [by_inst[gi].get(kid) for gi, kid in crefs]
            if None in cs:
                return None
            cs.append(None)  # index -1: a compute op
            mine.append(cs)
        flat: list[Op] = []
        for (st, entries, _), cs in zip(streams, mine, strict=True):
            new = [Op(r, st, name, phase, step, dur, cs[ci], ()) for name, phase, step, dur, ci in entries]
            self._qs[st].extend(new)
            flat += new
        for j, i in single:
            flat[j].deps = (flat[i],)
        get = flat.__getitem__
        for j, refs in multi:
            flat[j].deps = tuple(map(get, refs))
        if mixed:
            ex = self._expansions(prev, used)
            for j, refs in mixed:
                flat[j].deps = tuple([x for i in refs for x in (ex[i] if i < 0 else (flat[i],))])

        def op(i):
            return None if i is None else flat[i]

        red = {k: op(i) for k, i in last.items()}
        red["bucket"] = {b: op(i) for b, i in bucket.items()}
        red["layer"] = {l: op(i) for l, i in layer.items()}
        return [flat[i] for i in fwd], red
