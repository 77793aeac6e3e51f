"""Autograd and module hooks: launch each unit's gradient exchange as soon as backward has produced it,
and make a module's forward wait only for the weights it uses.

Launch rule (the same on every rank, so the collectives match): units are launched strictly in their
fixed launch order (reverse forward order). A post-accumulate-grad hook marks its parameter ready;
when the next unit in order is complete it is launched, then any complete units after it. At the end of
each backward pass (an autograd engine callback queued by the first hook) the units not launched yet
(parameters unused on this rank) are launched with zeros for the missing gradients: every backward
outside no_sync() is one complete round, whatever each rank's graph used. If no backward exchanged
anything since the last step (no backward at all, or only inside no_sync()), `finish()` at step() runs
the round.

Gradient accumulation: inside `no_sync()` the hooks do nothing; the gradients accumulate locally and the
next backward outside it (or step() itself) exchanges the accumulated sum. Every backward outside
no_sync() exchanges, so a second one before step() repeats the exchange with the accumulated gradient:
correct, but wasted traffic. All ranks must run the same number of backward passes outside no_sync(),
each reaching at least one parameter the optimizer manages (as with DDP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch


class BackwardTracker:
    """Readiness of the units in one backward round; launches them in order (see module docstring)."""

    def __init__(self, unit_params: Sequence[Sequence[torch.Tensor]], launch: Callable[[int], None],
                 enabled: bool = True):
        self._launch = launch
        self._members = [frozenset(id(p) for p in ps) for ps in unit_params]
        self._unit_of = {id(p): u for u, ps in enumerate(unit_params) for p in ps}
        self._pending = [set(m) for m in self._members]
        self._next = 0
        self._in_backward = False
        self.rounds = 0  # complete rounds since the last finish()
        self.sync = True
        self.enabled = enabled  # False: exchange only at step() (no overlap with backward)
        self._handles = []
        seen = set()
        for ps in unit_params:
            for p in ps:
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.sync or not self.enabled:
            return
        u = self._unit_of.get(id(p))
        if u is None:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._pending[u].discard(id(p))
        n = len(self._members)
        while self._next < n and not self._pending[self._next]:
            self._launch(self._next)
            self._next += 1

    def _end_of_backward(self) -> None:
        self._in_backward = False
        self._complete_round()

    def _complete_round(self) -> None:
        for u in range(self._next, len(self._members)):
            self._launch(u)
        self._next = 0
        self._pending = [set(m) for m in self._members]
        self.rounds += 1

    def finish(self) -> None:
        """At step(): run a round if nothing was exchanged since the last step (see module docstring)."""
        if self.rounds == 0:
            self._complete_round()
        self.rounds = 0

    @contextlib.contextmanager
    def no_sync(self):
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class ForwardWaits:
    """Module hooks: before a module's forward (and before its state_dict() / load_state_dict()) it waits
    for the publication of the units holding its own parameters."""

    def __init__(self, model: torch.nn.Module, unit_of_param: dict[int, object],
                 wait: Callable[[object], None]):
        self._handles = []
        for module in model.modules():
            units = []
            for p in module.parameters(recurse=False):
                u = unit_of_param.get(id(p))
                if u is not None and u not in units:
                    units.append(u)
            if units:
                hook = _make_hook(units, wait)
                self._handles.append(module.register_forward_pre_hook(hook))
                self._handles.append(module.register_state_dict_pre_hook(hook))
                self._handles.append(module.register_load_state_dict_pre_hook(hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _make_hook(units: list, wait: Callable[[object], None]):
    def hook(*args, **kwargs):
        for u in units:
            wait(u)

    return hook
