"""dmuon: owner-centric distributed Muon (single-device Muon, DMuon, NaiveMuon) and its plan.

`import dmuon` needs only torch (and Triton where the symmetric kernels run): the planner's
MILP / simulator dependencies are imported inside the functions that use them. The public names are
loaded on first use, so `dmuon.errors` and `dmuon.plan` (pure Python) can be imported without torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DMuon": "distributed",
    "NaiveMuon": "distributed",
    "Muon": "optim",
    "adamw_step_": "optim",
    "lr_scale": "optim",
    "muon_apply_": "optim",
    "muon_momentum_": "optim",
    "NSConfig": "newton_schulz",
    "as_matrix": "newton_schulz",
    "coefficient_schedule": "newton_schulz",
    "orthogonalize": "newton_schulz",
    "orthogonalize_many": "newton_schulz",
    "orthogonalize_reshaped": "newton_schulz",
    "orthogonalize_distributed": "split_ns",
    "adamw_params": "params",
    "muon_params": "params",
    "route": "params",
    "routing_table": "params",
    "AttentionShape": "params",
    "MatrixLayout": "matrices",
    "shard_model": "runtime.fsdp",
    "save_checkpoint": "runtime.checkpoint",
    "load_checkpoint": "runtime.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dmuon' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
