"""Distributed Muon on the replicated (DDP-like) layout: `DMuon` (owner-centric) and `NaiveMuon`
(gather-then-compute, the paper's baseline). Both take the model itself, install hooks and own the
gradient synchronization (no DDP wrapper). See docs/runtime.md. On an FSDP2 model the same classes run
the fsdp2-owner layout here (DTensor parameters are "local": FSDP2 syncs them, AdamW updates their local
shards) or, with FSDP2-sharded Muon matrices, dispatch to `runtime/fsdp_sharded.py` (docs/fsdp.md).

DMuon, per step: backward hooks sum each bucket's gradients onto the owner of each matrix (one owner per
matrix, from the Plan); step() lets each owner update momentum and orthogonalize its matrices (the plan's
batches), then publishes the new weights from the owners; the next forward waits per module for its
own bucket (overlap=True) or step() waits at its end (overlap=False). NaiveMuon all-reduces every
gradient and runs NS for every matrix on every rank. Non-Muon parameters go to AdamW: DMuon shards
them ZeRO-1 style (each rank updates and publishes 1/N; small ones ride whole in their layer's bucket),
NaiveMuon replicates them (all-reduce, every rank updates all). The math is `dmuon.optim`'s functional
pieces throughout (`muon_momentum_`, `orthogonalize`, `muon_apply_`, `adamw_step_`).
"""


from __future__ import annotations

import torch

from .optim import momentum_update, muon_ns_input
from .runtime.base import BALANCERS, STATE_FORMAT, DistributedMuonBase
from .runtime.fsdp_sharded import ShardedDMuonSteps, ShardedNaiveSteps
from .runtime.planning import (
    batch_method,
    build_model_plan,
    check_given_plan,
    check_max_split,
    own_orientation_stacks,
)
from .runtime.split_exec import SplitExecutor
from .runtime.tp import TPDMuonSteps, TPNaiveSteps

__all__ = ["BALANCERS", "STATE_FORMAT", "DMuon", "NaiveMuon", "ShardedDMuon", "ShardedNaiveMuon", "TPDMuon",
           "TPNaiveMuon"]


