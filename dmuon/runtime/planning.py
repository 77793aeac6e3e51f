"""Building the Plan for a live model: which cost table, and which NS method each batch will run.

- Cost table (`load_cost`): the `profile` argument, or by default on a CPU 'cpu' (one thread), or
  'cpu-t<T>' where the process runs T > 1 torch threads and a table measured at T threads exists (small
  NS calls gain far less from threads than large ones), on a GPU its measured profile if one exists,
  else its datasheet roofline (an unknown GPU: the H100 roofline). If the CPU has
  no measured profile yet, owners are balanced by FLOP counts (`FlopCost`) and a warning says so.
- Method: the plan prices exactly what the runtime will run. A uniform NS config (method 'standard' or
  'gram') is passed as is; 'auto' is planned as the plan's per-batch 'auto' with a cost view
  (`ConfigCost`) that prices only the method this NSConfig resolves for the shape, so each Batch.method
  is the one the owner executes. '_sym' (symmetric Triton kernels) where the config will use them on
  CUDA: kernels='triton', or 'auto' with n > 1024 (the dispatch's rule for unmeasured shapes).
- Orientation: the plan keeps tall and wide matrices of a shape in batches of their own (build_plan's
  `orientation`, `dmuon.plan.orientation`) exactly for the shapes whose NS the runtime runs on tall
  matrices as they are (`tall_as_is_shapes`: standard and Gram NS with torch ops), where a mixed batch
  would run as two calls (`own_orientation_stacks`); with method 'auto' the method asked about is the one
  the config resolves for that shape (the only one the plan may price there). Elsewhere (the Triton
  kernels) a mixed batch is one call and may still form. Not with ep > 1 (build_ep_plan): the expert
  runtime stacks every batch in one call, transposing its tall members.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..errors import InputError
from ..kernels import triton_available
from ..newton_schulz import NSConfig, iterates_tall_as_is, iteration_dtype
from ..plan.flops import ns_flops
from ..plan.types import Plan

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp32"}
FLOP_COST_RATE = 1e11  # FLOP/s of the FLOP-count fallback (only ratios matter to the balancer)


class FlopCost:
    """Cost by FLOP count at a nominal rate: the balancer's fallback where no profile is measured."""

    name = "flop-count fallback (no measured profile)"

    def ns_time(self, rows, cols, batch=1, method="standard", dtype="fp32"):
        from ..plan.cost import CostAnswer

        return CostAnswer(ns_flops(rows, cols, method, batch=batch) / FLOP_COST_RATE, False, self.name)


class ConfigCost:
    """A cost table seen through an NSConfig: methods the config would not run on a shape cost inf."""

    def __init__(self, table, ns: NSConfig, device: torch.device):
        self.table, self.ns, self.device = table, ns, device
        self.name = getattr(table, "name", type(table).__name__)

    def method_for(self, rows: int, cols: int) -> str:
        base = self.ns.method_for(rows, cols)
        return base + ("_sym" if uses_sym(self.ns, min(rows, cols), self.device) else "")

    def ns_time(self, rows, cols, batch=1, method="standard", dtype="fp32"):
        if method != self.method_for(rows, cols):
            from ..plan.cost import CostAnswer

            return CostAnswer(float("inf"), False, f"{method} is not what the NS config runs here")
        return self.table.ns_time(rows, cols, batch, method, dtype)

    def __getattr__(self, item):
        return getattr(self.table, item)


def uses_sym(ns: NSConfig, n: int, device: torch.device) -> bool:
    if device.type != "cuda" or ns.kernels == "torch" or not triton_available():
        return False
    return ns.kernels == "triton" or n > 1024


def default_profile(device: torch.device) -> str:
    """The cost-table name for a device (see the module docstring)."""
    from ..plan.cost import ROOFLINE_SUFFIX, available_profiles, hardware

    if device.type != "cuda":
        threads = torch.get_num_threads()
        table = f"cpu-t{threads}"
        return table if threads > 1 and table in available_profiles() else "cpu"

    name = torch.cuda.get_device_name(device).lower()
    known = sorted(hardware(), key=len, reverse=True)
    gpu = next((g for g in known if g.lower() in name), "h100")
    return gpu if gpu in available_profiles() else gpu + ROOFLINE_SUFFIX


