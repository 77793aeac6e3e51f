"""Expert parallelism in `DMuon(model, ep=E)`: the expert half of the step (`ExpertMuon`), executing the
expert part of a `dmuon.plan.ep` plan. The dense half is DMuon's own machinery, in any of its layouts
(replicated, fsdp2-owner, fsdp2-sharded; docs/fsdp.md), on the dense part of the same plan.

The model as MoE code holds it under expert parallelism of degree ep (`dmuon.plan.ep.EPLayout`): per MoE
layer, every rank holds its EP rank's E / ep experts stored as 3-D parameters (E_local, out, in) whose name
holds `.experts.` (e.g. `layers.0.mlp.experts.w_up`); rank r holds the experts k E_local .. (k + 1) E_local
- 1 of each such parameter, k = r % ep. Each expert slice is one Muon matrix (the planner sees it as
`layers.0.mlp.experts.<e>.w_up`), not the 3-D tensor as one matrix. The expert parameters are plain
tensors (with FSDP2: left out of `fully_shard` through `ignored_params`, as `dmuon.shard_model(model,
layout, ep=E)` does); the dense ones are laid out as DMuon's layout expects.

Gradients, as the training step leaves them in `.grad`: dense parameters as in DMuon's layouts (the step
averages them over all ranks); expert parameters hold this replica's gradient of its local experts (the
step averages them over the EP rank's replica group, the ranks holding the same experts).

The expert half of one step, after DMuon has agreed the has-gradient / non-finite flags (the expert
parameters' flags are among them, from each rank's local gradients):
  expert matrix   reduce (mean) of its slice to its owner inside the replica group (no other rank holds
                  it); the owner: momentum, NS, update; broadcast of the new slice inside the group.
                  Per owner (and dtype) of the group one reduce and one broadcast carry all its slices
                  (packed), all issued before the first is waited for; gradients in DMuon's comm_dtype
                  when set, weights in the parameters' dtype.
The owner runs each plan batch as one batched NS call: a batch of consecutive experts of one 3-D
parameter is the slice view grad[a:b] (no copy per expert); other batches are stacked. Momentum lives
on the owner only: per 3-D parameter a stack of its owned slices in slot order (state "momentum_buffer",
"momentum_slots" the slots), so a batch of consecutive experts is a slice view of it too. Same semantics
as single-process Muon over the dense matrices and every expert matrix with the averaged gradients
(tests/test_runtime_ep.py).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..errors import InputError
from ..optim import lr_scale, muon_apply_many_, muon_momentum_
from ..params import EXPERT_MARK, is_expert_param
from ..plan.ep import EPLayout
from ..plan.types import MatrixSpec
from .fsdp import is_dtensor
from .planning import batch_method


def expert_spec_name(param_name: str, e: int) -> str:
    """'layers.0.mlp.experts.w_up', 3 -> 'layers.0.mlp.experts.3.w_up' (the planner's expert name)."""
    head, sep, tail = param_name.partition(EXPERT_MARK)
    if not sep:
        raise InputError(f"{param_name!r} is not an expert parameter (no '.experts.' in its name)")
    return f"{head}.experts.{e}.{tail}"


def check_ep(ep, world_size: int, *, owner_centric: bool, process_group) -> int:
    """The `ep` argument of a distributed optimizer (1 = no expert parallelism)."""
    EPLayout(world_size, ep)  # a positive integer dividing the ranks (one-line errors)
    if ep > 1 and not owner_centric:
        raise InputError(f"ep={ep}: expert parallelism is run by DMuon only; accepted: ep=1 for NaiveMuon")
    if ep > 1 and process_group is not None:
        raise InputError(f"ep={ep} builds its replica groups over the whole world; accepted: "
                         "process_group=None with ep > 1")
    return ep


def take_experts(routes, ep: int):
    """(the other routes, the expert routes) of a model under expert parallelism of degree ep (ep = 1:
    no expert routes; 3-D parameters stay with AdamW as before). One-line errors for what EP cannot run."""
    if ep == 1:
        return list(routes), []
    experts = [r for r in routes if is_expert_param(r.name, r.param)]
    if not experts:
        raise InputError(f"ep={ep}: the model has no expert parameters (3-D, a name holding '.experts.', "
                         "shaped (E_local, out, in)); accepted: ep=1 for a dense model")
    sharded = [r.name for r in experts if is_dtensor(r.param)]
    if sharded:
        raise InputError(f"{sharded[0]}: expert parameters are FSDP2-sharded; with ep > 1 each rank holds "
                         "its own experts, accepted: leave them out of fully_shard (ignored_params, e.g. "
                         "dmuon.shard_model(model, layout, ep=E))")
    return [r for r in routes if not is_expert_param(r.name, r.param)], experts


def expert_matrices(names, params, layers, ep: int) -> list[tuple[MatrixSpec, int, int]]:
    """Every expert matrix of every EP rank, in parameter order: (its spec, the parameter's index in
    `params`, the global expert number). One layer's expert parameters must hold as many experts."""
    out = []
    per_layer: dict[int, tuple[str, int]] = {}
    for i, (name, p) in enumerate(zip(names, params, strict=True)):
        e_local = p.shape[0]
        seen = per_layer.setdefault(layers[i], (name, e_local))
        if seen[1] != e_local:
            raise InputError(f"{name} holds {e_local} experts but {seen[0]} of the same layer holds "
                             f"{seen[1]}; accepted: the same number of local experts in every expert "
                             "parameter of a layer")
        for e in range(e_local * ep):
            out.append((MatrixSpec(expert_spec_name(name, e), p.shape[1], p.shape[2], layers[i]), i, e))
    return out


class ExpertMuon:
    """The expert half of `DMuon(model, ep=E)` (module docstring). `opt`: the DMuon whose parameters
    `opt.params[first:]` are the expert parameters; `plan`: the EP plan over opt's dense Muon matrices
    (the first `n_dense` matrices) and the expert matrices (the rest, in `expert_matrices` order)."""

    def __init__(self, opt, plan, first: int, n_dense: int, ep: int):
        self.opt, self.plan, self.n_dense = opt, plan, n_dense
        self.layout = EPLayout(opt.world_size, ep)
        self.k = self.layout.ep_rank(opt.rank)
        timeout = datetime.timedelta(seconds=opt.timeout_s)
        # every rank creates every replica group, in the same order (torch.distributed's rule)
        groups = [dist.new_group(list(self.layout.replica_group(k)), timeout=timeout) for k in range(ep)]
        self.group = groups[self.k]
        self._mesh = None  # (replica, ep) DeviceMesh of the checkpoints' DTensors, created on first use
        idx = list(range(first, len(opt.params)))
        found = expert_matrices([opt.names[i] for i in idx], [opt.params[i] for i in idx],
                                [opt.layers[i] for i in idx], ep)
        self.held: dict[int, tuple[int, int]] = {}  # plan index -> (param index, local slot): what I hold
        for j, (_, i, e) in enumerate(found, start=n_dense):
            e_local = opt.params[idx[i]].shape[0]
            if e // e_local == self.k:
                self.held[j] = (idx[i], e - self.k * e_local)
        # momentum only for the owned slices: per parameter a stack of them, in slot order
        self.owned: dict[int, list[int]] = {}
        for j, (i, slot) in self.held.items():
            if plan.owners[j] == opt.rank:
                self.owned.setdefault(i, []).append(slot)
        self.row = {(i, slot): r for i, slots in self.owned.items() for r, slot in enumerate(sorted(slots))}
        with torch.no_grad():  # replicas start from the same experts (the group's first rank's), as DDP does
            for i in idx:
                dist.broadcast(opt.params[i].data, self.layout.replica_group(self.k)[0], group=self.group)

    @torch.no_grad()
    def step(self, flags: list[bool]) -> None:
        """Reduce, orthogonalize and publish the expert matrices whose parameter has a gradient on some
        rank (`flags`, agreed on every rank): one reduce and one broadcast per owner (and dtype) of the
        replica group, each packing that owner's matrices."""
        opt, plan = self.opt, self.plan
        active = [j for j, (i, _) in self.held.items() if flags[i]]
        for i in {self.held[j][0] for j in active}:
            if opt.params[i].grad is None:  # no gradient here, but on some rank: contributes zeros
                opt.params[i].grad = torch.zeros_like(opt.params[i])
        packs: dict[tuple, list[int]] = {}  # (owner, dtype) -> its matrices, the same on the whole group
        for j in active:
            packs.setdefault((plan.owners[j], str(opt.params[self.held[j][0]].dtype)), []).append(j)
        packs = dict(sorted(packs.items()))
        self._exchange(packs, grad=True)  # gradients to owners (mean over the replica group)
        for b in plan.batches_of(opt.rank):
            members = [j for j in b.members if j >= self.n_dense and flags[self.held[j][0]]]
            if members:
                self._run_batch(b, members)
        self._exchange(packs, grad=False)  # publication from the owners

    def _slice(self, j: int, grad: bool) -> torch.Tensor:
        i, slot = self.held[j]
        p = self.opt.params[i]
        return (p.grad if grad else p.data)[slot]

    def _exchange(self, packs: dict, grad: bool) -> None:
        """grad: reduce (sum) each pack to its owner, which keeps the mean (in DMuon's comm_dtype, if set);
        else broadcast each pack from its owner (in the parameters' dtype, as DMuon publishes). All packs
        are issued before the first is waited for."""
        size, me, wire = self.layout.replicas, self.opt.rank, self.opt.comm_dtype if grad else None
        if size == 1:  # every matrix is owned where it lives
            return
        issued = []
        for (owner, _), js in packs.items():
            if grad or owner == me:
                flat = torch.cat([self._slice(j, grad).reshape(-1) for j in js])
                flat = flat if wire is None else flat.to(wire)
            else:
                t = self._slice(js[0], grad)
                flat = torch.empty(sum(self._slice(j, grad).numel() for j in js), dtype=t.dtype,
                                   device=t.device)
            if grad:
                work = dist.reduce(flat, owner, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            else:
                work = dist.broadcast(flat, owner, group=self.group, async_op=True)
            issued.append((owner, js, flat, work))
        for owner, js, flat, work in issued:
            work.wait()
            if (owner == me) != grad:  # the owner keeps the reduced sum, the others the published weights
                continue
            pos = 0
            for j in js:
                t = self._slice(j, grad)
                t.copy_(flat[pos:pos + t.numel()].view(t.shape))
                if grad:
                    t.div_(size)
                pos += t.numel()

    def _buffer(self, i: int) -> torch.Tensor:
        """Parameter i's momentum: a stack of its owned slices in slot order (created on first use)."""
        p, st = self.opt.params[i], self.opt.state[self.opt.params[i]]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros((len(self.owned[i]), *p.shape[1:]), dtype=p.dtype,
                                                device=p.device)
            st["momentum_slots"] = tuple(sorted(self.owned[i]))
        return st["momentum_buffer"]

    def _run_batch(self, batch, members: list[int]) -> None:
        """Momentum, one batched NS call and the update for the batch's matrices (all owned here)."""
        opt = self.opt
        hp = opt.param_groups[0]
        where = [self.held[j] for j in members]
        i0, a = where[0]
        if all(i == i0 for i, _ in where) and [s for _, s in where] == list(range(a, a + len(where))):
            # consecutive experts of one 3-D parameter (consecutive rows of its owned stack too): momentum and
            # NS on the slice views, no copy per expert
            z, r = a + len(where), self.row[(i0, a)]
            stack = muon_momentum_(opt.params[i0].grad[a:z], self._buffer(i0)[r:r + len(where)],
                                   hp["momentum"], hp["nesterov"])
        else:  # mixed members: tall ones transposed to the batch's (rows, cols) shape
            ins = [muon_momentum_(opt.params[i].grad[s], self._buffer(i)[self.row[(i, s)]], hp["momentum"],
                                  hp["nesterov"]) for i, s in where]
            stack = torch.stack([t if tuple(t.shape) == (batch.rows, batch.cols) else t.mT for t in ins])
        updates = opt._ns(stack, batch_method(self.plan, batch))
        ws = [opt.params[i].data[s] for i, s in where]
        muon_apply_many_(ws, [u if u.shape == w.shape else u.mT for w, u in zip(ws, updates, strict=True)],
                         hp["lr"], hp["weight_decay"], [lr_scale(w.shape, hp["adjust_lr"]) for w in ws])

    # ---- sharded checkpoints (dmuon.runtime.checkpoint) -------------------------------------------
    def as_global(self, t: torch.Tensor) -> torch.Tensor:
        """A local expert stack (E_local, ...) as the DTensor of every EP rank's experts on a (replica, ep)
        mesh, (Replicate(), Shard(0)): DCP writes each expert once and re-shards it on load for any ep
        and world size. Shares t's storage (DCP loads into it). The first call is collective."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self._mesh is None:
            self._mesh = init_device_mesh(self.opt.device.type, (self.layout.replicas, self.layout.ep),
                                          mesh_dim_names=("replica", "ep"))
        shape = (t.shape[0] * self.layout.ep, *t.shape[1:])
        return DTensor.from_local(t, self._mesh, (Replicate(), Shard(0)), run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def full_momentum(self, i: int) -> torch.Tensor:
        """Parameter i's momentum for every local expert (zeros where none yet): each owner's rows, summed
        over the replica group (every other replica holds zeros there). Collective over the group."""
        p = self.opt.params[i]
        full = torch.zeros_like(p)
        st = self.opt.state.get(p, {})
        if "momentum_buffer" in st:
            full[list(st["momentum_slots"])] = st["momentum_buffer"]
        if self.layout.replicas > 1:
            dist.all_reduce(full, group=self.group)
        return full

    def install_momentum(self, i: int, full: torch.Tensor) -> None:
        """Keep the owned rows of parameter i's loaded momentum (every local expert's)."""
        slots = sorted(self.owned.get(i, ()))
        if slots:
            st = self.opt.state[self.opt.params[i]]
            st["momentum_buffer"] = full[slots].clone()
            st["momentum_slots"] = tuple(slots)