class DMuon(DistributedMuonBase):
    """Owner-centric distributed Muon: each matrix is orthogonalized once, by its owner.

    Takes the model (all parameters on one device, replicated on every rank; no DDP wrapper). Arguments
    as `dmuon.Muon`, plus: process_group (default: the world), balancer ('lpt' | 'round_robin' | 'milp')
    and profile (cost table name; None: 'cpu' on CPU, the GPU's profile or its datasheet roofline)
    for the Plan, overlap (publish weights while the next forward runs and exchange gradients during
    backward; False: both at step()), node_size (ranks per node: two-level exchange), bucket_numel
    (0: one bucket per layer), nonfinite ('raise' | 'skip' | 'ignore', agreed on every rank),
    check_consistency_every (K > 0: compare parameter checksums across ranks every K steps),
    timeout_s (every collective and wait), exchange ('reduce_scatter': one padded reduce-scatter /
    all-gather per bucket; 'reduce': one reduce / broadcast per owner), max_batch (matrices per NS call).
    layout ('auto' detects it: 'replicated' | 'fsdp2-owner' | 'fsdp2-sharded') and memory ('keep' |
    'free', fsdp2-owner only) select the FSDP2 layouts of docs/fsdp.md. comm_dtype (None | 'bf16' |
    'fp16' | 'fp32'): the dtype gradients travel in to their owners (and, fsdp2-sharded, the NS inputs
    and updates of the all-to-alls); None = the parameters' dtype. Published weights always travel in
    the parameters' dtype, so every rank holds exactly the owner's weights.
    max_split (1 .. world size; default 1): let the balancer give one batch a group of up to that many
    owner ranks that split its NS (`dmuon.orthogonalize_distributed`) where that pays; plan (a
    `dmuon.plan.types.Plan`, e.g. `Plan.from_json` of `harness plan --json`): execute this plan instead
    of building one (same matrices and world size). Split batches: dmuon/runtime/split_exec.py.
    ep (default 1): expert parallelism of that degree: the 3-D expert parameters (E_local, out, in) named
    '.experts.' are each rank's own experts, E_local Muon matrices each, owned inside their replica group
    by `dmuon.plan.ep.build_ep_plan` and run by `dmuon.runtime.ep.ExpertMuon`; the dense matrices run as
    in the layout (replicated, fsdp2-owner, fsdp2-sharded, HSDP) on the same plan (docs/moe.md).
    Use `no_sync()` for gradient accumulation and `synchronize()` before reading parameters outside
    forward. state_dict() is per rank (see docs/runtime.md).
    """

    owner_centric = True
    layout_kind = "dp"  # "tp": the TP variant (runtime/tp.py)

    def __init__(self, model, *, max_split: int = 1, plan=None, tp_mode: str = "auto", **kwargs):
        from .plan.tp import TP_MODE_CHOICES

        if tp_mode not in TP_MODE_CHOICES:
            from .errors import choice_error

            raise choice_error("tp_mode", tp_mode, TP_MODE_CHOICES)
        if tp_mode != "auto" and self.layout_kind != "tp":
            from .errors import InputError

            raise InputError(f"tp_mode={tp_mode!r} is for models on a tensor-parallel mesh; accepted: "
                             "tp_mode='auto' here (see docs/runtime.md, Tensor parallelism)")
        self._max_split, self._given_plan, self._tp_mode = max_split, plan, tp_mode
        super().__init__(model, **kwargs)
        self._split = None
        if self.plan is not None and self.plan.split_batches:
            self._split = SplitExecutor(self.plan, self.groups, self.timeout_s, self.comm_stats)

    def _build_plan(self, specs, balancer: str, profile: str | None, bucket_numel: int):
        if self._given_plan is not None:
            return check_given_plan(self._given_plan, specs, self.world_size, self.ep)
        max_split = check_max_split(self._max_split, self.world_size)
        return build_model_plan(specs, self.world_size, self.ns, self.device, balancer=balancer,
                                profile=profile, max_batch=self.max_batch, bucket_numel=bucket_numel,
                                max_split=max_split, ep=self.ep,
                                # fsdp2-sharded runs the momentum on every rank's shards: not owner work
                                owner_momentum=self.layout != "fsdp2-sharded")

    def _ordered_batches(self) -> list:
        """This rank's batches: its split batch first (the group's members wait for it), then plan order."""
        mine = list(self.plan.batches_of(self.rank))
        return sorted(mine, key=lambda b: not b.group)

    def _stack_dtype(self, members) -> torch.dtype:
        dtype = self.params[members[0]].dtype
        for i in members[1:]:
            dtype = torch.promote_types(dtype, self.params[i].dtype)
        return dtype

    def _split_run(self, batch, stack, members):
        """Run a split batch on its group (the lead passes the stack and gets the polar factors)."""
        kwargs = {**self.ns.kwargs(), "method": batch_method(self.plan, batch)}
        return self._split.run(batch, stack, count=len(members), dtype=self._stack_dtype(members),
                               device=self.device, ns_kwargs=kwargs)

    def _speculate(self) -> list:
        """Momentum and NS of this rank's batches, each as soon as its gradients have arrived, overlapping
        the rest of the exchange and the flag all-reduce. Out of place: momentum goes to a copy of the
        buffer, the update is kept; `_muon_update` commits both once the flags are agreed (members no
        rank has a gradient for, and whole steps with a non-finite gradient, are dropped)."""
        pending = []
        if self.plan is None:
            return pending
        group = self.param_groups[0]
        for batch in self._ordered_batches():
            split = len(batch.group) > 1
            if split and batch.owner != self.rank:  # a member of the group: its block only
                self._split_run(batch, None, batch.members)
                self._absorb_ready()
                continue
            for i in batch.members:
                self._absorb(self._where[i][0])
            members = [self.params[i] for i in batch.members]
            dtype = self._stack_dtype(batch.members)
            lays = [self.layouts[i] for i in batch.members]
            c = lays[0].count  # matrices per member (the plan batches one count together)
            flips = [lay.piece_shape(0) != (batch.rows, batch.cols) for lay in lays]
            # the NS input of each member is written straight into its slot(s) of a stack (c slots: the
            # parameter's matrices, `dmuon.matrices`): members of the other orientation (tall ones of a
            # wide batch) in a stack of their own shape where the NS iterates them as they are, so no slot
            # is a transposed view; else (a split batch: its group splits the columns; Triton kernels) one
            # stack, the flipped members through a transposed view. No separate copy of the buffer or the
            # inputs.
            one = not own_orientation_stacks(self.plan, batch, self.ns, members[0].device)
            parts = [range(len(members))] if one else [[k for k in range(len(members)) if flips[k] == f]
                                                       for f in (False, True)]
            for ks in (ks for ks in parts if ks):
                turned = not one and flips[ks[0]]  # this stack holds the members' own orientation
                shape = (batch.cols, batch.rows) if turned else (batch.rows, batch.cols)
                stack = torch.empty((len(ks) * c, *shape), dtype=dtype, device=members[0].device)
                buffers = []
                for n, k in enumerate(ks):
                    i, p, lay = batch.members[k], members[k], lays[k]
                    old = self.state[p].get("momentum_buffer")
                    if old is None:
                        old = torch.zeros_like(p, memory_format=torch.preserve_format)
                    g = self._grad(i).to(p.dtype)
                    buf = momentum_update(g, old, group["momentum"])
                    slots = stack[n * c:(n + 1) * c]
                    view = slots.mT if flips[k] and not turned else slots
                    muon_ns_input(lay.stack(g), lay.stack(buf), group["momentum"], group["nesterov"],
                                  out=view)
                    buffers.append(buf)
                if split:
                    out = self._split_run(batch, stack, batch.members)
                else:
                    out = self._ns(stack, batch_method(self.plan, batch))
                updates = []
                for n, k in enumerate(ks):
                    u = out[n * c:(n + 1) * c]
                    u = u.mT if flips[k] and not turned else u
                    updates.append(u[0] if lays[k].is_whole else u)
                pending += list(zip([batch.members[k] for k in ks], buffers, updates, strict=True))
            self._absorb_ready()
        return pending

    def _muon_update(self, has_any: torch.Tensor, pending) -> None:
        group = self.param_groups[0]
        flags = has_any.tolist()  # one read, not one tensor index per matrix
        done = [(i, buf, update) for i, buf, update in pending if flags[i]]
        for i, buf, _ in done:
            self.state[self.params[i]]["momentum_buffer"] = buf
        self._apply([i for i, *_ in done], [u for *_, u in done], group)