def load_cost(profile: str | None, device: torch.device, dtype: str | None = None):
    """The cost table for `device` (module docstring). A table that has no `dtype` measurements is given
    a modelled peak for it: its widest measured dtype's peak times the matmul speed ratio of the two
    dtypes measured here and now (`matmul_speed_ratio`), so a bf16 run on a table profiled in fp32 is
    planned, priced as modelled, and warned about once, instead of refused."""
    from ..plan.cost import CostTable, available_profiles

    if profile is not None:
        table = CostTable.load(profile)
    else:
        name = default_profile(device)
        if name == "cpu" and "cpu" not in available_profiles():
            warnings.warn("no measured 'cpu' profile in dmuon/plan/profiles: owners are balanced by NS FLOP "
                          "counts instead of measured times", stacklevel=5)
            return FlopCost()
        table = CostTable.load(name)
    missing = dtype is not None and dtype not in table.dtypes and dtype not in table.assumed_dtypes()
    if missing and table.dtypes:
        base = table.widest_dtype
        ratio = matmul_speed_ratio(dtype, base, device)
        table.assume_peak(dtype, table.peak_flops(base) * ratio,
                          f"no {dtype} measurements: priced at its {base} peak x {ratio:.2f}, the {dtype} / "
                          f"{base} matmul speed ratio measured on this {device.type} at start-up "
                          f"({RATIO_SIZE.get(device.type, 512)}^3, median of {RATIO_REPEATS}); modelled")
    return table


RATIO_SIZE = {"cpu": 512, "cuda": 4096}
RATIO_REPEATS = 5
_RATIOS: dict[tuple, float] = {}


