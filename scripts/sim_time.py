"""CPU seconds of `simulator.api.simulate` per configuration (plan included), each run in a fresh process,
split into plan / spec, building the step programs, running them and reading the metrics; with --other
TREE the same configurations also run from another checkout (e.g. a `git worktree` of an older commit),
alternating with this one, and the ratio of the totals is printed (the machine's load moves CPU time by
+-30%, so compare runs made side by side).

    python -m scripts.sim_time "model=kimi-k2-like,gpus=1024,ep=64" [more configs] [--rounds 2] [--other DIR]
    python -m scripts.sim_time --grid          # the paper workloads x 256 / 1024 GPUs x fsdp-keep / hsdp-free
                                               # x adamw / naive / dmuon, against the 2 s / 10 s goals
    python -m scripts.sim_time --cli CONFIG    # the path of `harness simulate` / `harness run` instead
                                               # (simulator.api.run, which also returns the programs)
"gc" is the CPU time of the garbage collector's passes, inside the total; "loop" the event loop that ran
(native: simulator/engine/engine_native.c; python: engine_fast; DMUON_SIM_ENGINE=python times the Python one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GOALS = {256: 2.0, 1024: 10.0}


def _child(cfg: dict, cli: bool = False) -> None:
    """Time one simulate() with its phases (run in the child process); cli: the path of `harness simulate`
    instead (`harness.cmd_simulate.run_simulations`: simulator.api.run, which returns the programs too).
    "gc" is the CPU time of the cyclic garbage collector's passes inside the total."""
    import gc

    from simulator import setup

    from simulator.engine import engine, metrics

    from simulator.programs import step
    from simulator.api import SimConfig, simulate

    phases: dict = {"gc": 0.0}
    started = []

    def collecting(phase, _info):
        if phase == "start":
            started.append(time.process_time())
        elif started:
            phases["gc"] += time.process_time() - started.pop()

    def timed(owner, name, label):
        f = getattr(owner, name)

        def g(*a, **k):
            t = time.process_time()
            try:
                return f(*a, **k)
            finally:
                phases[label] = phases.get(label, 0.0) + time.process_time() - t
        setattr(owner, name, g)

    timed(setup, "make_spec", "plan+spec")
    timed(step, "build", "build")
    timed(engine.Cluster, "run", "run")
    loops = []
    ran = engine.Cluster.run

    def run_and_note(self, *a, **k):
        try:
            return ran(self, *a, **k)
        finally:
            loops.append(getattr(self, "engine", "") or "python")
    engine.Cluster.run = run_and_note
    timed(metrics, "measure", "metrics")
    target = simulate
    if cli:
        from harness.cmd_simulate import run_simulations

        def target(c):
            return run_simulations([c], None)[0]
    gc.callbacks.append(collecting)
    t = time.process_time()
    r = target(SimConfig(**cfg))
    phases["total"] = time.process_time() - t
    gc.callbacks.remove(collecting)
    print(json.dumps({"phases": phases, "step_s": r.step_s, "engine": ",".join(sorted(set(loops)))}))


def _parse(text: str) -> dict:
    out = {}
    for item in text.split(","):
        k, _, v = item.partition("=")
        out[k.strip()] = int(v) if v.strip().isdigit() else v.strip()
    return out


def time_config(tree: str, cfg: dict, cli: bool = False) -> dict:
    """Time `cfg` in a fresh process with `tree`'s simulator (this file's _child, that tree first on the
    path, so an older checkout without this script can be timed too)."""
    me = os.path.abspath(__file__)
    code = (f"import importlib.util, sys; sys.path.insert(0, {tree!r}); "
            f"spec = importlib.util.spec_from_file_location('sim_time', {me!r}); "
            f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            f"m._child({cfg!r}, {cli!r})")
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="SimConfig fields as k=v,k=v")
    ap.add_argument("--other", help="another checkout, timed side by side with this one")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--cli", action="store_true", help="time harness simulate's path (simulator.api.run)")
    a = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfgs = [_parse(c) for c in a.configs]
    if a.grid:
        cfgs += [dict(workload=w, gpus=g, layout=lay, strategy=s)
                 for w in ("qwen2.5-7b", "pi0", "wall-oss", "wall-wm") for g in (256, 1024)
                 for lay in ("fsdp-keep", "hsdp-free") for s in ("adamw", "naive", "dmuon")]
    trees = [("other", a.other), ("this", here)] if a.other else [("this", here)]
    for cfg in cfgs:
        for _ in range(a.rounds):
            totals = {}
            for name, tree in trees:
                r = time_config(tree, cfg, a.cli)
                ph = r["phases"]
                totals[name] = ph["total"]
                goal = GOALS.get(cfg.get("gpus")) if a.grid else None
                over = "  OVER" if goal is not None and ph["total"] > goal else ""
                print(f"{name}: {cfg}: " + " ".join(f"{k} {v:.2f}" for k, v in ph.items())
                      + f" s CPU (step_s {r['step_s']!r}, loop {r.get('engine') or '?'}){over}", flush=True)
            if "other" in totals:
                print(f"  this / other: {totals['this'] / totals['other']:.2f}", flush=True)


if __name__ == "__main__":
    main()
