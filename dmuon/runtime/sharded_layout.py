"""Where every row goes in one fsdp2-sharded owner step (`fsdp_sharded.ShardedDMuonSteps`), computed
once per set of active matrices and reused every step that has the same set.

Per plan bucket: the packed send buffer of the NS inputs (each local shard's slice), the split sizes of
the two all-to-alls, and for each of this rank's NS batches where every received piece lands in its
stack. An owner's own rows never travel: its momentum writes them straight into its stack (so the
all-to-alls carry 0 elements to and from the rank itself), and it applies its own rows of the update
straight from the NS result, without the return buffer. A bucket whose all-to-all would carry nothing on
any rank of the shard group (one shard rank) runs no collective at all; every rank of the group
computes the same answer from the geometry.

Pieces keep the copy they had before (same source layout, same kernels), so the results are bitwise
those of a round trip through the all-to-alls: an own piece goes through a contiguous buffer first where
the stack slot is transposed (a tall member of a wide batch) or of another dtype than the wire's.

The updates go back in the NS iteration dtype where every batch of the bucket iterates in the same one
and it is a lossless narrowing of the wire's (bf16 or fp16 NS of fp32 matrices: `ret_dtypes`; the NS
result is kept in it, `fills[...]["out_dtype"]`): the same bits arrive as in the wire's dtype, in half the
bytes, and the NS call skips its conversion pass. The inputs keep the wire's dtype (rounding them would
change the NS input's normalization).
"""

from __future__ import annotations

import torch

from ..newton_schulz import iteration_dtype, lossless_narrower
from .planning import batch_method, own_orientation_stacks


