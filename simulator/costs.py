"""Cost tables and dmuon plans the simulator prices with, cached per process.

`load_cost(names)` loads the first of a profile's cost tables that dmuon's CostTable can read;
`thread_cost_for(profile, cfg)` the table measured at cfg.cpu_threads threads (CPU profiles);
`plan_for(...)` is `dmuon.plan.build.build_plan`, once per distinct input, so that the adamw / naive /
dmuon rows of one sweep point (run in one worker, harness.runners) never solve the same MILP twice;
`tp_plan_for(...)` is `dmuon.plan.tp.build_tp_plan`, cached the same way.
"""

from __future__ import annotations

from dmuon.errors import InputError

_COSTS: dict[str, object] = {}
_PLANS: dict[tuple, object] = {}


def load_cost(names: tuple[str, ...] | str):
    """The first of `names` that dmuon's CostTable can load (cached)."""
    from dmuon.plan.cost import CostTable

    if isinstance(names, str):
        names = (names,)
    elif not (isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names)):
        from dmuon.plan.cost import available_profiles

        raise InputError(f"profile must be a cost-profile name or a profile CSV path, got {names!r}; "
                         f"accepted: {', '.join(available_profiles())}, <path>.csv")
    names = tuple(names)
    errors = []
    for name in names:
        if name not in _COSTS:
            try:
                _COSTS[name] = CostTable.load(name)
            except InputError as e:
                errors.append(str(e))
                continue
        return _COSTS[name]
    raise InputError(f"no cost table among {list(names)} loads: " + " | ".join(errors))


def plan_for(matrices, world_size: int, cost, *, balancer: str, method: str, dtype: str, batching: bool,
             max_batch: int, bucket_numel: int, time_limit_s: float, max_split: int = 1, links=None,
             ep: int = 1, owner_momentum: bool = True, orientation=False):
    """build_plan once per distinct input (cached in this process). links (max_split > 1): a
    `simulator.programs.split_links.SimulatorLinks`, keyed by its network, node size and ring choice.
    orientation: build_plan's (`simulator.setup.orientation_of`; not with ep > 1, as the runtime)."""
    link_key = None
    if max_split > 1 and links is not None:
        link_key = (id(links.net), links.gpus_per_node, links.hierarchical)
    key = (tuple(matrices), world_size, id(cost), balancer, method, dtype, batching, max_batch, bucket_numel,
           time_limit_s, max_split, link_key, owner_momentum) + ((ep,) if ep > 1 else ()) + (
               (orientation,) if orientation else ())
    got = _PLANS.get(key)  # one look-up: the key hashes every matrix (~70,000 with expert parallelism)
    if got is not None:
        return got[-1]
    if ep > 1:  # expert parallelism: experts owned in their replica group
        from dmuon.plan.ep import build_ep_plan

        plan = build_ep_plan(matrices, world_size, cost, ep=ep, balancer=balancer, method=method, dtype=dtype,
                             batching=batching, max_batch=max_batch, bucket_numel=bucket_numel,
                             time_limit_s=time_limit_s)
        _PLANS[key] = (cost, None, plan)
    else:
        from dmuon.plan.build import build_plan

        plan = build_plan(matrices, world_size, cost, balancer=balancer, method=method, dtype=dtype,
                          batching=batching, max_batch=max_batch, bucket_numel=bucket_numel,
                          time_limit_s=time_limit_s, max_split=max_split,
                          links=links if max_split > 1 else None, owner_momentum=owner_momentum,
                          orientation=orientation)
        # holding the cost (and the links' network) keeps their ids from being reused while cached
        _PLANS[key] = (cost, links, plan)
    return plan


def tp_plan_for(matrices, world_size: int, cost, *, tp: int, shard_dims, method: str, dtype: str, links,
                wire_bytes: int, bucket_numel: int):
    """`dmuon.plan.tp.build_tp_plan` once per distinct input (cached in this process; the simulator's TP
    stages, simulator.programs.parallel_dmuon, and `harness plan --tp` ask for it)."""
    key = ("tp", tuple(matrices), world_size, id(cost), tp, tuple(shard_dims), method, dtype, id(links),
           wire_bytes, bucket_numel)
    if key not in _PLANS:
        from dmuon.plan.tp import build_tp_plan

        plan = build_tp_plan(matrices, world_size, cost, tp=tp, shard_dims=shard_dims, method=method,
                             dtype=dtype, links=links, wire_bytes=wire_bytes, bucket_numel=bucket_numel)
        _PLANS[key] = (cost, links, plan)
    return _PLANS[key][-1]


def thread_cost_for(profile, cfg):
    """CPU profiles with cfg.cpu_threads > 1: the cost table measured at that many threads per call
    (`harness profile --threads T` saved as <cost profile>-t<T>), or None where there is none (then
    one-thread times are divided by the profile's measured [threads] speedup)."""
    if not profile.cpu_cores or cfg.cpu_threads <= 1:
        return None
    from dmuon.plan.cost import available_profiles

    names = [f"{n}-t{cfg.cpu_threads}" for n in profile.cost_profiles]
    have = set(available_profiles())
    found = [n for n in names if n in have]
    return load_cost(found[0]) if found else None


__all__ = ["load_cost", "plan_for", "thread_cost_for", "tp_plan_for"]
