"""`harness plan --tp T --pp P [--vpp V]`: the DMuon plan of each pipeline stage over its data-parallel group.

Each stage's Muon matrices are its TP shards (simulator.parallel: Megatron's column / row split, the stage
split of simulator.parallel.stage_layers); the plan runs over the stage's gpus / (tp x pp) DP ranks, and a
TP-split matrix is priced as the simulator's step runs it (simulator.parallel_run.TPCost: the whole
matrix in the mode dmuon.plan.tp picks, priced by its price_tp_modes on the profile's NVLink). Stages
with the same matrices have the same plan: printed once, with the stages they stand for.
"""

from __future__ import annotations

import json


def stage_plans(wl, model, ranks: int, tp: int, pp: int, vpp: int, profile: str, cost, plan_fn) -> list:
    """[(stages, stage workload, plan)] per distinct stage (module docstring)."""
    from dmuon.errors import InputError
    from simulator.hardware import load_profile, profile_names
    from simulator.parallel import layout_of, model_heads, stage_layers, stage_workload
    from simulator.parallel_run import TPCost, _shard_shapes
    from simulator.split_links import SimulatorLinks

    if profile not in profile_names():
        raise InputError(f"--tp / --pp price TP collectives on a simulator profile's NVLink; accepted: "
                         f"--profile {' | '.join(profile_names())}")
    hw = load_profile(profile)

    class _Cfg:  # the fields layout_of reads
        gpus, ep, microbatches, sp, recompute = ranks, 1, None, False, "none"

    _Cfg.tp, _Cfg.pp, _Cfg.vpp = tp, pp, vpp
    lay = layout_of(_Cfg, hw.gpus_per_node, model_heads(model))
    seen: dict = {}
    for s, chunks in enumerate(stage_layers(wl, pp, vpp)):
        stage_wl, full = stage_workload(wl, [l for c in chunks for l in c], tp, f"{wl.name} stage {s}")
        key = tuple((m.rows, m.cols, m.layer, m.count) for m in stage_wl.muon_matrices)
        if key in seen:
            seen[key][0].append(s)
            continue
        links = SimulatorLinks(hw.network, hw.gpus_per_node, source=f"simulator profile {profile}")
        c = TPCost(cost, _shard_shapes(stage_wl, full), tp, links, 2, False) if tp > 1 and full else cost
        seen[key] = ([s], stage_wl, plan_fn(stage_wl.muon_matrices, lay.dp, c))
    return list(seen.values())


def print_stage_plans(plans, json_out: bool, tp: int, pp: int, plan_summary, print_plan) -> None:
    """Each distinct stage's plan as harness plan shows one (its plan_summary / print_plan)."""
    if json_out:
        print(json.dumps([{"stages": st, "tp": tp, "pp": pp, **plan_summary(p, w.name)}
                          for st, w, p in plans],
                         indent=1))
        return
    for st, w, p in plans:
        print(f"stages {', '.join(map(str, st))} of {pp} (tp={tp}): {len(w.muon_matrices)} Muon TP shards "
              "over "
              f"{p.world_size} DP ranks")
        print_plan(p, w.name)