class NaiveMuon(DistributedMuonBase):
    """Gather-then-compute distributed Muon (the baseline): every gradient is all-reduced (bucketed,
    overlapped with backward) and every rank orthogonalizes every matrix, as `dmuon.Muon` does on one
    device. Same arguments as `DMuon` (balancer / exchange only shape the buckets; momentum everywhere).
    ep > 1: the experts (as `DMuon`'s) run by `dmuon.runtime.ep.NaiveExperts`: per layer one all-reduce of
    their gradients over the replica group, launched from backward; every rank runs NS on all its local
    experts (one batched call per 3-D parameter); the dense half as without EP (docs/moe.md)."""

    owner_centric = False

    def _muon_update(self, has_any: torch.Tensor, pending) -> None:
        if self.plan is None:
            return
        group = self.param_groups[0]
        flags = has_any.tolist()
        idx = [i for i in range(self.n_muon) if flags[i]]
        if not idx:
            return
        inputs = self._muon_inputs(idx, group)
        self._apply_matrices(idx, self._ns_many(inputs), group)


class ShardedDMuon(ShardedDMuonSteps, DMuon):
    """DMuon on FSDP2-sharded Muon matrices (layout 'fsdp2-sharded'; chosen by DMuon itself):
    `dmuon.runtime.fsdp_sharded`. A split batch: its lead (the owner) receives the rows by the all-to-all
    as usual and runs the group protocol of `split_exec` where the owner would call NS; the other members
    join it from `_orthogonalize`."""

    _split_now = None  # (batch, members) while the lead's stack is being orthogonalized

    def _orthogonalize(self, bt, on, sends, bucket_of, owned, updates) -> None:
        if len(bt.group) <= 1:
            return super()._orthogonalize(bt, on, sends, bucket_of, owned, updates)
        members = [i for i in bt.members if i in on]
        if bt.owner != self.rank:
            self._split_run(bt, None, members)
            return None
        self._split_now = (bt, members)
        try:
            return super()._orthogonalize(bt, on, sends, bucket_of, owned, updates)
        finally:
            self._split_now = None

    def _ns(self, stack, method, out_dtype=None):
        if self._split_now is None:
            return super()._ns(stack, method, out_dtype)
        bt, members = self._split_now
        return self._split_run(bt, stack, members)


class ShardedNaiveMuon(ShardedNaiveSteps, NaiveMuon):
    """NaiveMuon on FSDP2-sharded Muon matrices: all-gather every input, every NS on every rank."""


class TPDMuon(TPDMuonSteps, DMuon):
    """DMuon on a tensor-parallel mesh (TP, FSDP2 x TP, HSDP x TP; chosen by DMuon itself):
    `dmuon.runtime.tp`. tp_mode ('auto' | 'group' | 'gather') forces the plan's mode per TP matrix."""

    layout_kind = "tp"


class TPNaiveMuon(TPNaiveSteps, NaiveMuon):
    """NaiveMuon on a tensor-parallel mesh: every rank gathers and orthogonalizes every matrix."""


DMuon.sharded_variant = ShardedDMuon
NaiveMuon.sharded_variant = ShardedNaiveMuon
DMuon.tp_variant = TPDMuon
NaiveMuon.tp_variant = TPNaiveMuon
