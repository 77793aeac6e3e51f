"""The plan: cost table, owner balancers and the execution plan both executors share (no torch).

    from dmuon.plan import CostTable, build_plan
    plan = build_plan(matrices, world_size, CostTable.load("a800"), balancer="milp")

Modules: types (Plan, Batch, Bucket, MatrixSpec), flops (NS FLOP counts), cost (CostTable), fit
(efficiency curves), profile_io (profile CSV), profile (the profiler; torch inside), balance
(work model, round-robin, LPT), split (pricing of split NS over owner groups: LinkModel, LINKS),
splitbal (assignments with split batches, LPT with splits), solver (HiGHS helpers), milp + colgen (the
MILP balancer), build (build_plan; max_split= turns owner groups on).
"""

from .build import BALANCERS, build_plan
from .cost import CostAnswer, CostTable, available_profiles
from .types import Batch, Bucket, MatrixSpec, Plan

__all__ = [
    "BALANCERS",
    "Batch",
    "Bucket",
    "CostAnswer",
    "CostTable",
    "MatrixSpec",
    "Plan",
    "available_profiles",
    "build_plan",
]
