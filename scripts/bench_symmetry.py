"""Wall time of `simulator.api.simulate` with rank symmetry (one rank per class, simulator.symmetry) and
without (DMUON_SIM_SYMMETRY=off: every rank), side by side, each in a fresh process (plans are cached
per process), with each result's digest (sha256 of every SimResult field but provenance, floats by repr:
equal digests = bit-identical results) and the number of simulated ranks.

    python -m scripts.bench_symmetry                         # the Kimi-K2-like ep 64 ladder
    python -m scripts.bench_symmetry "model=kimi-k2-like,gpus=4096,ep=64" "workload=qwen2.5-7b,gpus=256"
    python -m scripts.bench_symmetry --full-upto 1024 ...    # skip the full simulation above 1024 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LADDER = ["model=kimi-k2-like,gpus=256,ep=64", "model=kimi-k2-like,gpus=1024,ep=64",
          "model=kimi-k2-like,gpus=4096,ep=64", "model=kimi-k2-like,gpus=16384,ep=64",
          "model=kimi-k2-like,gpus=65536,ep=64"]


def parse(text: str) -> dict:
    """'k=v,k=v' -> a SimConfig's keyword arguments (ints, floats, true / false, else strings)."""
    out = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def _child(cfg: str) -> None:
    from simulator.api import SimConfig, run
    from simulator.engine import paused_gc
    from simulator.symmetry import enabled, result_digest

    t = time.perf_counter()
    with paused_gc():
        res, built = run(SimConfig(**parse(cfg)), all_ranks=not enabled())
        ranks = sum(1 for w in built.cluster.weight if w)
    wall = time.perf_counter() - t
    print(json.dumps({"wall_s": wall, "digest": result_digest(res), "step_s": res.step_s, "ranks": ranks}))


def measure(cfg: str, mode: str, timeout: float) -> dict | None:
    env = dict(os.environ, DMUON_SIM_SYMMETRY=mode)
    try:
        out = subprocess.run([sys.executable, "-m", "scripts.bench_symmetry", "--child", cfg], env=env,
                             capture_output=True, text=True, timeout=timeout, check=True).stdout
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="k=v,k=v SimConfig fields (default: the Kimi-K2-like ladder)")
    ap.add_argument("--full-upto", type=int, default=4096, help="largest GPU count the full simulation runs")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per simulation")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child)
        return
    print(f"{'config':44} {'sym s':>8} {'full s':>8} {'ranks':>12} {'speedup':>8}  digest")
    bad = 0
    for cfg in a.configs or LADDER:
        sym = measure(cfg, "on", a.timeout)
        full = measure(cfg, "off", a.timeout) if parse(cfg).get("gpus", 8) <= a.full_upto else None
        if sym is None:
            print(f"{cfg:44} timed out after {a.timeout:g} s")
            continue
        same = "" if full is None else ("  = full" if full["digest"] == sym["digest"] else "  != FULL")
        bad += same == "  != FULL"
        ft = f"{full['wall_s']:8.2f}" if full else f"{'-':>8}"
        sp = f"{full['wall_s'] / sym['wall_s']:7.1f}x" if full else f"{'-':>8}"
        ranks = f"{sym['ranks']}/{parse(cfg).get('gpus', 8)}"
        print(f"{cfg:44} {sym['wall_s']:8.2f} {ft} {ranks:>12} {sp}  {sym['digest'][:16]}{same}", flush=True)
    if bad:
        sys.exit(f"{bad} configuration(s) differ from the full simulation")


if __name__ == "__main__":
    main()