def matmul_speed_ratio(dtype: str, base: str, device: torch.device) -> float:
    """How many times faster an n^3 matmul runs in `dtype` than in `base` on this device (medians of
    RATIO_REPEATS timed products after one warm-up; measured once per process)."""
    import statistics
    import time

    key = (dtype, base, device.type, torch.get_num_threads())
    if key not in _RATIOS:
        n = RATIO_SIZE.get(device.type, 512)
        times = {}
        for name in (dtype, base):
            dt = {v: k for k, v in DTYPE_NAMES.items() if k != torch.float64}[name]
            a = torch.rand(n, n, device=device).to(dt)
            ts = []
            for rep in range(RATIO_REPEATS + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                a @ a
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if rep:
                    ts.append(time.perf_counter() - t0)
            times[name] = statistics.median(ts)
        _RATIOS[key] = times[base] / times[dtype]
    return _RATIOS[key]


def build_model_plan(specs, world_size: int, ns: NSConfig, device: torch.device, *, balancer: str,
                     profile: str | None, max_batch: int, bucket_numel: int, priced: bool = True,
                     max_split: int = 1, owner_momentum: bool = True, ep: int = 1) -> Plan:
    """The Plan for these matrices, priced for what this NS config runs on this device (priced=False:
    FLOP counts, for NaiveMuon, which uses only the plan's buckets). max_split > 1: owner groups of up
    to that many ranks where a split pays (`dmuon.plan.split`, the cost table device's link model).
    owner_momentum: batches priced with the owner's momentum pass (build_plan; False for fsdp2-sharded).
    ep > 1: `dmuon.plan.ep.build_ep_plan` (expert matrices owned in their replica group); every batch is
    then priced with the owner's momentum pass (the experts' momentum runs on their owner in every
    layout)."""
    from ..plan.build import build_plan
    from ..plan.ep import build_ep_plan

    if not specs:
        raise InputError("no Muon matrices to plan")
    view = ConfigCost(FlopCost(), ns, device)
    methods = {view.method_for(s.rows, s.cols) for s in specs}
    method = methods.pop() if len(methods) == 1 else "auto"
    base = method.removesuffix("_sym") if method != "auto" else "standard"
    dtype = DTYPE_NAMES[iteration_dtype(base, device, ns.dtype)]
    cost = ConfigCost(load_cost(profile, device, dtype) if priced else FlopCost(), ns, device)
    if ep > 1:  # the expert runtime stacks a batch's tall members transposed: one call either way
        return build_ep_plan(specs, world_size, cost, ep=ep, balancer=balancer, method=method, dtype=dtype,
                             batching=True, max_batch=max_batch, bucket_numel=bucket_numel,
                             max_split=max_split)
    return build_plan(specs, world_size, cost, balancer=balancer, method=method, dtype=dtype, batching=True,
                      max_batch=max_batch, bucket_numel=bucket_numel, max_split=max_split,
                      owner_momentum=owner_momentum, orientation=tall_as_is_shapes(specs, view, ns, device))


def tall_as_is_shapes(specs, view: ConfigCost, ns: NSConfig, device: torch.device) -> frozenset:
    """The NS shapes (n, m) of `specs` whose tall matrices the config's NS iterates as they are, asked with
    the method it runs on the shape (see the module docstring)."""
    shapes = {(min(s.rows, s.cols), max(s.rows, s.cols)) for s in specs}
    device = torch.device(device)
    return frozenset((n, m) for n, m in shapes
                     if _tall_as_is(n, m, view.method_for(n, m).removesuffix("_sym"), ns, device))


def check_max_split(max_split, world_size: int) -> int:
    """max_split of a distributed optimizer: an integer in [1, world size]."""
    if isinstance(max_split, bool) or not isinstance(max_split, int) or not 1 <= max_split <= world_size:
        raise InputError(f"max_split must be an integer from 1 (no splitting) to the number of ranks "
                         f"({world_size}), got {max_split!r}")
    return max_split


def check_given_plan(plan, specs, world_size: int, ep: int = 1) -> Plan:
    """A Plan passed to the optimizer (`plan=`) must be for these matrices on this many ranks, with this
    expert-parallel degree (ep > 1: the dense matrices, then every expert matrix)."""
    if not isinstance(plan, Plan):
        raise InputError(f"plan must be a dmuon.plan.types.Plan (Plan.from_json of `harness plan --json`), "
                         f"got {type(plan).__name__}")
    if plan.world_size != world_size:
        raise InputError(f"the plan is for {plan.world_size} ranks but the optimizer runs on {world_size}; "
                         "accepted: a plan built for this world size")
    if plan.ep != ep:
        raise InputError(f"the plan places experts for ep={plan.ep} but the optimizer runs ep={ep}; "
                         "accepted: a plan built with the optimizer's ep (dmuon.plan.ep.build_ep_plan)")
    want = [(s.name, s.rows, s.cols) for s in specs]
    got = [(m.name, m.rows, m.cols) for m in plan.matrices]
    if want != got:
        diff = next(((w, g) for w, g in zip(want, got, strict=False) if w != g), None)
        raise InputError(f"the plan's matrices differ from the model's Muon matrices ({len(got)} vs "
                         f"{len(want)}; first difference {diff}); accepted: a plan of this model's matrices, "
                         "in the optimizer's order")
    if len(plan.owners) != len(want) or any(not 0 <= o < world_size for o in plan.owners):
        raise InputError(f"the plan's owners must be one rank in [0, {world_size}) per matrix")
    return plan


def batch_method(plan: Plan, batch) -> str:
    """The orthogonalize() method of a batch: its own, else the plan's, without the kernel suffix."""
    m = batch.method or plan.method
    return m.removesuffix("_sym")


def own_orientation_stacks(plan: Plan, batch, ns, device) -> bool:
    """Whether a plan batch's members of the other orientation (tall ones of a wide batch) get an NS
    stack of their own shape: where the NS settings `ns` iterate them as they are
    (`dmuon.newton_schulz.iterates_tall_as_is`), so a shared stack would only add transposed copies.
    Elsewhere (the Triton kernels) they are transposed either way, and one stack of the batch's
    shape makes one call, as the plan prices it. Never for a split batch (its group splits one stack's
    columns)."""
    if len(batch.group) > 1:
        return False
    return _tall_as_is(batch.rows, batch.cols, batch_method(plan, batch), ns, torch.device(device))


@functools.lru_cache(maxsize=256)
def _tall_as_is(rows: int, cols: int, method: str, ns, device) -> bool:
    return iterates_tall_as_is(rows, cols, device, **{**ns.kwargs(), "method": method})
