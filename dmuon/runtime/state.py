"""Per-rank state dicts of the distributed optimizers (`DistributedMuonBase.state_dict` and
`load_state_dict`): what a rank saves (hyperparameters, the plan, the state of what it updates, keyed
by parameter name) and the checks that a loaded one comes from the same rank of the same set-up. See
docs/runtime.md."""

from __future__ import annotations

import torch

from ..errors import InputError

STATE_FORMAT = "dmuon.replicated/1"


def rank_state_dict(self) -> dict:
    """`self.state_dict()` once its exchanges are waited for: hyperparameters, the plan, and the state of
    the parameters this rank updates (DMuon: momentum of its owned matrices only; AdamW state
    everywhere), keyed by name."""
    plan = whole_plan(self)
    return {
        "format": STATE_FORMAT, "optimizer": type(self).__name__, "rank": self.rank,
        "world_size": self.world_size, "plan": plan.to_dict() if plan is not None else None,
        "steps": self._steps, "skipped_steps": self.skipped_steps,
        "param_groups": [{k: v for k, v in g.items() if k not in ("params", "layouts")}
                         for g in self.param_groups],
        "state": {self.names[i]: dict(self.state[p]) for i, p in enumerate(self.params)
                  if self.state.get(p)},
    }


def whole_plan(self):
    """The plan of every matrix the optimizer updates: with ep > 1 the EP plan (experts included)."""
    return self.ep_plan if getattr(self, "ep_plan", None) is not None else self.plan


def load_rank_state(self, state_dict: dict) -> None:
    """Load what `state_dict()` returned on the same rank of the same set-up (world size, plan)."""
    sd = state_dict
    if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
        raise InputError(f"not a {type(self).__name__} state dict (expected format {STATE_FORMAT!r}, got "
                         f"{sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r})")
    checks = (("optimizer", type(self).__name__), ("world_size", self.world_size), ("rank", self.rank))
    for key, mine in checks:
        if sd.get(key) != mine:
            raise InputError(f"state dict was saved with {key}={sd.get(key)!r} but this optimizer has "
                             f"{key}={mine!r}; load each rank's own state into the same set-up")
    saved_plan, plan = sd.get("plan"), whole_plan(self)
    if (saved_plan is None) != (plan is None) or (
            plan is not None and (tuple(saved_plan["owners"]) != plan.owners
                                  or [m["name"] for m in saved_plan["matrices"]]
                                  != [m.name for m in plan.matrices])):
        raise InputError("state dict was saved with a different plan (matrices or owners differ); "
                         "rebuild the optimizer with the same model, world size, balancer and profile")
    if len(sd["param_groups"]) != len(self.param_groups):
        raise InputError("state dict has a different number of parameter groups")
    by_name = dict(zip(self.names, self.params, strict=True))
    unknown = sorted(set(sd["state"]) - set(by_name))
    if unknown:
        raise InputError(f"state dict has state for parameters this optimizer does not manage: "
                         f"{unknown[:5]}")
    for g, saved in zip(self.param_groups, sd["param_groups"], strict=True):
        g.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
    self.state.clear()
    for name, st in sd["state"].items():
        p = by_name[name]
        self.state[p] = {k: (v.detach().clone().to(p.device) if isinstance(v, torch.Tensor) else v)
                         for k, v in st.items()}
    self._steps, self.skipped_steps = sd.get("steps", 0), sd.get("skipped_steps", 0)
