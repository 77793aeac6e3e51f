"""Expert parallelism in `DMuon(model, ep=E)`: the expert half of the step (`ExpertMuon`), executing the
expert part of a `dmuon.plan.ep` plan; `NaiveExperts` is `NaiveMuon(model, ep=E)`'s (every expert's
gradient all-reduced per layer over the replica group, NS of every local expert on every rank).
The dense half is DMuon's own machinery, in any of its layouts
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

The expert exchange runs as DMuon's dense one does (`units.OwnerUnit`, `exchange.OwnerLayout`), on the
replica group: per bucket of the plan one exchange unit holds the expert matrices of this EP rank in
it (slices of the 3-D parameters: `units.Member` with start / numel), launched from backward hooks
(`hooks.BackwardTracker`, in reverse forward order) as soon as the bucket's expert gradients are ready,
on a communication thread and private replica-group process groups of its own (its job order depends
on no other tracker's, so every rank runs the same sequence), so the reduce overlaps the rest of
backward:
  backward        per bucket: the sum of each expert matrix to its owner inside the replica group (no
                  other rank holds it): per owner one reduce of its packed slices (exchange mode
                  "reduce"; "reduce_scatter" or DMuon's "auto" as for the dense buckets), gradients in
                  DMuon's comm_dtype when set;
  step()          after DMuon has agreed the has-gradient / non-finite flags (the expert parameters'
                  flags are among them, from each rank's local gradients): the owner waits for each
                  bucket's sum, scales it to the mean, runs momentum, NS and the update; each bucket's
                  new slices are published from their owners (broadcast in the parameters' dtype), which
                  a module's next forward waits for (`hooks.ForwardWaits`), as DMuon's dense publication.
Without a backward pass (gradients set by hand, or only inside no_sync()) step() launches the round.
A replica group of one rank (ep = world size) exchanges nothing: no units, no thread; the owner reads
the local gradients. The owner runs each plan batch as one batched NS call: a batch of consecutive
experts of one 3-D parameter is one view of the bucket's summed buffer (an owner's consecutive slices
lie end to end in its chunk; no copy per expert); other batches are stacked. Momentum lives
on the owner only: per 3-D parameter a stack of its owned slices in slot order (state "momentum_buffer",
"momentum_slots" the slots), so a batch of consecutive experts is a slice view of it too. Same semantics
as single-process Muon over the dense matrices and every expert matrix with the averaged gradients
(tests/test_runtime_ep.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import weakref

import torch
import torch.distributed as dist

from ..errors import InputError
from ..optim import lr_scale, muon_apply_many_, muon_momentum_
from ..params import EXPERT_MARK, is_expert_param
from ..plan.ep import EPLayout
from ..plan.types import MatrixSpec
from .comm import CommWorker
from .fsdp import is_dtensor
from .groups import CommGroups
from .hooks import BackwardTracker, ForwardWaits
from .planning import batch_method
from .units import AllReduceUnit, Member, OwnerUnit


def expert_spec_name(param_name: str, e: int) -> str:
    """'layers.0.mlp.experts.w_up', 3 -> 'layers.0.mlp.experts.3.w_up' (the planner's expert name)."""
    head, sep, tail = param_name.partition(EXPERT_MARK)
    if not sep:
        raise InputError(f"{param_name!r} is not an expert parameter (no '.experts.' in its name)")
    return f"{head}.experts.{e}.{tail}"


def check_ep(ep, world_size: int, *, process_group) -> int:
    """The `ep` argument of a distributed optimizer (1 = no expert parallelism)."""
    EPLayout(world_size, ep)  # a positive integer dividing the ranks (one-line errors)
    if ep > 1 and process_group is not None:
        raise InputError(f"ep={ep} builds its replica groups over the whole world; accepted: "
                         "process_group=None with ep > 1")
    return ep


def take_experts(routes, ep: int):
    """(the other routes, the expert routes) of a model under expert parallelism of degree ep (ep = 1:
    no expert routes: 3-D expert parameters are dense Muon parameters of E matrices each, `dmuon.params`).
    One-line errors for what EP cannot run."""
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


def expert_blocks(name: str, p: torch.Tensor) -> tuple[str, ...]:
    """The matrices one expert slice of an expert parameter holds, by name (`dmuon.params.decide`): ('',) =
    the slice is one matrix; ('gate_proj', 'up_proj') = a fused gate / up, its rows cut in two."""
    from ..params import decide

    use, _, layout = decide(name, p.shape)
    return layout.names if use and layout is not None and layout.lead > 1 else ("",)


def expert_stack(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """An expert parameter's tensor (E_local, out, in) as its matrices (E_local x blocks, out / blocks, in):
    expert e's block b is row e * blocks + b (a view: consecutive rows of one expert slice)."""
    if blocks == 1:
        return t
    return t.view(t.shape[0] * blocks, t.shape[1] // blocks, *t.shape[2:])


def expert_matrices(names, params, layers, ep: int) -> list[tuple[MatrixSpec, int, int]]:
    """Every expert matrix of every EP rank, in parameter order: (its spec, the parameter's index in
    `params`, the global matrix number m: expert m // blocks, block m % blocks, `expert_stack`). One
    layer's expert parameters must hold as many experts."""
    out = []
    per_layer: dict[int, tuple[str, int]] = {}
    for i, (name, p) in enumerate(zip(names, params, strict=True)):
        e_local = p.shape[0]
        seen = per_layer.setdefault(layers[i], (name, e_local))
        if seen[1] != e_local:
            raise InputError(f"{name} holds {e_local} experts but {seen[0]} of the same layer holds "
                             f"{seen[1]}; accepted: the same number of local experts in every expert "
                             "parameter of a layer")
        blocks = expert_blocks(name, p)
        rows = p.shape[1] // len(blocks)
        for m in range(e_local * ep * len(blocks)):
            e, b = divmod(m, len(blocks))
            spec_name = expert_spec_name(name, e)
            if blocks[b]:  # the unfused model's name: <head>.experts.<e>.gate_proj
                spec_name = f"{spec_name.rsplit('.', 1)[0]}.{blocks[b]}"
            out.append((MatrixSpec(spec_name, rows, p.shape[2], layers[i]), i, m))
    return out


class _ExpertHalf:
    """What the expert half of DMuon (`ExpertMuon`) and of NaiveMuon (`NaiveExperts`) share: the replica
    groups (one set for the training thread, one for a communication thread of its own), the units
    (`_build_units`, after `_setup`) launched from backward hooks, the forward waits of the units that
    publish, waits, no_sync, and the replicas' first broadcast. `opt.params[first:]` are the experts."""

    def __init__(self, opt, model: torch.nn.Module, first: int, ep: int, exchange: str = "auto"):
        self.opt = opt
        self.layout = EPLayout(opt.world_size, ep)
        # matrices per expert slice of each expert parameter (a fused gate / up: 2; `expert_stack`)
        self.blocks = {i: len(expert_blocks(opt.names[i], opt.params[i]))
                       for i in range(first, len(opt.params))}
        self.k = self.layout.ep_rank(opt.rank)
        timeout = datetime.timedelta(seconds=opt.timeout_s)
        # every rank creates every replica group, in the same order (torch.distributed's rule): one set for
        # the training thread (set-up, checkpoints), one for the expert communication thread
        mine = list(self.layout.replica_group(self.k))
        groups = [[dist.new_group(list(self.layout.replica_group(k)), timeout=timeout) for k in range(ep)]
                  for _ in range(2)]
        self.group = groups[0][self.k]
        self.comm_groups = CommGroups(group=groups[1][self.k], rank=mine.index(opt.rank),
                                      world_size=len(mine), global_ranks=tuple(mine), timeout_s=opt.timeout_s,
                                      backend=dist.get_backend(self.group))
        self.worker = None  # a group of one exchanges nothing: no thread, no units
        if self.layout.replicas > 1:
            self.worker = CommWorker(opt.rank, opt.timeout_s, opt.device, opt.comm_stats)
            self._finalizer = weakref.finalize(self, self.worker.close)
        self._mesh = None  # (replica, ep) DeviceMesh of the checkpoints' DTensors, created on first use
        self.idx = list(range(first, len(opt.params)))
        self._setup()
        self.units = self._build_units(exchange) if self.worker is not None else []
        self.where = {m.index: (u, k) for u in self.units for k, m in enumerate(u.members)}
        self.tracker = BackwardTracker([u.params for u in self.units], self._launch, enabled=opt.overlap)
        self.forward_waits = ForwardWaits(model, {id(p): u for u in self._publishing() for p in u.params},
                                          lambda u: u.wait_publish())
        with torch.no_grad():  # replicas start from the same experts (the group's first rank's), as DDP does
            for i in self.idx:
                dist.broadcast(opt.params[i].data, mine[0], group=self.group)

    def _setup(self) -> None:
        """What `_build_units` needs (before the units are built)."""

    def _build_units(self, exchange: str) -> list:
        raise NotImplementedError

    def _publishing(self) -> list[OwnerUnit]:
        return [u for u in self.units if isinstance(u, OwnerUnit)]

    def _launch(self, u: int) -> None:
        unit = self.units[u]
        unit.launch_reduce(f"expert gradient exchange of bucket {u} ({len(unit.members)} matrices)")

    def begin_step(self) -> None:
        """At the top of step(): launch the round if no backward did, and finish the last publication."""
        self.tracker.finish()
        for u in self._publishing():
            u.wait_publish()

    def no_sync(self):
        return self.tracker.no_sync() if self.units else contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for the expert exchanges in flight."""
        for u in self.units:
            u.wait_reduce()
        for u in self._publishing():
            u.wait_publish()

    def close(self) -> None:
        self.tracker.remove()
        self.forward_waits.remove()
        if self.worker is not None:
            self._finalizer()

    def _mean_grads(self) -> None:
        """Wait for every bucket's sum and scale it to the mean over the replica group."""
        for u in self.units:
            u.wait_reduce()
            u.scale_(1.0 / self.layout.replicas)  # sums to means

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


def _view(half, i: int, t: torch.Tensor) -> torch.Tensor:
    """Parameter i's tensor `t` (its shape) as its matrices' stack (`expert_stack`)."""
    return expert_stack(t, half.blocks[i])


class ExpertMuon(_ExpertHalf):
    """The expert half of `DMuon(model, ep=E)` (module docstring). `opt`: the DMuon whose parameters
    `opt.params[first:]` are the expert parameters of `model`; `plan`: the EP plan over opt's dense Muon
    matrices (the first `n_dense` matrices) and the expert matrices (the rest, in `expert_matrices`
    order); `exchange`: DMuon's exchange mode."""

    def __init__(self, opt, model: torch.nn.Module, plan, first: int, n_dense: int, ep: int,
                 exchange: str = "auto"):
        self.plan, self.n_dense = plan, n_dense
        super().__init__(opt, model, first, ep, exchange)

    def _setup(self) -> None:
        opt, plan, idx = self.opt, self.plan, self.idx
        found = expert_matrices([opt.names[i] for i in idx], [opt.params[i] for i in idx],
                                [opt.layers[i] for i in idx], self.layout.ep)
        self.held: dict[int, tuple[int, int]] = {}  # plan index -> (param index, local slot): what I hold
        for j, (_, i, e) in enumerate(found, start=self.n_dense):
            e_local = opt.params[idx[i]].shape[0] * self.blocks[idx[i]]  # matrices per EP rank
            if e // e_local == self.k:
                self.held[j] = (idx[i], e - self.k * e_local)
        # momentum only for the owned slices: per parameter a stack of them, in slot order
        self.owned: dict[int, list[int]] = {}
        for j, (i, slot) in self.held.items():
            if plan.owners[j] == opt.rank:
                self.owned.setdefault(i, []).append(slot)
        self.row = {(i, slot): r for i, slots in self.owned.items() for r, slot in enumerate(sorted(slots))}

    def _build_units(self, exchange: str) -> list[OwnerUnit]:
        """Per plan bucket (launch order: reverse forward) an OwnerUnit of the expert matrices held here,
        owners as positions in the replica group; buffers per launch where DMuon's are (fsdp2-owner)."""
        opt, plan, units = self.opt, self.plan, []
        owner_pos = {r: pos for pos, r in enumerate(self.layout.replica_group(self.k))}
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        per_node = max(1, int(env) // self.layout.ep) if env.isdigit() else None  # replica-group ranks
        for b in reversed(plan.buckets):
            members = []
            for j in b.members:
                if j in self.held:
                    i, slot = self.held[j]
                    numel = _view(self, i, opt.params[i])[slot].numel()
                    members.append(Member(j, plan.matrices[j].name, opt.params[i], owner_pos[plan.owners[j]],
                                          start=slot * numel, numel=numel))
            if members:
                units.append(OwnerUnit(len(units), members, self.comm_groups, self.worker, exchange,
                                       transient=opt.layout == "fsdp2-owner", comm_dtype=opt.comm_dtype,
                                       per_node=per_node))
        return units

    @torch.no_grad()
    def step(self, flags: list[bool]) -> None:
        """Orthogonalize and publish the expert matrices whose parameter has a gradient on some rank
        (`flags`, agreed on every rank); their sums were launched to their owners during backward (or by
        begin_step())."""
        self._mean_grads()
        for b in self.plan.batches_of(self.opt.rank):
            members = [j for j in b.members if j >= self.n_dense and flags[self.held[j][0]]]
            if members:
                self._run_batch(b, members)
        for u in reversed(self.units):  # forward order: the next forward needs the first layers first
            u.launch_publish(f"expert weight publication of bucket {u.position} ({len(u.members)} matrices)")

    def _grads(self, members: list[int]) -> torch.Tensor:
        """The mean gradients of consecutive held experts of one parameter, (count, rows, cols): one view
        (of the unit's summed chunk; a group of one: of the local gradient, zeros where it has none)."""
        i, slot = self.held[members[0]]
        p = self.opt.params[i]
        if not self.units:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            return _view(self, i, g)[slot:slot + len(members)]
        unit, k = self.where[members[0]]
        return unit.grad(k, len(members)).view(len(members), *_view(self, i, p).shape[1:]).to(p.dtype)

    def _buffer(self, i: int) -> torch.Tensor:
        """Parameter i's momentum: a stack of its owned slices in slot order (created on first use)."""
        p, st = self.opt.params[i], self.opt.state[self.opt.params[i]]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros((len(self.owned[i]), *_view(self, i, p).shape[1:]),
                                                dtype=p.dtype, device=p.device)
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
            r = self.row[(i0, a)]
            stack = muon_momentum_(self._grads(members), self._buffer(i0)[r:r + len(where)], hp["momentum"],
                                   hp["nesterov"])
        else:  # mixed members: tall ones transposed to the batch's (rows, cols) shape
            ins = [muon_momentum_(self._grads([j])[0], self._buffer(i)[self.row[(i, s)]], hp["momentum"],
                                  hp["nesterov"]) for j, (i, s) in zip(members, where, strict=True)]
            stack = torch.stack([t if tuple(t.shape) == (batch.rows, batch.cols) else t.mT for t in ins])
        updates = opt._ns(stack, batch_method(self.plan, batch))
        ws = [_view(self, i, opt.params[i].data)[s] for i, s in where]
        muon_apply_many_(ws, [u if u.shape == w.shape else u.mT for w, u in zip(ws, updates, strict=True)],
                         hp["lr"], hp["weight_decay"], [lr_scale(w.shape, hp["adjust_lr"]) for w in ws])

    def full_momentum(self, i: int) -> torch.Tensor:
        """Parameter i's momentum for every local expert (zeros where none yet): each owner's rows, summed
        over the replica group (every other replica holds zeros there). Collective over the group."""
        p = self.opt.params[i]
        full = torch.zeros_like(p)
        st = self.opt.state.get(p, {})
        if "momentum_buffer" in st:
            _view(self, i, full)[list(st["momentum_slots"])] = st["momentum_buffer"]
        if self.layout.replicas > 1:
            dist.all_reduce(full, group=self.group)
        return full

    def install_momentum(self, i: int, full: torch.Tensor) -> None:
        """Keep the owned rows of parameter i's loaded momentum (every local expert's)."""
        slots = sorted(self.owned.get(i, ()))
        if slots:
            st = self.opt.state[self.opt.params[i]]
            st["momentum_buffer"] = _view(self, i, full)[slots].clone()
            st["momentum_slots"] = tuple(slots)


class NaiveExperts(_ExpertHalf):
    """The expert half of `NaiveMuon(model, ep=E)`, the gather-then-compute baseline: per MoE layer (launch
    order: reverse forward) one `units.AllReduceUnit` of the layer's expert parameters, whole, over the
    replica group, launched from backward hooks on the experts' communication thread as `ExpertMuon`'s
    units are (gradients in comm_dtype when set); at step() every rank of the group scales the sums to
    the means and runs momentum (every rank holds every local expert's), one batched NS call per 3-D
    parameter over its (E_local, out, in) stack (a view of the summed buffer, no copy per expert) and the
    update; nothing is published (every replica computed the same weights)."""

    def _build_units(self, exchange: str) -> list[AllReduceUnit]:
        opt, units = self.opt, []
        for layer in sorted({opt.layers[i] for i in self.idx}, reverse=True):
            members = [Member(i, opt.names[i], opt.params[i]) for i in self.idx if opt.layers[i] == layer]
            units.append(AllReduceUnit(len(units), members, self.comm_groups, self.worker, opt.comm_dtype))
        return units

    def _grad(self, i: int) -> torch.Tensor:
        """Parameter i's mean gradient over the replica group (E_local, out, in): a view of its unit's
        summed buffer (a group of one: the local gradient, zeros where it has none)."""
        p = self.opt.params[i]
        if not self.units:
            return p.grad if p.grad is not None else torch.zeros_like(p)
        unit, k = self.where[i]
        return unit.grad(k).view(p.shape).to(p.dtype)

    @torch.no_grad()
    def step(self, flags: list[bool]) -> None:
        """Momentum, NS and the update of every local expert whose parameter has a gradient on some rank
        (`flags`, agreed on every rank), on every rank."""
        opt = self.opt
        hp = opt.param_groups[0]
        self._mean_grads()
        for i in self.idx:
            if not flags[i]:
                continue
            p = opt.params[i]
            st = opt.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            stack = muon_momentum_(self._grad(i), st["momentum_buffer"], hp["momentum"], hp["nesterov"])
            update = opt._ns(_view(self, i, stack), opt.ns.method)  # every matrix of every local expert
            muon_apply_many_([p.data], [update.reshape(p.shape)], hp["lr"], hp["weight_decay"],
                             [lr_scale(update.shape[1:], hp["adjust_lr"])])

    def full_momentum(self, i: int) -> torch.Tensor:
        """Parameter i's momentum for every local expert (zeros where none yet): every rank holds it."""
        p = self.opt.params[i]
        st = self.opt.state.get(p, {})
        return st["momentum_buffer"].clone() if "momentum_buffer" in st else torch.zeros_like(p)

    def install_momentum(self, i: int, full: torch.Tensor) -> None:
        self.opt.state[self.opt.params[i]]["momentum_buffer"] = full.clone()
