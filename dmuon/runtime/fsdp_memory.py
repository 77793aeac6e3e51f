"""memory="free" for the fsdp2-owner layout (the paper's Z3): a rank holds a Muon matrix it does not own
only while a forward or a backward needs it.

Per training iteration every owner publishes each of its matrices twice: before the forward that uses
it (F) and again before its backward (R); the gradient is reduced to the owner once. With the gradient
reduce that makes 3 (N-1)/N P bytes per step (muon.md: owner-centric, params freed after forward).

Non-owned matrices are freed by resizing their storage to 0 (`untyped_storage().resize_(0)`; the
Parameter object, its autograd identity and the tensors autograd saved stay valid) and materialized
again by the publication job, which resizes the storage back and copies through an alias tensor (made
with `Tensor.set_` on the same storage) so that the parameter's version counter does not move: autograd
accepts the saved weight in backward.

Schedule (all hooks are public module / autograd hooks):
  root forward pre-hook    a new cycle starts (the previous one is flushed, see below)
  module forward pre-hook  submit F for the units up to the next one (prefetch depth 1), wait for own
  module forward hook      when every module holding a unit's parameters has run: free the unit; a
                           multi-grad hook on the outputs marks "backward reaches this module"
  root forward hook        submit the remaining F (units no module of this rank used), free what is
                           left, and submit R for the first unit backward needs
  backward (multi-grad)    submit R up to the next unit, wait for own
  post-accumulate-grad     once every parameter of a unit has its gradient: free the unit
  end of backward          free everything (and submit the remaining R)
F and R jobs run on their own communication thread and process group, strictly in the order F(forward
order) then R(backward order) on every rank, whatever each rank's graph uses: publications and the
gradient reduces (the other thread) never depend on each other's order, so no rank can deadlock.
A cycle that has begun is always completed: the remaining F / R are submitted at the next root forward
pre-hook or at step().
"""

from __future__ import annotations

import torch
from torch.autograd.graph import register_multi_grad_hook


def _alias(p: torch.Tensor) -> torch.Tensor:
    """A tensor on p's storage with its own version counter."""
    return torch.empty(0, dtype=p.dtype, device=p.device).set_(p.untyped_storage(), p.storage_offset(),
                                                                 p.size(), p.stride())


def check_freeable(name: str, p: torch.Tensor) -> None:
    from ..errors import InputError

    if p.storage_offset() != 0 or p.untyped_storage().nbytes() != p.numel() * p.element_size():
        raise InputError(f"memory='free' frees each non-owned Muon matrix's storage, but {name} shares "
                         "its storage with other tensors (a view or a tied weight); accepted: matrices with "
                         "their own storage (or use memory='keep')")


class _UnitState:
    def __init__(self, unit, rank: int):
        self.unit = unit
        others = [m for m in unit.members if m.owner != rank]
        self.params = [m.param for m in others]
        self.nbytes = [p.untyped_storage().nbytes() for p in self.params]
        self.aliases = {id(p): _alias(p) for p in self.params}
        self.n_grad = sum(1 for m in unit.members if m.param.requires_grad)
        self.modules: set[int] = set()  # ids of modules holding its params
        self.ran: set[int] = set()  # modules whose forward ran in this cycle
        self.grads = 0  # parameters whose gradient accumulated in this backward
        self.handle = None  # the latest publication of this unit
        self.resident = True


