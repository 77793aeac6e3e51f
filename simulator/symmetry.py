"""Rank symmetry: which ranks of a step program finish every op at the same times, so that one of each
class is simulated (docs/simulator.md, "Rank symmetry").

Classes. Every rank starts with a signature: everything rank-specific its program is built from apart from
which group instances it joins (`simulator.step._Programs.rank_signature`: the plan batches it owns, the
owner exchange of its replica group, ...). Then the partition is refined over the declared group kinds
(`_Programs.group_kinds`: world, and intra / inter with HSDP, ep / rep with expert parallelism): a rank's
class is its signature plus, per group kind, the set of classes in its instance of that group, until no
class splits (colour refinement). At that fixed point every member of a class sees, in every group kind,
instances holding the same set of classes.

Why that is exact. A collective starts when the last of its participants arrives and ends for all of them
together. By induction over the events of the full simulation: members of one class issue the same ops
(same signature) and every collective they join holds the same classes, so each collective's start is the
maximum over its classes' arrivals, and members of a class arrive, start and end together. The reduced
simulation keeps one representative per class and, per group kind, one "quotient instance" per set of
classes (the real instances holding exactly those classes): the representatives of those classes meet
there, and it ends when the full simulation's instances end. What each quotient instance stands for is
counted (`copies`: bytes on the wire), and each representative's class size (`Cluster.weight`).

What is not covered (every rank is simulated then): stragglers (`jitter`: every rank draws its own
times), split batches (their owner groups are collectives outside the declared group kinds,
`simulator.step_split`), and any collective over a group kind not in `group_kinds` (detected when the
representatives' programs are built: `Unsupported`, then the full build; the result carries a note).
`DMUON_SIM_SYMMETRY=off` (or `simulate(..., all_ranks=True)`) simulates every rank, for comparison.
"""

from __future__ import annotations

import hashlib
import os

from dmuon.errors import InputError

SWITCH = "DMUON_SIM_SYMMETRY"
MODES = ("on", "off")


class Unsupported(Exception):
    """A representative's program joined a group kind the classes were not refined over."""


def enabled() -> bool:
    """Whether `simulate` simulates one rank per class (env DMUON_SIM_SYMMETRY: on, the default, or off)."""
    v = os.environ.get(SWITCH, "on").strip().lower()
    if v not in MODES:
        raise InputError(f"{SWITCH} must be one of {' | '.join(MODES)}, got {v!r}")
    return v == "on"


def rank_classes(n: int, groups, instance, signature) -> tuple[list[int], dict]:
    """(class of every rank, {group kind: {real instance: quotient instance}}) by colour refinement (module
    docstring). groups: the group kinds; instance(group, rank) -> the rank's real instance of it (hashable);
    signature(rank) -> hashable."""
    ids: dict = {}
    color = [ids.setdefault(signature(r), len(ids)) for r in range(n)]
    inst = {g: [instance(g, r) for r in range(n)] for g in groups}
    k = len(ids)
    while True:
        quot = {}
        for g in groups:
            members: dict = {}
            for r, i in enumerate(inst[g]):
                s = members.get(i)
                if s is None:
                    members[i] = {color[r]}
                else:
                    s.add(color[r])
            sets: dict = {}
            quot[g] = {i: sets.setdefault(frozenset(s), len(sets)) for i, s in members.items()}
        new_ids: dict = {}
        cols = [[quot[g][i] for i in inst[g]] for g in groups]
        new = [new_ids.setdefault(key, len(new_ids)) for key in zip(color, *cols, strict=True)]
        if len(new_ids) == k:  # no class split: the partition is stable, `quot` agrees with it
            return color, quot
        color, k = new, len(new_ids)


def result_digest(res) -> str:
    """sha256 of every field of a SimResult but provenance (files and versions), floats by repr: equal
    digests = bit-identical results."""
    d = res.to_dict()
    d.pop("provenance", None)
    return hashlib.sha256(repr(sorted(d.items())).encode()).hexdigest()


def program_fingerprints(cluster, ranks) -> dict[int, tuple]:
    """Per rank, its built program up to names and group instances: per stream the ops' (phase, step,
    duration, collective's kind / cost / group size, dependencies as (stream, position)). Ranks of one
    class must have equal fingerprints (tests/test_sim_symmetry.py checks it on a full build)."""
    out = {}
    for r in ranks:
        where, parts = {}, []
        for st in cluster.stream_names:
            for pos, o in enumerate(cluster.queues[(r, st)]):
                where[id(o)] = (st, pos)
        for st in cluster.stream_names:
            ops = []
            for o in cluster.queues[(r, st)]:
                c = o.coll
                cs = None if c is None else (c.kind, c.cost_s, c.size, c.bytes_per_rank, c.muon_fraction)
                ops.append((o.phase, o.step, o.dur, cs, tuple(where.get(id(d), "other") for d in o.deps)))
            parts.append((st, tuple(ops)))
        out[r] = tuple(parts)
    return out


__all__ = ["SWITCH", "Unsupported", "enabled", "program_fingerprints", "rank_classes", "result_digest"]