class OwnerLayout:
    """Index tables of one active set (see the module docstring); no tensors."""

    def __init__(self, opt, active):
        geo, plan, rank = opt.geo, opt.plan, opt.rank
        me, S = geo.s, geo.S
        on = set(active)
        rows_split = opt._row_split_of
        self.active = list(active)
        self.buckets = [[i for i in b.members if i in on] for b in plan.buckets]
        owner_s = {i: geo.owner_coord(plan, i)[1] for ms in self.buckets for i in ms}
        self.mine = [[i for i in ms if geo.owner_coord(plan, i)[0] == geo.r and i not in rows_split]
                     for ms in self.buckets]
        self.owned = [[i for i in ms if plan.owners[i] == rank and i not in rows_split]
                      for ms in self.buckets]
        self.dtypes = [opt._dtype(ms) for ms in self.buckets]
        self.bucket_of = {i: k for k, ms in enumerate(self.buckets) for i in ms}
        it_dtype = {i: iteration_dtype(batch_method(plan, bt), opt.device, opt.ns.dtype)
                    for bt in plan.batches for i in bt.members}  # the same answer on every rank
        self.ret_dtypes = []  # per bucket: what its updates travel in (see the module docstring)
        for k, ms in enumerate(self.buckets):
            its = {it_dtype[i] for i in ms if i not in rows_split}
            narrow = its.pop() if len(its) == 1 else None
            self.ret_dtypes.append(narrow if narrow is not None and lossless_narrower(narrow, self.dtypes[k])
                                   else self.dtypes[k])
        self.sends = []  # per bucket: None (no members in my replica) or the exchange's tables
        for k, ms in enumerate(self.mine):
            if not ms:
                self.sends.append(None)
                continue
            dest = [[i for i in ms if owner_s[i] == s and s != me] for s in range(S)]
            in_splits = [sum(geo.numel(i, me) for i in ds) for ds in dest]
            out_splits = [0 if s == me else sum(geo.numel(i, s) for i in self.owned[k]) for s in range(S)]
            writes, pos = [], 0  # (matrix, offset in the send buffer, elements)
            for i in (i for ds in dest for i in ds):
                writes.append((i, pos, geo.numel(i, me)))
                pos += geo.numel(i, me)
            moves = any(geo.numel(i, s) for i in ms for s in range(S) if s != owner_s[i])  # group-wide
            self.sends.append(dict(in_splits=in_splits, out_splits=out_splits, writes=writes, moves=moves))
        # my NS batches in the order they run: bucket by bucket, a batch at its first bucket
        batches = [bt for bt in plan.batches_of(rank) if any(i in on for i in bt.members)
                   and not any(bt is b for b in opt._row_splits)]
        self.order = []  # (bucket, [batches that run before its returns go out])
        for k in range(len(self.buckets)):
            now = [bt for bt in batches if any(self.bucket_of.get(i) == k for i in bt.members)]
            for bt in now:
                batches.remove(bt)
            self.order.append((k, now))
        self.fills = {}  # (id(batch), part) -> one NS stack: its members and where each piece comes from
        self.parts = {}  # id(batch) -> its stacks' keys, in the order they run
        for bt in (bt for _, bts in self.order for bt in bts):
            if bt.owner != rank:
                continue
            members = [i for i in bt.members if i in on]
            dtype = opt.params[members[0]].dtype
            for i in members[1:]:
                dtype = torch.promote_types(dtype, opt.params[i].dtype)
            several = opt.plan.matrices[members[0]].count > 1  # parameters of several matrices: each slot
            # holds its parameter as the rows arrive, (rows, cols); `_orthogonalize` cuts its matrices
            flips = {i: not several and (opt.params[i].shape[0], geo.cols[i]) != (bt.rows, bt.cols)
                     for i in members}
            # tall members of a wide batch (or the other way round) get a stack of their own shape where
            # the NS iterates them as they are: their rows are copied straight, never through a transposed
            # view; else (a split batch: its group splits that stack's columns; Triton kernels)
            # one stack, the flipped members through a transposed view
            own = not several and own_orientation_stacks(opt.plan, bt, opt.ns, opt.params[members[0]].device)
            parts = [[i for i in members if flips[i] == f] for f in (False, True)] if own else [members]
            self.parts[id(bt)] = []
            for part, ms in enumerate(p for p in parts if p):
                slots = []
                for i in ms:
                    k = self.bucket_of[i]
                    flip = flips[i] and not own  # through a transposed view of a shared stack
                    pieces, pos = [], 0  # recv = concat over s != me of (concat over owned[k])
                    for s in range(S):
                        for j in self.owned[k]:
                            n = 0 if s == me else geo.numel(j, s)
                            if j == i and n:
                                pieces.append((pos, sum(geo.rows[i][:s]), geo.rows[i][s]))
                            pos += n
                    slots.append(dict(index=i, bucket=k, flip=flip, pieces=pieces, lo=sum(geo.rows[i][:me]),
                                      rows=geo.rows[i][me], direct=not flip and dtype == self.dtypes[k]))
                shape = (bt.cols, bt.rows) if own and flips[ms[0]] else (bt.rows, bt.cols)
                if several:
                    shape = (opt.params[ms[0]].shape[0], geo.cols[ms[0]])
                key = (id(bt), part)
                it = it_dtype[ms[0]]  # the NS result kept in the iteration dtype where that loses nothing
                self.fills[key] = dict(members=ms, dtype=dtype, shape=(len(ms), *shape), slots=slots,
                                       out_dtype=it if lossless_narrower(it, dtype) else None)
                self.parts[id(bt)].append(key)
        stacked = {sl["index"] for f in self.fills.values() for sl in f["slots"]}
        missing = [i for ms in self.owned for i in ms if i not in stacked]
        if missing:
            raise RuntimeError(f"rank {rank}: matrices {missing} are owned here but in no batch this rank "
                               "owns; the plan's owners and batches disagree")
        self.returns = []  # per bucket: None or (what the owner copies into the return buffer, applies)
        for k, ms in enumerate(self.mine):
            if not ms:
                self.returns.append(None)
                continue
            copies, pos = [], 0  # (matrix, offset in the return buffer, first row, rows)
            for s in range(S):
                for i in self.owned[k]:
                    if s == me:
                        continue
                    n = geo.numel(i, s)
                    if n:
                        copies.append((i, pos, sum(geo.rows[i][:s]), geo.rows[i][s]))
                    pos += n
            applies, pos = [], 0  # (matrix, offset in the received buffer, elements)
            for s in range(S):
                for i in ms:
                    if owner_s[i] == s and s != me:
                        applies.append((i, pos, geo.numel(i, me)))
                        pos += geo.numel(i, me)
            own = [(i, sum(geo.rows[i][:me]), geo.rows[i][me]) for i in self.owned[k]]
            self.returns.append(dict(copies=copies, applies=applies, own=own))
