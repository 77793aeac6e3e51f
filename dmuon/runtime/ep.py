"""`EPMuon`: Muon with expert parallelism on torch.distributed, executing a `dmuon.plan.ep` plan.

The model as MoE code holds it under expert parallelism of degree ep (`dmuon.plan.ep.EPLayout`): every
rank has the dense parameters (replicated, DDP-like) and, per MoE layer, its EP rank's E / ep experts
stored as 3-D parameters (E_local, out, in) whose name holds `.experts.` (e.g.
`layers.0.mlp.experts.w_up`); rank r holds the experts k E_local .. (k + 1) E_local - 1 of each such
parameter, k = r % ep. Each expert slice is one Muon matrix (the planner sees it as
`layers.0.mlp.experts.<e>.w_up`), not the 3-D tensor as one matrix.

Gradients, as the training step leaves them in `.grad`: dense parameters hold this rank's gradient (the
step averages them over all ranks); expert parameters hold this replica's gradient of its local experts
(averaged over the EP rank's replica group, the ranks holding the same experts).

One step, from the plan (the same `build_ep_plan` on every rank, so every rank knows every owner):
  dense Muon matrix   reduce (mean) to its owner over all ranks; the owner: momentum, NS, update;
                      broadcast of the new weight from the owner to all ranks
  expert matrix       reduce (mean) of its slice to its owner inside the replica group (no other rank
                      holds it); the owner: momentum, NS, update; broadcast inside the replica group
  AdamW parameters    all-reduce (mean), AdamW on every rank (replicated)
The owner runs each plan batch as one batched NS call: a batch of consecutive experts of one 3-D
parameter is the slice view grad[a:b] of its momentum-updated stack (no copy per expert); other batches
are stacked. Momentum buffers live on the owners only. Same semantics as single-process Muon over the
dense matrices and every expert matrix with the averaged gradients (the test: tests/test_runtime_ep.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from ..newton_schulz import NSConfig, orthogonalize
from ..optim import adamw_step_, lr_scale, muon_apply_, muon_momentum_
from ..params import route
from ..plan.ep import EPLayout, build_ep_plan
from ..plan.types import MatrixSpec


def expert_spec_name(param_name: str, e: int) -> str:
    """'layers.0.mlp.experts.w_up', 3 -> 'layers.0.mlp.experts.3.w_up' (the planner's expert name)."""
    head, sep, tail = param_name.partition(".experts.")
    if not sep:
        raise InputError(f"{param_name!r} is not an expert parameter (no '.experts.' in its name)")
    return f"{head}.experts.{e}.{tail}"


class EPMuon:
    """Muon + AdamW with expert parallelism of degree `ep` (module docstring); Muon's hyperparameters."""

    def __init__(self, model: torch.nn.Module, *, ep: int, lr: float = 0.02, momentum: float = 0.95,
                 nesterov: bool = True, weight_decay: float = 0.0, adjust_lr: str = "match_rms_adamw",
                 ns: NSConfig | None = None, adamw_lr: float = 1e-3, adamw_betas=(0.9, 0.999),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.01, balancer: str = "lpt",
                 cost=None):
        if not dist.is_initialized():
            raise InputError("EPMuon needs an initialized torch.distributed process group")
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.layout = EPLayout(self.world, ep)
        self.k = self.layout.ep_rank(self.rank)
        self.hp = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                       adjust_lr=adjust_lr)
        self.adamw = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                          weight_decay=adamw_weight_decay)
        self.ns = NSConfig() if ns is None else ns
        # every rank creates every replica group, in the same order (torch.distributed's rule)
        self.groups = [dist.new_group(list(self.layout.replica_group(k))) for k in range(ep)]
        self.experts: list[tuple[str, torch.Tensor]] = []
        self.dense: list[tuple[str, torch.Tensor]] = []
        self.adamw_params: list[tuple[str, torch.Tensor]] = []
        for r in route(model):
            if r.param.dim() == 3 and ".experts." in r.name:
                self.experts.append((r.name, r.param))
            elif r.use_muon:
                self.dense.append((r.name, r.param))
            else:
                self.adamw_params.append((r.name, r.param))
        # the planner's view: every dense matrix and every expert of every EP rank, in parameter order
        specs, self.where = [], []  # where[i]: (param, expert slot) or (param, None)
        for layer, (name, p) in enumerate(self.dense + self.experts):
            if p.dim() == 3:
                e_local = p.shape[0]
                for e in range(e_local * ep):
                    specs.append(MatrixSpec(expert_spec_name(name, e), p.shape[1], p.shape[2], layer))
                    self.where.append((p, e - self.k * e_local if e // e_local == self.k else None))
            else:
                specs.append(MatrixSpec(name, p.shape[0], p.shape[1], layer))
                self.where.append((p, None))
        if cost is None:
            from .planning import load_cost

            cost = load_cost(None, next(model.parameters()).device)
        self.plan = build_ep_plan(specs, self.world, cost, ep=ep, balancer=balancer)
        self.state: dict = {}  # momentum: matrix index (dense, owned) or ('stack', id) (3-D experts)
        self.adam_state: dict[int, dict] = {}

    # ---- pieces --------------------------------------------------------------------------------
    def _is_expert(self, i: int) -> bool:
        return self.where[i][0].dim() == 3

    def _holds(self, i: int) -> bool:
        """This rank holds matrix i (dense: everyone; expert: its EP rank's replicas)."""
        return not self._is_expert(i) or self.where[i][1] is not None

    def _tensor(self, i: int, grad: bool) -> torch.Tensor:
        p, slot = self.where[i]
        t = p.grad if grad else p.data
        return t if slot is None else t[slot]

    def _group(self, i: int):
        """(process group, its size) over which matrix i is reduced and published."""
        if self._is_expert(i):
            return self.groups[self.k], self.layout.replicas
        return None, self.world

    @torch.no_grad()
    def step(self) -> None:
        plan = self.plan
        mine = [i for i in range(len(plan.matrices)) if self._holds(i)]
        for i in mine:  # gradients to owners (mean over the group that holds the matrix)
            group, size = self._group(i)
            g = self._tensor(i, grad=True)
            if size > 1:
                dist.reduce(g, plan.owners[i], op=dist.ReduceOp.SUM, group=group)
            if plan.owners[i] == self.rank:
                g.div_(size)
        for b in plan.batches_of(self.rank):
            self._run_batch(b)
        for i in mine:  # publication from the owners
            group, size = self._group(i)
            if size > 1:
                dist.broadcast(self._tensor(i, grad=False), plan.owners[i], group=group)
        self._adamw_step()

    def _buffer(self, i: int) -> torch.Tensor:
        """Matrix i's momentum buffer: its own (dense), or its slice of the 3-D parameter's stack buffer."""
        p, slot = self.where[i]
        if slot is not None:
            return self.state_stack(p)[slot]
        if i not in self.state:
            self.state[i] = torch.zeros_like(p)
        return self.state[i]

    def _run_batch(self, batch) -> None:
        """Momentum, one batched NS call and the update for the batch's matrices (all owned here)."""
        hp = self.hp
        first = self.where[batch.members[0]]
        slots = [self.where[i][1] for i in batch.members]
        if (first[1] is not None and all(self.where[i][0] is first[0] for i in batch.members)
                and slots == list(range(slots[0], slots[0] + len(slots)))):
            # consecutive experts of one 3-D parameter: momentum and NS on the slice views, no copy per expert
            p, a, z = first[0], slots[0], slots[0] + len(slots)
            stack = muon_momentum_(p.grad[a:z], self.state_stack(p)[a:z], hp["momentum"], hp["nesterov"])
        else:  # mixed members: tall ones transposed to the batch's (rows, cols) = (min, max) shape
            ins = [muon_momentum_(self._tensor(i, grad=True), self._buffer(i), hp["momentum"], hp["nesterov"])
                   for i in batch.members]
            stack = torch.stack([self._oriented(batch, t) for t in ins])
        updates = orthogonalize(stack, **self.ns.kwargs())
        for i, u in zip(batch.members, updates, strict=True):
            w = self._tensor(i, grad=False)
            u = u if u.shape == w.shape else u.mT
            muon_apply_(w, u, hp["lr"], hp["weight_decay"], lr_scale(w.shape, hp["adjust_lr"]))

    @staticmethod
    def _oriented(batch, t: torch.Tensor) -> torch.Tensor:
        return t if tuple(t.shape) == (batch.rows, batch.cols) else t.mT

    def state_stack(self, p: torch.Tensor) -> torch.Tensor:
        """The 3-D parameter p's momentum stack (its owned slices are used; created on first use)."""
        key = ("stack", id(p))
        if key not in self.state:
            self.state[key] = torch.zeros_like(p)
        return self.state[key]

    def _adamw_step(self) -> None:
        params = [p for _, p in self.adamw_params if p.grad is not None]
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(self.world)
        if not params:
            return
        states = []
        for p in params:
            st = self.adam_state.setdefault(id(p), {"step": 0, "exp_avg": torch.zeros_like(p),
                                                    "exp_avg_sq": torch.zeros_like(p)})
            st["step"] += 1
            states.append(st)
        adamw_step_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states], [s["step"] for s in states], **self.adamw)