class Residency:
    """See the module docstring. `units`: the owner units of the Muon matrices, in launch order."""

    def __init__(self, model: torch.nn.Module, units: list, rank: int):
        self.units = [_UnitState(u, rank) for u in units]
        for s in self.units:
            for m in s.unit.members:
                if m.owner != rank:
                    check_freeable(m.name, m.param)
            s.unit.retarget({id(p): s.aliases[id(p)] for p in s.params}, self._materializer(s))
        self.fwd = list(reversed(self.units))  # forward order
        self._fwd_pos = {id(s): k for k, s in enumerate(self.fwd)}
        self._bwd_pos = {id(s): k for k, s in enumerate(self.units)}
        self.fwd_next = self.bwd_next = 0
        self._in_backward = False
        self.suspended = False  # True: the root state_dict hook does not materialize
        of_param = {id(p): s for s in self.units for p in (m.param for m in s.unit.members)}
        self._handles = []
        for module in model.modules():
            mine = []
            for p in module.parameters(recurse=False):
                s = of_param.get(id(p))
                if s is not None and s not in mine:
                    mine.append(s)
            if mine:
                for s in mine:
                    s.modules.add(id(module))
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(mine)))
                self._handles.append(module.register_forward_hook(self._post_hook(module, mine)))
        for s in self.units:
            for m in s.unit.members:
                if m.param.requires_grad:
                    self._handles.append(m.param.register_post_accumulate_grad_hook(self._grad_hook(s)))
        self._handles.append(model.register_forward_pre_hook(lambda *a, **k: self.start_cycle()))
        self._handles.append(model.register_forward_hook(lambda *a, **k: self._end_forward()))
        self._handles.append(model.register_state_dict_pre_hook(lambda *a, **k: self._state_dict_hook()))
        for s in self.units:  # from now on a rank holds only its own matrices between uses
            self.free(s)

    # ---- publication -------------------------------------------------------------------------
    def _materializer(self, s: _UnitState):
        def materialize():  # on the communication thread, before the job copies into the parameters
            for p, n in zip(s.params, s.nbytes, strict=True):
                st = p.untyped_storage()
                if st.nbytes() != n:
                    st.resize_(n)
            s.resident = True

        return materialize

    def _publish(self, s: _UnitState, what: str) -> None:
        s.handle = s.unit.launch_publish(f"{what} publication of bucket {s.unit.position} (memory='free')")

    def submit_forward(self, upto: int) -> None:
        """Submit F for forward positions < upto (in order)."""
        while self.fwd_next < min(upto, len(self.fwd)):
            self._publish(self.fwd[self.fwd_next], "forward")
            self.fwd_next += 1

    def submit_backward(self, upto: int) -> None:
        while self.bwd_next < min(upto, len(self.units)):
            self._publish(self.units[self.bwd_next], "backward")
            self.bwd_next += 1

    def _wait(self, s: _UnitState) -> None:
        h = s.handle
        if h is not None:
            h.wait()

    def free(self, s: _UnitState) -> None:
        """Drop this rank's copies of the unit's non-owned matrices (after any publication in flight)."""
        self._wait(s)
        if s.resident:
            for p in s.params:
                p.untyped_storage().resize_(0)
            s.resident = False

    # ---- cycle -------------------------------------------------------------------------------
    def start_cycle(self) -> None:
        """Complete the cycle in progress (every rank submits the same sequence) and start a new one."""
        if self.fwd_next:
            self.submit_forward(len(self.fwd))
        if self.bwd_next:
            self.submit_backward(len(self.units))
        self.fwd_next = self.bwd_next = 0
        for s in self.units:
            s.ran.clear()
            s.grads = 0

    def end_step(self) -> None:
        """At step(): complete the cycle (the owners' new weights are published by the next forward)."""
        self.start_cycle()
        for s in self.units:
            self.free(s)

    def materialize_all(self) -> None:
        """Publish every unit and wait (collective: every rank calls it at the same point)."""
        self.start_cycle()
        for s in self.fwd:
            self._publish(s, "materializing")
        for s in self.fwd:
            self._wait(s)

    def _state_dict_hook(self) -> None:
        if not self.suspended:
            self.materialize_all()

    # ---- hooks -------------------------------------------------------------------------------
    def _pre_hook(self, mine: list[_UnitState]):
        def hook(module, args, kwargs=None):
            for s in mine:
                self.submit_forward(self._fwd_pos[id(s)] + 2)
            for s in mine:
                self._wait(s)
                if not s.resident:
                    from ..errors import InputError

                    raise InputError(f"memory='free': {type(module).__name__} ran a second time in one "
                                     "forward after its Muon matrices were freed; accepted: each module "
                                     "holding Muon matrices runs once per forward (or use memory='keep')")

        return hook

    def _post_hook(self, module: torch.nn.Module, mine: list[_UnitState]):
        def hook(mod, args, output):
            for s in mine:
                s.ran.add(id(module))
                if s.ran >= s.modules:
                    self.free(s)
            if torch.is_grad_enabled():
                outs = [t for t in _tensors(output) if t.requires_grad]
                if outs:
                    register_multi_grad_hook(outs, lambda grads: self._before_backward(mine), mode="any")

        return hook

    def _end_forward(self) -> None:
        self.submit_forward(len(self.fwd))
        for s in self.units:
            self.free(s)
        if torch.is_grad_enabled():
            self.submit_backward(1)

    def _before_backward(self, mine: list[_UnitState]) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for s in mine:
            self.submit_backward(self._bwd_pos[id(s)] + 2)
        for s in mine:
            self._wait(s)

    def _grad_hook(self, s: _UnitState):
        def hook(p):
            s.grads += 1
            if s.grads >= s.n_grad:
                self.submit_backward(self._bwd_pos[id(s)] + 1)
                self.free(s)

        return hook

    def _end_backward(self) -> None:
        self._in_backward = False
        self.submit_backward(len(self.units))
        for s in self.units:
            self.free(s)
            s.grads = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def resident_bytes(self) -> int:
        return sum(sum(s.nbytes) for s in self.units if s.resident)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []
