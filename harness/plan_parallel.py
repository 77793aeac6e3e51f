"""`harness plan --tp T --pp P [--vpp V]`: the DMuon plan of each pipeline stage over its data-parallel group.

Each stage's Muon matrices are its TP shards (simulator.programs.parallel: Megatron's column / row split, the stage
split of simulator.programs.parallel.stage_layers). tp = 1: the plan over the stage's gpus / pp DP ranks. tp > 1:
the Plan dmuon.plan.tp.build_tp_plan returns for the stage's whole matrices over its gpus / pp ranks, the
very plan (same call, arguments, cost table and cache) the simulator's step runs
(simulator.programs.parallel_dmuon.stage_dp_plan), then its DP view: each TP group's load as the runtime runs it
(one matrix after another). Stages with the same matrices have the same plan: printed once, with the
stages they stand for.
"""

from __future__ import annotations

import json


def stage_plans(wl, model, ranks: int, tp: int, pp: int, vpp: int, profile: str, cost, plan_fn) -> list:
    """[(stages, stage workload, plan, its DP view or None)] per distinct stage (module docstring)."""
    from dmuon.errors import InputError
    from simulator.fabric.hardware import load_profile, profile_names
    from simulator.programs.parallel import layout_of, model_heads, stage_layers, stage_workload

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
        if tp > 1 and full:  # the simulator's own call (simulator.programs.parallel_dmuon; `plan_fn`'s --method,
            # --dtype and --bucket-numel as SimConfig's ns_method, ns_dtype and bucket_numel; the
            # simulator profile's cost table, as its step loads it)
            from simulator.api import SimConfig
            from simulator.costs import load_cost
            from simulator.programs.parallel_dmuon import stage_dp_plan

            kw = plan_fn.keywords
            cfg = SimConfig(workload=wl.name, gpus=ranks, gpu=profile, tp=tp, pp=pp, vpp=vpp,
                            ns_method=kw["method"], ns_dtype=kw["dtype"], bucket_numel=kw["bucket_numel"])
            tp_plan, view = stage_dp_plan(cfg, stage_wl, full, lay, hw, load_cost(hw.cost_profiles))
            seen[key] = ([s], stage_wl, tp_plan, view)
            continue
        seen[key] = ([s], stage_wl, plan_fn(stage_wl.muon_matrices, lay.dp, cost), None)
    return list(seen.values())


def print_stage_plans(plans, json_out: bool, tp: int, pp: int, plan_summary, print_plan) -> None:
    """Each distinct stage's plan as harness plan shows one (its plan_summary / print_plan); tp > 1: the TP
    plan, then its DP view (the TP groups' loads the simulator runs)."""
    if json_out:
        print(json.dumps([{"stages": st, "tp": tp, "pp": pp, **plan_summary(p, w.name)}
                          | ({"tp_modes": [c.mode if c else "whole" for c in p.tp_choices],
                              "tp_groups": plan_summary(v, w.name)} if v is not None else {})
                          for st, w, p, v in plans],
                         indent=1))
        return
    for st, w, p, v in plans:
        if v is None:
            print(f"stages {', '.join(map(str, st))} of {pp}: {len(w.muon_matrices)} Muon matrices over "
                  f"{p.world_size} DP ranks")
            print_plan(p, w.name)
            continue
        print(f"stages {', '.join(map(str, st))} of {pp} (tp={tp}): dmuon.plan.tp.build_tp_plan of "
              f"{len(w.muon_matrices)} Muon matrices over {p.world_size} ranks (TP group d = ranks "
              f"d x {tp} .. d x {tp} + {tp - 1})")
        print_plan(p, w.name)
        print(f"its DP view, what the simulator runs: {v.world_size} TP groups, each running its matrices "
              "one after another (simulator.programs.parallel_dmuon)")
        print_plan(v, w.name)
