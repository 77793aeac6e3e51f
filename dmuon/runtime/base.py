"""The machinery shared by every distributed Muon of this package (`DistributedMuonBase`): construction
(routes, plan, exchange units, hooks), the step skeleton (flags, non-finite policy, AdamW, publication),
synchronization and per-rank state dicts. `dmuon.distributed` defines the strategies on top of it
(DMuon: owner-centric; NaiveMuon: gather-then-compute) and their fsdp2-sharded variants; a subclass
overrides `_speculate` (work before the flags are agreed) and `_muon_update` (the Muon step). See
docs/runtime.md and docs/fsdp.md.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

from ..errors import InputError, choice_error
from ..matrices import MatrixLayout
from ..newton_schulz import NSConfig, orthogonalize, orthogonalize_many
from ..optim import (
    NONFINITE,
    Muon,
    adamw_step_,
    lr_scale,
    muon_apply_many_,
    muon_momentum_,
    nonfinite_names,
    suspect_indices,
)
from ..params import route
from ..plan.ep import dense_part
from ..plan.types import MatrixSpec, Plan
from .comm import CommStats, CommWorker
from .ep import ExpertMuon, NaiveExperts, check_ep, expert_matrices, take_experts
from .exchange import EXCHANGE_CHOICES
from .fsdp import MEMORY, is_dtensor, local_tensor, mesh_node_size, resolve_layout
from .groups import build_groups
from .guards import (  # noqa: F401 (COMM_DTYPES: re-export)
    COMM_DTYPES,
    NonFiniteGradientError,
    check_devices,
    check_int,
    check_replicas,
    parse_comm_dtype,
    read_flags,
    submit_flags,
)
from .hooks import BackwardTracker, ForwardWaits
from .model import broadcast_module_state, check_same_model, forward_layers
from .planning import build_model_plan
from .state import STATE_FORMAT, load_rank_state, rank_state_dict  # noqa: F401 (STATE_FORMAT: re-export)
from .tp import tp_variant_of
from .units import OwnerUnit, build_units

BALANCERS = ("lpt", "round_robin", "milp")


def check_uniform(r):
    """A Muon route's layout, where the distributed optimizers can run it: every matrix of the parameter one
    shape (they own and batch a parameter's matrices as one stack)."""
    lay = r.layout if r.layout is not None else MatrixLayout.whole(r.param.shape)
    if not lay.uniform:
        shapes = ", ".join(f"{a}x{b}" for a, b in sorted(set(lay.shapes)))
        raise InputError(f"{r.name}: its matrices have different shapes ({shapes}; {r.reason}); DMuon and "
                         "NaiveMuon take parameters whose matrices share one shape. Accepted: per_head=True "
                         "(one head per matrix), a muon_predicate that routes it to AdamW, or dmuon.Muon on "
                         "one device")
    return lay


class DistributedMuonBase(torch.optim.Optimizer):
    """Shared machinery of DMuon and NaiveMuon; see the module docstring and `dmuon.DMuon`."""

    owner_centric = True
    _muon_units = True  # Muon matrices are exchanged by units (False: fsdp2-sharded, FSDP2 moves them)

    sharded_variant = tp_variant = None  # the classes running this strategy on fsdp2-sharded / TP meshes

    def __new__(cls, model=None, *args, **kwargs):
        target = tp_variant_of(cls, model, kwargs.get("muon_predicate"))  # TP meshes: runtime/tp.py
        if target.sharded_variant is not None and isinstance(model, torch.nn.Module) and resolve_layout(
                model, kwargs.get("layout", "auto"), kwargs.get("muon_predicate")) == "fsdp2-sharded":
            target = target.sharded_variant
        return super().__new__(target)

    def __init__(self, model: torch.nn.Module, *, lr: float = 0.02, momentum: float = 0.95,
                 nesterov: bool = True, weight_decay: float = 0.0, adjust_lr: str = "match_rms_adamw",
                 ns: NSConfig | None = None, adamw_lr: float = 1e-3,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.01, muon_predicate=None, process_group=None,
                 balancer: str = "lpt", profile: str | None = None, overlap: bool = True,
                 node_size: int | None = None, bucket_numel: int = 0, nonfinite: str = "raise",
                 check_consistency_every: int = 0, timeout_s: float = 600.0, exchange: str = "auto",
                 max_batch: int = 8, shard_adamw: bool | None = None, warn_no_muon: bool = True,
                 layout: str = "auto", memory: str = "keep", comm_dtype=None, ep: int = 1,
                 per_head: bool = False):
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"{type(self).__name__} takes the model (an nn.Module) itself, got "
                             f"{type(model).__name__}; it installs hooks on it (do not wrap it in DDP)")
        ns = NSConfig() if ns is None else ns
        if not isinstance(ns, NSConfig):
            raise InputError(f"ns must be a dmuon.NSConfig, got {type(ns).__name__}")
        if nonfinite not in NONFINITE:
            raise choice_error("nonfinite", nonfinite, NONFINITE)
        if balancer not in BALANCERS:
            raise choice_error("balancer", balancer, BALANCERS)
        if exchange not in EXCHANGE_CHOICES:
            raise choice_error("exchange", exchange, EXCHANGE_CHOICES)
        if not isinstance(overlap, bool):
            raise InputError(f"overlap must be True or False, got {overlap!r}")
        check_int("bucket_numel", bucket_numel, 0)
        check_int("check_consistency_every", check_consistency_every, 0)
        check_int("max_batch", max_batch, 1)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InputError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.comm_dtype = parse_comm_dtype(comm_dtype)
        routes = route(model, muon_predicate, per_head=per_head)
        self.per_head = per_head
        if not routes:
            raise InputError("the model has no trainable parameters (all frozen?)")
        check_int("ep", ep, 1)
        routes, expert_routes = take_experts(routes, ep)  # ep > 1: ExpertMuon's (runtime/ep.py)
        self.layout = resolve_layout(model, layout, muon_predicate)
        if memory not in MEMORY:
            raise choice_error("memory", memory, MEMORY)
        if memory == "free" and self.layout != "fsdp2-owner":
            raise InputError(f"memory='free' is for layout 'fsdp2-owner' (this model is {self.layout!r}); "
                             "on 'fsdp2-sharded' FSDP2 decides (fully_shard(reshard_after_forward=True))")
        if memory == "free" and check_consistency_every:
            raise InputError("check_consistency_every compares every rank's copy of each matrix, but with "
                             "memory='free' only the owner keeps one; accepted: memory='keep' or "
                             "check_consistency_every=0")
        self.memory = memory
        if self.layout == "fsdp2-owner" and node_size is None and process_group is None:
            node_size = mesh_node_size(model)  # HSDP: two-level exchange, replicas as the outer level
        self.device = check_devices((r.name, r.param) for r in routes)
        hparams = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                       adjust_lr=adjust_lr, adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas),
                       adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay)
        muon_routes = [r for r in routes if r.use_muon]
        adamw_routes = [r for r in routes if not r.use_muon]
        if warn_no_muon:
            for r in adamw_routes:
                if r.param.dim() >= 3:
                    warnings.warn(f"{type(self).__name__}: {r.name} {tuple(r.param.shape)} goes to AdamW "
                                  f"({r.reason}); pass a muon_predicate to give it to Muon", stacklevel=2)
        if not muon_routes and not expert_routes and warn_no_muon:
            warnings.warn(f"{type(self).__name__}: the model has no matrices routed to Muon; every parameter "
                          "is trained with AdamW", stacklevel=2)
        groups = [Muon._internal_group(rs, flag, hparams)
                  for rs, flag in ((muon_routes + expert_routes, True), (adamw_routes, False)) if rs]
        super().__init__(groups, {})
        self.ns, self.nonfinite, self.overlap = ns, nonfinite, overlap
        self.check_consistency_every = check_consistency_every
        self.timeout_s, self.max_batch = float(timeout_s), max_batch
        self.skipped_steps = 0
        self._steps = 0
        self._absorbed: set[int] = set()  # per step: units whose exchange was absorbed (see _absorb)
        self._has_grad = self._nonfinite = None
        self._flags = None
        self.shard_adamw = self.owner_centric if shard_adamw is None else bool(shard_adamw)
        self.groups = build_groups(process_group, node_size, timeout_s)
        check_same_model({"Muon": muon_routes, "AdamW": adamw_routes, "expert": expert_routes}, self.groups)
        self.ep = check_ep(ep, self.groups.world_size, process_group=process_group)
        broadcast_module_state(model, self.groups, skip={id(r.param) for r in expert_routes})
        self.rank, self.world_size = self.groups.rank, self.groups.world_size
        # params: the dense Muon matrices [0, n_muon), AdamW's [n_muon, expert_first), the experts (ep > 1)
        self.names = [r.name for r in muon_routes + adamw_routes + expert_routes]
        self.params = [r.param for r in muon_routes + adamw_routes + expert_routes]
        self.n_muon, self.expert_first = len(muon_routes), len(muon_routes) + len(adamw_routes)
        # FSDP2-managed (updated on the local shard) or an expert: never in this class's exchange units
        self.local = [is_dtensor(p) or i >= self.expert_first for i, p in enumerate(self.params)]
        layer_of = dict(zip([n for n, _ in model.named_parameters()],
                            forward_layers([n for n, _ in model.named_parameters()]), strict=True))
        self.layers = [layer_of.get(n, 0) for n in self.names]
        # as which matrices (dmuon.params.decide): one, or a parameter's experts / blocks, owned together
        self.layouts = [check_uniform(r) for r in muon_routes]
        specs = tuple(MatrixSpec(r.name, *lay.piece_shape(0), self.layers[i], lay.count)
                      for i, (r, lay) in enumerate(zip(muon_routes, self.layouts, strict=True)))
        experts = expert_matrices(self.names[self.expert_first:], self.params[self.expert_first:],
                                  self.layers[self.expert_first:], self.ep) if expert_routes else []
        # ep > 1, owner-centric: the EP plan (dense matrices, then experts); this class runs its dense part.
        # NaiveMuon plans its dense matrices only (every rank runs every expert: runtime/ep.NaiveExperts)
        planned = experts if self.owner_centric else []
        plan = self._build_plan(specs + tuple(e[0] for e in planned), balancer, profile,
                                bucket_numel) if specs or planned else None
        self.ep_plan = plan if planned else None
        self.plan: Plan | None = dense_part(plan, len(specs), bucket_numel) if planned else plan

        self.comm_stats = CommStats()
        self._worker = CommWorker(self.rank, self.timeout_s, self.device, self.comm_stats)
        self._pub_worker = self._pub_groups = None
        if memory == "free":  # publications from forward / backward hooks: their own thread and groups
            self._pub_groups = build_groups(process_group, node_size, timeout_s)
            self._pub_worker = CommWorker(self.rank, self.timeout_s, self.device, self.comm_stats)
        workers = [w for w in (self._worker, self._pub_worker) if w is not None]
        self._finalizer = weakref.finalize(self, lambda: [w.close() for w in workers])
        self._launched: set[int] = set()  # units whose exchange was launched since the last step
        self.units = build_units(self, exchange, bucket_numel)
        self._where = {}  # param index -> (unit, position in unit)
        for u in self.units:
            for k, m in enumerate(u.members):
                self._where[m.index] = (u, k)
        self._tracker = BackwardTracker([u.params for u in self.units], self._launch, enabled=overlap)
        owner_units = {id(m.param): u for u in self.units if isinstance(u, OwnerUnit) for m in u.members}
        self._residency = None
        if memory == "free":
            from .fsdp_memory import Residency

            self._residency = Residency(model, [u for u in self.units if isinstance(u, OwnerUnit)
                                                and not u.sharded], self.rank)
            owner_units = {k: u for k, u in owner_units.items() if u.sharded}
        self._forward_waits = ForwardWaits(model, owner_units, self._wait_publish) if owner_units else None
        self.experts = None  # ep > 1: the expert half (runtime/ep.py)
        if experts:
            self.experts = (ExpertMuon(self, model, self.ep_plan, self.expert_first, len(specs), self.ep,
                                       exchange) if self.owner_centric
                            else NaiveExperts(self, model, self.expert_first, self.ep))

    # ---- construction ------------------------------------------------------------------------
    def _build_plan(self, specs, balancer: str, profile: str | None, bucket_numel: int) -> Plan:
        return build_model_plan(specs, self.world_size, self.ns, self.device, balancer=balancer,
                                profile=profile, max_batch=self.max_batch, bucket_numel=bucket_numel,
                                priced=self.owner_centric,
                                # fsdp2-sharded runs the momentum on every rank's shards: not owner work
                                owner_momentum=self.layout != "fsdp2-sharded")

    # ---- communication -------------------------------------------------------------------------
    def _launch(self, u: int) -> None:
        unit = self.units[u]
        if unit.consume_grads and u in self._launched:
            raise InputError("layout 'fsdp2-owner' consumes each Muon gradient when it is exchanged, so only "
                             "one backward per step may exchange: accumulate micro-batches inside "
                             "optimizer.no_sync() and run the last backward outside it")
        self._launched.add(u)
        unit.launch_reduce(f"gradient exchange of bucket {u} ({unit.kind}, {len(unit.members)} params)")

    def _wait_publish(self, unit) -> None:
        unit.wait_publish()

    @contextlib.contextmanager
    def no_sync(self):
        """Context manager: backward passes inside only accumulate gradients locally (no exchange)."""
        with self._tracker.no_sync(), self.experts.no_sync() if self.experts else contextlib.nullcontext():
            yield

    def synchronize(self) -> None:
        """Wait for every exchange in flight (new weights on every rank): before eval, checkpoints, or
        reading parameters outside the model's forward. memory='free': also publishes every matrix to
        every rank (collective: call it on every rank)."""
        self.synchronize_exchanges()
        if self._residency is not None:
            self._residency.materialize_all()

    def synchronize_exchanges(self) -> None:
        """Wait for the exchanges in flight (without materializing anything in memory='free')."""
        for u in self.units:
            u.wait_reduce()
            if isinstance(u, OwnerUnit):
                u.wait_publish()
        if self.experts is not None:
            self.experts.synchronize()

    def publish_owned(self) -> None:
        """Owners publish their current weights to every rank, and wait (after loading a checkpoint)."""
        if self._residency is not None:
            self._residency.materialize_all()
            return
        for u in reversed(self.units):
            if isinstance(u, OwnerUnit):
                u.launch_publish(f"weight publication of bucket {u.position} after loading")
        self.synchronize_exchanges()

    def close(self) -> None:
        """Wait for the exchanges in flight (a process group destroyed under them aborts the process), then
        remove the hooks and stop the communication thread (the optimizer is unusable afterwards)."""
        try:
            self.synchronize_exchanges()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        self._tracker.remove()
        if self._forward_waits is not None:
            self._forward_waits.remove()
        if self._residency is not None:
            self._residency.remove()
        if self.experts is not None:
            self.experts.close()
        self._finalizer()

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._tracker.finish()
        if self.experts is not None:  # ep > 1: the experts' round too (runtime/ep.py)
            self.experts.begin_step()
        self._launched = set()
        for u in self.units:
            if isinstance(u, OwnerUnit):
                u.wait_publish()
        if self.check_consistency_every and self._steps % self.check_consistency_every == 0:
            shared = [i for i in range(len(self.params)) if not self.local[i]]
            check_replicas(self._worker, self.groups, [self.names[i] for i in shared],
                           [self.params[i] for i in shared], self.timeout_s)
        self._absorbed = set()
        self._has_grad = torch.zeros(len(self.params), dtype=torch.bool)
        self._nonfinite = torch.zeros(len(self.params), dtype=torch.bool)
        self._flags = None
        self._local_flags()
        pending = self._speculate()  # DMuon: NS on owned batches while the rest of the exchange arrives
        self._absorb_all()
        if self._flags is None:  # no exchange units (every parameter FSDP2-managed)
            self._flags = submit_flags(self._worker, self.groups, self._has_grad, self._nonfinite)
        has_any, bad = read_flags(self._flags, self.timeout_s)
        if bad.any():
            names = [self.names[i] for i in bad.nonzero().flatten().tolist()]
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"rank {self.rank}: non-finite gradient (NaN or inf) on some rank in {', '.join(names)}; "
                    "nothing was updated. Pass nonfinite='skip' to skip such steps")
            self.skipped_steps += 1
            return loss
        self._adamw_done = False  # a _muon_update may run AdamW itself while its collectives travel
        self._muon_update(has_any, pending)
        if not self._adamw_done:
            self._adamw_update(has_any)
        if self.experts is not None:
            self.experts.step(has_any.tolist())
        for u in reversed(self.units):  # forward order: the next forward needs the first layers first
            if isinstance(u, OwnerUnit) and (self._residency is None or u.sharded):
                u.launch_publish(f"weight publication of bucket {u.position} ({len(u.members)} params)")
        if self._residency is not None:
            self._residency.end_step()  # memory='free': the next forward publishes, unit by unit
        elif not self.overlap:
            self.synchronize()
        self._steps += 1
        return loss

    def _local_flags(self) -> None:
        """Flags of the FSDP2-managed parameters (their gradients are already averaged, sharded)."""
        idx, grads, has = [], [], []
        for i, p in enumerate(self.params):
            if self.local[i] and p.grad is not None:
                has.append(i)
                g = local_tensor(p.grad)
                if self.nonfinite != "ignore" and g.numel():
                    idx.append(i)
                    grads.append(g)
        self._has_grad[has] = True  # one indexed write, not one per parameter
        suspects = suspect_indices(grads)  # one pass, one sync; exact check where a sum is not finite
        for i in nonfinite_names([idx[k] for k in suspects], [grads[k] for k in suspects]):
            self._nonfinite[i] = True

    # The exchange of each unit is "absorbed" once per step, as soon as it has arrived: sums scaled to
    # means, local has-grad flags recorded, and a one-pass non-finite check of the part this rank holds
    # (per parameter only where the pass finds something). When every unit is absorbed the flag
    # all-reduce starts; step() waits for it before anything is committed.
    def _absorb(self, u) -> None:
        if u.position in self._absorbed:
            return
        u.wait_reduce()
        if self.world_size > 1:  # sums to means (at one rank the sum is the mean: no pass over the data)
            u.scale_(1.0 / self.world_size)
        for k, m in enumerate(u.members):
            self._has_grad[m.index] = u.has_grad[k]
        if self.nonfinite != "ignore":
            chunk = u.readable()
            if chunk.numel() and not torch.isfinite(chunk.sum()):
                pieces = u.local_pieces()
                for i in nonfinite_names([u.members[k].index for k, *_ in pieces], [g for *_, g in pieces]):
                    self._nonfinite[i] = True
        self._absorbed.add(u.position)
        if len(self._absorbed) == len(self.units):
            self._flags = submit_flags(self._worker, self.groups, self._has_grad, self._nonfinite)

    def _absorb_ready(self) -> None:
        """Absorb, in launch order, the units whose exchange has already finished (no waiting)."""
        for u in self.units:
            if u.position not in self._absorbed:
                if u.reduce_handle is None or not u.reduce_handle.done():
                    return
                self._absorb(u)

    def _absorb_all(self) -> None:
        for u in self.units:
            self._absorb(u)

    def _speculate(self):
        """Work that may start before the flags are agreed (DMuon); nothing may be committed here."""
        return None

    def _grad(self, i: int) -> torch.Tensor:
        unit, k = self._where[i]
        return unit.grad(k).view(self.params[i].shape)

    def _muon_inputs(self, indices, group) -> list[torch.Tensor]:
        """Momentum, then the NS inputs of these Muon parameters: every matrix of each (its layout's), in
        order (`_apply_matrices` takes the updates back in the same order)."""
        out = []
        for i in indices:
            p = self.params[i]
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            g = self._grad(i).to(p.dtype)
            inp = muon_momentum_(g, st["momentum_buffer"], group["momentum"], group["nesterov"])
            out += self.layouts[i].pieces(inp)
        return out

    def _apply_matrices(self, indices, updates, group) -> None:
        """`_apply` from one update per matrix (the order `_muon_inputs` gives)."""
        whole, pos = [], 0
        for i in indices:
            lay = self.layouts[i]
            whole.append(updates[pos] if lay.is_whole else lay.join(updates[pos:pos + lay.count]))
            pos += lay.count
        self._apply(indices, whole, group)

    def _lr_scale(self, i: int, adjust_lr: str) -> float:
        """Muon parameter i's learning-rate scale: its matrices' (one shape per parameter here)."""
        return lr_scale(self.layouts[i].piece_shape(0), adjust_lr)

    def _apply(self, indices, updates, group) -> None:
        """The updates of these Muon parameters (each the parameter's shape, or one (out, -1) matrix, or its
        matrices' (count, rows, cols) stack), one foreach call per learning-rate scale."""
        params = [self.params[i] for i in indices]
        updates = [u if u.dim() != 3 or self.layouts[i].is_whole else self.layouts[i].unstack(u)
                   for i, u in zip(indices, updates, strict=True)]
        muon_apply_many_(params, updates, group["lr"], group["weight_decay"],
                         [self._lr_scale(i, group["adjust_lr"]) for i in indices])

    def _muon_update(self, has_any: torch.Tensor, pending) -> None:
        raise NotImplementedError

    def _ns(self, stack: torch.Tensor, method: str, out_dtype=None) -> torch.Tensor:
        """One (batched) NS call with this optimizer's settings, timed into comm_stats.ns_s (the result in
        `out_dtype`, None: the stack's)."""
        with self.comm_stats.ns_call():
            return orthogonalize(stack, **{**self.ns.kwargs(), "method": method}, out_dtype=out_dtype)

    def _ns_many(self, matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        """`orthogonalize_many` (one call per shape) with this optimizer's settings, timed likewise."""
        with self.comm_stats.ns_call(len({(tuple(m.shape), m.dtype) for m in matrices})):
            return orthogonalize_many(matrices, **self.ns.kwargs())

    def _adamw_update(self, has_any: torch.Tensor) -> None:
        """AdamW on what this rank updates: whole parameters (replicated or owned), its 1/N pieces, or the
        local shards of FSDP2-managed parameters."""
        group = next((g for g in self.param_groups if not g["use_muon"]), None)
        if group is None:
            return
        flags = has_any.tolist()  # one read, not one tensor index per parameter
        work = [(i, None, None, local_tensor(self.params[i].grad) if flags[i] else None)
                for i in range(self.n_muon, self.expert_first) if self.local[i]]
        work += [(u.members[k].index, lo, hi, g) for u in self.units for k, lo, hi, g in u.local_pieces()]
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for i, lo, hi, g in work:
            if i < self.n_muon or not flags[i]:
                continue
            p = self.params[i]
            whole = lo is None or (lo, hi) == (0, p.numel())
            target = local_tensor(p) if lo is None else p if whole else p.detach().view(-1)[lo:hi]
            st = self.state[p]
            if "step" not in st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(target, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(target, memory_format=torch.preserve_format)
                if not whole:
                    st["shard"] = (lo, hi)
            st["step"] += 1
            params.append(target)
            grads.append(g.view(target.shape).to(p.dtype))
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if params:
            adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, lr=group["lr"], betas=group["betas"],
                        eps=group["eps"], weight_decay=group["weight_decay"])

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state: hyperparameters, the plan, and the state of the parameters this rank
        updates (DMuon: momentum of its owned matrices only; AdamW state everywhere), keyed by name."""
        self.synchronize_exchanges()
        return rank_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what `state_dict()` returned on the same rank of the same set-up (world size, plan)."""
        load_rank_state(self, state_dict)

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held on this rank."""
        return sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))
