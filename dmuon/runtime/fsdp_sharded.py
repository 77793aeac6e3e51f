"""The fsdp2-sharded layout: the Muon matrices stay FSDP2-sharded (DTensor, rows split torch.chunk-style
over the shard ranks), FSDP2 moves their weights and gradients, and the optimizer runs at step():

ShardedDMuon (owner-centric): momentum on the local shards; per plan bucket, one packed
`all_to_all_single` within the shard group sends every shard of the Nesterov input to the matrix's
owner, the owner concatenates the rows, runs the plan's batched NS, and one packed `all_to_all_single`
returns each rank its rows of the update. An owner's own rows never travel: its momentum writes them
into its NS stack and it applies its rows of the update from the NS result (where every row goes:
`sharded_layout.OwnerLayout`, built once per set of active matrices). All buckets' first exchanges are
queued at once, so the exchange of bucket k+1 runs while the owner orthogonalizes bucket k; returns go
in bucket order.
HSDP (2-D mesh, replicate x shard): owners are spread over all R x S ranks and only the owner's replica
exchanges a matrix, so each NS runs once in the whole job; after applying, each rank broadcasts the new
shards of its replica's matrices over its replicate group (one async job per bucket) and the next
forward of the FSDP2 module holding them waits for it (a forward pre-hook placed before FSDP2's).

ShardedNaiveMuon (gather-then-compute): momentum on the local shards, `full_tensor()` (an all-gather)
of every Nesterov input, every rank orthogonalizes every matrix and keeps its rows of the update.

Bytes per step, P = elements of the Muon matrices, N = shard ranks (see docs/fsdp.md): FSDP2 moves
(N-1)/N P per all-gather (forward; again in backward with reshard_after_forward) and (N-1)/N P per
gradient reduce-scatter; ShardedDMuon adds 2 (N-1)/N^2 P on average (each rank sends the shards it does
not own and, as an owner, the rows it computed for the others; those in the NS iteration dtype where
that narrows the wire's without loss, see `sharded_layout`); ShardedNaiveMuon adds (N-1)/N P.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from ..optim import momentum_update, muon_apply_many_, muon_momentum_, muon_ns_input
from .bytecount import label
from .fsdp import chunk_rows, fsdp_owner_module, local_tensor, mesh_of
from .guards import submit_flags
from .planning import batch_method
from .sharded_layout import OwnerLayout
from .split_exec import row_split_batches


class _Geometry:
    """Where every Muon matrix's rows live: mesh coordinates of plan ranks, rows per shard rank."""

    def __init__(self, opt, timeout_s: float):
        import datetime

        named = [(opt.names[i], opt.params[i]) for i in range(opt.n_muon)]
        self.mesh, self.hsdp = mesh_of(named)
        grid = self.mesh.mesh if self.hsdp else self.mesh.mesh.view(1, -1)
        self.R, self.S = int(grid.shape[0]), int(grid.shape[1])
        ranks = opt.groups.global_ranks
        if sorted(ranks) != sorted(grid.flatten().tolist()):
            raise InputError(f"the optimizer's process group (ranks {list(ranks)}) differs from the ranks of "
                             f"the Muon matrices' device mesh ({grid.flatten().tolist()}); accepted: the "
                             "mesh's ranks (leave process_group=None when the mesh spans the world)")
        where = {int(g): (r, s) for r in range(self.R) for s in range(self.S) for g in [grid[r, s]]}
        self.coord = [where[g] for g in ranks]  # plan rank -> (replica, shard)
        self.r, self.s = self.coord[opt.rank]
        timeout = datetime.timedelta(seconds=timeout_s)
        # the mesh spans the world: every rank creates every group, in the same order. A mesh of part of
        # the world (a pipeline stage's dp mesh): only its members, with local synchronization, so ranks
        # of other stages neither join nor wait (groups.build_groups does the same)
        local_sync = len(ranks) != dist.get_world_size()

        def new(members, mine):
            if local_sync and not mine:
                return None
            return dist.new_group([int(g) for g in members.tolist()], timeout=timeout,
                                  use_local_synchronization=local_sync)

        self.shard_group = self.replicate_group = None
        for r in range(self.R):
            pg = new(grid[r], r == self.r)
            if r == self.r:
                self.shard_group = pg
        if self.R > 1:
            for s in range(self.S):
                pg = new(grid[:, s], s == self.s)
                if s == self.s:
                    self.replicate_group = pg
        self.rows = []  # per matrix: rows held by each shard rank
        self.cols = []
        for name, p in named:
            rows = p.shape[0]
            self.rows.append(chunk_rows(rows, self.S))
            self.cols.append(p.numel() // rows)
            have = local_tensor(p).shape[0] if p.dim() else 0
            if have != self.rows[-1][self.s]:
                want = self.rows[-1][self.s]
                raise InputError(f"{name}: the local shard has {have} rows but torch.chunk of {rows} rows "
                                 f"over {self.S} shard ranks gives {want}; accepted: FSDP2's default "
                                 "Shard(0) placement")

    def owner_coord(self, plan, i: int) -> tuple[int, int]:
        return self.coord[plan.owners[i]]

    def numel(self, i: int, s: int) -> int:
        return self.rows[i][s] * self.cols[i]


class _ShardedMixin:
    """Construction shared by both sharded classes (the Muon matrices are not in any exchange unit)."""

    sharded_variant = None  # already the sharded variant
    _muon_units = False

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        if self.layout != "fsdp2-sharded":
            raise InputError(f"{type(self).__name__} needs FSDP2-sharded Muon matrices, got layout "
                             f"{self.layout!r}")
        self.geo = _Geometry(self, self.timeout_s) if self.n_muon else None

    def _speculate(self) -> list:
        return []

    def _momentum_inputs(self, idx, group) -> dict[int, torch.Tensor]:
        """Momentum on the local shards (committed: the flags are agreed); the (rows_s, cols) NS inputs."""
        out = {}
        for i in idx:
            p = self.params[i]
            mine = local_tensor(p)
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(mine, memory_format=torch.preserve_format)
            g = local_tensor(p.grad).to(p.dtype)
            inp = muon_momentum_(g, st["momentum_buffer"], group["momentum"], group["nesterov"])
            out[i] = inp.reshape(mine.shape[0], self.geo.cols[i])
        return out

    def _apply_local(self, items, group) -> None:
        """Apply rows of the update to the local shards, items = [(matrix, its rows of the update)]: one
        foreach call per learning-rate scale (`muon_apply_many_`), not one call per matrix."""
        params, updates, scales = [], [], []
        for i, rows_update in items:
            p = self.params[i]
            mine = local_tensor(p)
            if mine.numel():
                params.append(mine)
                updates.append(rows_update.reshape(mine.shape))
                scales.append(self._lr_scale(i, group["adjust_lr"]))
        if params:
            muon_apply_many_(params, updates, group["lr"], group["weight_decay"], scales)


class ShardedDMuonSteps(_ShardedMixin):
    """The fsdp2-sharded steps of DMuon (`dmuon.distributed.ShardedDMuon`); see the module docstring."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._bcast: dict[int, object] = {}  # bucket -> handle of its replica broadcast (HSDP)
        self._waits = []
        self.ns_matrices = 0  # matrices this rank has orthogonalized (all steps)
        if self.geo is not None and self.geo.R > 1:
            self._install_waits(model)
        # split batches whose local rows are already the blocks: no all-to-all (split_exec.py)
        self._row_splits = row_split_batches(self) if getattr(self, "_split", None) is not None else []
        self._row_split_of = {i: b for b in self._row_splits for i in b.members}
        self._layouts: dict[tuple, OwnerLayout] = {}  # (plan, active set) -> where every row goes
        self._pending = None  # the step's buffers while its batches run (`_orthogonalize`)

    def _install_waits(self, model) -> None:
        bucket_of = {i: b.index for b in self.plan.buckets for i in b.members}
        by_module: dict[int, tuple[torch.nn.Module, set[int]]] = {}
        for i in range(self.n_muon):
            m = fsdp_owner_module(model, self.params[i]) or model
            by_module.setdefault(id(m), (m, set()))[1].add(bucket_of[i])
        for m, buckets in by_module.values():
            def hook(*args, _b=tuple(sorted(buckets)), **kw):
                for b in _b:
                    self._wait_bcast(b)
            self._waits.append(m.register_forward_pre_hook(hook, prepend=True))

    def _wait_bcast(self, b: int) -> None:
        h = self._bcast.pop(b, None)
        if h is not None:
            h.wait()

    def synchronize_exchanges(self) -> None:
        super().synchronize_exchanges()
        for b in list(self._bcast):
            self._wait_bcast(b)

    def close(self) -> None:
        for h in self._waits:
            h.remove()
        self._waits = []
        super().close()

    def _speculate(self):
        """Only the flag all-reduce goes out here: the momentum runs in place once the flags are agreed
        (`_muon_update`). Computing it before, while the flags travel, needs a new buffer per matrix: a
        write-allocated copy of the momentum (1/N of the matrices) that cost more than the all-reduce's
        latency it hid (docs/runtime.md)."""
        if self.plan is None:
            return None
        self._absorb_all()  # the exchange units (if any)
        if self._flags is None:
            self._flags = submit_flags(self._worker, self.groups, self._has_grad, self._nonfinite)
        return None

    def _pack(self, active: list[int]) -> dict:
        """The step's buffers for the active set's `OwnerLayout`: per bucket the send buffer (every NS input
        written straight into its place) and its splits, this rank's NS stacks with its own rows already
        in them, and the momentum buffers of my local shards (updated in place: the flags are agreed)."""
        group, geo = self.param_groups[0], self.geo
        key = (id(self.plan), tuple(active))
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = OwnerLayout(self, active)
        on = set(active)
        bufs, sends, row_stacks = {}, [], []
        for b in self._row_splits:
            if self.rank not in b.group or not any(i in on for i in b.members):
                continue
            members = [i for i in b.members if i in on]
            dtype = self.params[members[0]].dtype
            for i in members[1:]:
                dtype = torch.promote_types(dtype, self.params[i].dtype)
            stack = torch.empty((len(members), geo.rows[members[0]][geo.s], b.rows), dtype=dtype,
                                device=self.device)
            for j, i in enumerate(members):
                bufs[i] = self._momentum_input(i, group, stack[j].view(-1))
            row_stacks.append((b, members, stack))
        stacks = {}
        for key, f in lay.fills.items():  # my own rows: written into my stacks, they never travel
            stack = stacks[key] = torch.empty(f["shape"], dtype=f["dtype"], device=self.device)
            for slot, sl in zip(stack.unbind(0), f["slots"], strict=True):
                i, n = sl["index"], geo.numel(sl["index"], geo.s)
                rows = (slot.mT if sl["flip"] else slot).narrow(0, sl["lo"], sl["rows"])
                if sl["direct"] or not n:
                    bufs[i] = self._momentum_input(i, group, rows)
                else:  # through a contiguous buffer of the wire's dtype: the bits of the round trip
                    wire = torch.empty(n, dtype=lay.dtypes[sl["bucket"]], device=self.device)
                    bufs[i] = self._momentum_input(i, group, wire)
                    rows.copy_(wire.view(rows.shape))
        for k, sp in enumerate(lay.sends):
            if sp is None:
                sends.append(None)
                continue
            send = torch.empty(sum(sp["in_splits"]), dtype=lay.dtypes[k], device=self.device)
            for i, pos, n in sp["writes"]:
                bufs[i] = self._momentum_input(i, group, send.narrow(0, pos, n))
            sends.append((send, sp["in_splits"], sp["out_splits"]) if sp["moves"] else None)
        return {"active": active, "layout": lay, "sends": sends, "bufs": bufs, "row_stacks": row_stacks,
                "stacks": stacks}

    def _muon_update(self, has_any: torch.Tensor, pending) -> None:
        if self.plan is None:
            return
        for b in list(self._bcast):
            self._wait_bcast(b)
        group, geo, plan = self.param_groups[0], self.geo, self.plan
        flags = has_any.tolist()
        active = [i for i in range(self.n_muon) if flags[i]]
        pending = self._pack(active)
        on, lay = set(active), pending["layout"]
        for i, buf in pending["bufs"].items():  # commit the momentum
            self.state[self.params[i]]["momentum_buffer"] = buf
        # 1. every bucket's inputs to their owners, all queued now (FIFO on the communication thread);
        #    AdamW runs while the first ones travel
        sends = [None if sp is None else self._all_to_all(f"Muon inputs of bucket {k} to their owners", *sp)
                 for k, sp in enumerate(pending["sends"])]
        self._adamw_update(has_any)
        self._adamw_done = True
        for b, members, stack in pending["row_stacks"]:  # a row-split batch: each member its own rows
            kwargs = {**self.ns.kwargs(), "method": batch_method(plan, b)}
            out = self._split.run_rows(b, stack, kwargs)
            self.ns_matrices += len(members) if b.owner == self.rank else 0
            self._apply_local(list(zip(members, out.unbind(0), strict=True)), group)
        # 2. the owner's batches, bucket by bucket; each bucket's rows go back as soon as it is complete,
        #    copied from the update straight into the return buffer; my own rows are applied at once
        updates: dict[int, torch.Tensor] = {}
        returns = []
        self._pending = pending
        try:
            for k, batches in lay.order:
                for bt in batches:
                    self._orthogonalize(bt, on, sends, lay.bucket_of, lay.owned, updates)
                returns.append(self._return(k, lay, updates, group))
        finally:
            self._pending = None
        # 3. apply this replica's updates; HSDP: broadcast the new shards to the other replicas
        for k, ms in enumerate(lay.buckets):
            if returns[k] is not None:
                recv = returns[k].wait()
                self._apply_local([(i, recv.narrow(0, pos, n)) for i, pos, n in lay.returns[k]["applies"]],
                                  group)
            if geo.R > 1 and ms:
                self._bcast[k] = self._broadcast_replicas(k, ms, lay.dtypes[k])

    def _return(self, k: int, lay, updates, group):
        """Bucket k's rows of the update to their shards (the handle, or None where nothing travels), in
        `lay.ret_dtypes[k]`; apply my own rows (in that dtype, contiguous: the bits of the round trip)."""
        rt = lay.returns[k]
        if rt is None:
            return None
        geo, dtype, handle = self.geo, lay.ret_dtypes[k], None
        sp = lay.sends[k]
        if sp["moves"]:
            back = torch.empty(sum(sp["out_splits"]), dtype=dtype, device=self.device)
            for i, pos, lo, rows in rt["copies"]:
                cols = geo.cols[i]
                back.narrow(0, pos, rows * cols).view(rows, cols).copy_(updates[i].narrow(0, lo, rows))
            handle = self._all_to_all(f"Muon updates of bucket {k} to the shards", back, sp["out_splits"],
                                      sp["in_splits"])
        own = []
        for i, lo, rows in rt["own"]:
            mine = updates.pop(i).narrow(0, lo, rows)
            if rows:
                if mine.dtype != dtype or not mine.is_contiguous():
                    mine = torch.empty(mine.shape, dtype=dtype, device=self.device).copy_(mine)
                own.append((i, mine))
        self._apply_local(own, group)
        return handle

    def _momentum_input(self, i: int, group, out: torch.Tensor) -> torch.Tensor:
        """Momentum on the local shard of matrix i, in place (the flags are agreed): returns the buffer
        and writes the NS input into `out` (flat, the shard's elements; any dtype: the wire's). The two
        passes of `muon_momentum_`, the second writing straight into `out`."""
        p = self.params[i]
        mine = local_tensor(p)
        st = self.state[p]
        buf = st.get("momentum_buffer")
        if buf is None:
            buf = torch.zeros_like(mine, memory_format=torch.preserve_format)
        if not mine.numel():
            return buf
        g = local_tensor(p.grad).to(p.dtype)
        momentum_update(g, buf, group["momentum"], out=buf)
        muon_ns_input(g, buf, group["momentum"], group["nesterov"], out=out.view(mine.shape))
        return buf

    def _dtype(self, members) -> torch.dtype:
        """What a bucket's all-to-alls carry: `comm_dtype` where set, else the members' promoted dtype."""
        if self.comm_dtype is not None:
            return self.comm_dtype
        dtype = torch.float32
        for n, i in enumerate(members):
            dtype = self.params[i].dtype if n == 0 else torch.promote_types(dtype, self.params[i].dtype)
        return dtype

    def _all_to_all(self, name: str, send: torch.Tensor, in_splits, out_splits):
        recv = torch.empty(sum(out_splits), dtype=send.dtype, device=self.device)
        group = self.geo.shard_group

        def job():
            dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
            return recv

        sent = (sum(in_splits) - in_splits[self.geo.s]) * send.element_size()
        h = self._worker.submit(name, job, kind="all_to_all", bytes_=sent)
        h.splits = (in_splits, out_splits)
        return h

    def _orthogonalize(self, bt, on, sends, bucket_of, owned, updates) -> None:
        """Copy the received rows of the batch's matrices straight into their slots of the batch's stacks
        (built by `_pack`, my own rows already there; members of the other orientation in a stack of
        their own shape, see `OwnerLayout`), one batched NS call per stack; the updates are views of
        them."""
        geo, pending = self.geo, self._pending
        lay = pending["layout"]
        for key in lay.parts[id(bt)]:
            fill = lay.fills[key]
            stack = pending["stacks"].pop(key)
            for slot, sl in zip(stack.unbind(0), fill["slots"], strict=True):
                if sl["pieces"]:
                    recv = sends[sl["bucket"]].wait()
                    full, cols = (slot.mT if sl["flip"] else slot), geo.cols[sl["index"]]
                    for pos, row, r in sl["pieces"]:
                        full.narrow(0, row, r).copy_(recv.narrow(0, pos, r * cols).view(r, cols))
            if self.plan.matrices[bt.members[0]].count > 1:  # parameters of several matrices
                self._orthogonalize_several(bt, stack, fill, updates)
                continue
            out = self._ns(stack, batch_method(self.plan, bt), fill["out_dtype"])
            self.ns_matrices += len(fill["members"])
            for sl, u in zip(fill["slots"], out.unbind(0), strict=True):
                updates[sl["index"]] = u.mT if sl["flip"] else u

    def _orthogonalize_several(self, bt, stack, fill, updates) -> None:
        """One batched NS call over every matrix of the stack's parameters (each slot a whole parameter as
        (rows, cols); its layout cuts the matrices), the updates back as (rows, cols) per parameter."""
        lays = [self.layouts[sl["index"]] for sl in fill["slots"]]
        c = lays[0].count
        flips = [lay.piece_shape(0) != (bt.rows, bt.cols) for lay in lays]
        ns_in = torch.empty((len(lays) * c, bt.rows, bt.cols), dtype=stack.dtype, device=stack.device)
        for n, (slot, lay) in enumerate(zip(stack.unbind(0), lays, strict=True)):
            dst = ns_in[n * c:(n + 1) * c]
            (dst.mT if flips[n] else dst).copy_(lay.stack(slot))
        out = self._ns(ns_in, batch_method(self.plan, bt), fill["out_dtype"])
        self.ns_matrices += len(lays) * c
        for n, (sl, lay) in enumerate(zip(fill["slots"], lays, strict=True)):
            u = out[n * c:(n + 1) * c]
            updates[sl["index"]] = lay.unstack(u.mT if flips[n] else u).reshape(stack.shape[1:])

    def _broadcast_replicas(self, k: int, members, dtype):
        """New local shards of bucket k's matrices from the replica that owns them to the others."""
        geo, plan = self.geo, self.plan
        by_src = [[i for i in members if geo.owner_coord(plan, i)[0] == r] for r in range(geo.R)]
        bufs = []
        for r in range(geo.R):
            n = sum(geo.numel(i, geo.s) for i in by_src[r])
            if r == geo.r:
                parts = [local_tensor(self.params[i]).reshape(-1).to(dtype) for i in by_src[r]]
                bufs.append(torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=self.device))
            else:
                bufs.append(torch.empty(n, dtype=dtype, device=self.device))
        targets = [[local_tensor(self.params[i]) for i in by_src[r]] for r in range(geo.R)]
        group = geo.replicate_group

        def job():
            works = [dist.broadcast(bufs[r], group_src=r, group=group, async_op=True)
                     for r in range(geo.R) if bufs[r].numel()]
            for w in works:
                w.wait()
            for r in range(geo.R):
                if r != geo.r:
                    pos = 0
                    for t in targets[r]:
                        t.view(-1).copy_(bufs[r].narrow(0, pos, t.numel()))
                        pos += t.numel()

        n = sum(b.numel() * b.element_size() for b in bufs)
        return self._worker.submit(f"replica broadcast of bucket {k}", job, kind="replica_broadcast",
                                   bytes_=int(n * (geo.R - 1) / geo.R))


