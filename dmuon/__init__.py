"""dmuon: owner-centric distributed Muon (single-device Muon, DMuon, NaiveMuon) and its plan.

`import dmuon` needs only torch (and Triton where the symmetric kernels run): the planner's
MILP / simulator dependencies are imported inside the functions that use them.
"""

from .distributed import DMuon, NaiveMuon
from .optim import Muon, adamw_step_, lr_scale, muon_apply_, muon_momentum_
from .orthogonalize import (
    NSConfig,
    as_matrix,
    coefficient_schedule,
    orthogonalize,
    orthogonalize_many,
    orthogonalize_reshaped,
)
from .params import adamw_params, muon_params, route

__version__ = "0.1.0"

__all__ = [
    "DMuon",
    "NaiveMuon",
    "Muon",
    "NSConfig",
    "adamw_params",
    "adamw_step_",
    "as_matrix",
    "coefficient_schedule",
    "lr_scale",
    "muon_apply_",
    "muon_momentum_",
    "muon_params",
    "orthogonalize",
    "orthogonalize_many",
    "orthogonalize_reshaped",
    "route",
]
