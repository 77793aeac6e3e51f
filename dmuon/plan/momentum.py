"""The owner's per-batch momentum work, as the plan prices it (`balance.build_work_model`,
`Batch.momentum_s`).

In the replicated and fsdp2-owner layouts the owner of a matrix runs its momentum update (one fused
pass per step over everything it owns: `dmuon.runtime`, the cost table's `muon_momentum` op) before the
orthogonalization, so a batch's cost on its owner is its NS call plus its elements' share of that pass.
The pass's fixed per-call intercept is paid once per owner per step, whatever it owns, so it is not a
per-batch cost and the balancers do not see it.
"""

from __future__ import annotations

from ..errors import InputError

MOMENTUM_OP = "muon_momentum"


def momentum_time(cost, numel: int, batch: int) -> float:
    """The owner's momentum work on a batch of `batch` matrices of `numel` elements each: the marginal
    cost of their elements in the owner's one fused pass per step (`CostTable.elementwise_time` of the
    batch's elements less the pass's fixed intercept, its time over one element, which every owner pays
    once per step whatever it owns) plus `batch` x the measured cost of one more tensor
    (`CostTable.per_tensor_time`). 0 for a cost table that prices no elementwise passes (FLOP counts)."""
    ew = getattr(cost, "elementwise_time", None)
    if ew is None:
        return 0.0
    try:
        t = ew(numel * batch, MOMENTUM_OP, "fp32").time_s - ew(1, MOMENTUM_OP, "fp32").time_s
        per = cost.per_tensor_time(MOMENTUM_OP, "fp32") if hasattr(cost, "per_tensor_time") else 0.0
    except InputError:  # a table that cannot price elementwise passes: NS seconds alone
        return 0.0
    return max(t, 0.0) + batch * per