class ShardedNaiveSteps(_ShardedMixin):
    """The fsdp2-sharded steps of NaiveMuon (`dmuon.distributed.ShardedNaiveMuon`): all-gather every
    input, every NS on every rank."""

    def _muon_update(self, has_any: torch.Tensor, pending) -> None:
        if self.plan is None:
            return
        from torch.distributed.tensor import DTensor

        group = self.param_groups[0]
        flags = has_any.tolist()
        idx = [i for i in range(self.n_muon) if flags[i]]
        inputs = self._momentum_inputs(idx, group)
        fulls = []
        with label("optimizer"):
            for i in idx:
                p = self.params[i]
                wire = inputs[i] if self.comm_dtype is None else inputs[i].to(self.comm_dtype)
                d = DTensor.from_local(wire, p.device_mesh, p.placements, run_check=False,
                                       shape=torch.Size((p.shape[0], self.geo.cols[i])),
                                       stride=(self.geo.cols[i], 1))
                fulls.append(d.full_tensor().to(p.dtype))
        pieces = [m for i, f in zip(idx, fulls, strict=True) for m in self.layouts[i].pieces(f)]
        out, updates, pos = self._ns_many(pieces), [], 0
        for i, f in zip(idx, fulls, strict=True):  # each parameter's matrices back as its (rows, cols)
            lay = self.layouts[i]
            updates.append(out[pos] if lay.is_whole else lay.join(out[pos:pos + lay.count]).reshape(f.shape))
            pos += lay.count
        self.ns_matrices = getattr(self, "ns_matrices", 0) + len(pieces)
        s = self.geo.s
        self._apply_local([(i, u.narrow(0, sum(self.geo.rows[i][:s]), self.geo.rows[i][s]))
                           for i, u in zip(idx, updates, strict=True)], group)

