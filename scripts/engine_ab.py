"""CPU seconds of the event loop alone, two or more versions side by side on one built cluster: the step
programs of one configuration are built once, then each version's `run_fast` runs them in turn (op and
collective times reset between runs), round after round in rotating order, so every version meets the
same graph, the same memory layout and, pairwise, about the same machine load. Each version is a Python
file defining `run_fast(cluster)` (e.g. simulator/engine/engine_fast.py of this tree and of an older checkout), or
`native` for this tree's compiled loop (simulator/engine/engine_native.c).
Prints each version's op-time digest (all must agree: the same simulation), its median and minimum, and
the median over rounds of its time / the first version's.

    python -m scripts.engine_ab "model=kimi-k2-like,gpus=1024,ep=64" OLD/simulator/engine/engine_fast.py \
        simulator/engine/engine_fast.py --rounds 8
    python -m scripts.engine_ab "model=kimi-k2-like,gpus=1024,ep=64" simulator/engine/engine_fast.py native
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import statistics
import time

from scripts.sim_time import _parse
from simulator.engine import engine
from simulator.api import SimConfig, build_programs


def built_cluster(cfg: dict):
    """The cluster `simulate(cfg)` would run, built and not run."""
    return build_programs(SimConfig(**cfg), all_ranks=False).cluster


def digest(cl) -> str:
    h = hashlib.sha256()
    for ops in cl.queues.values():
        for o in ops:
            h.update(f"{o.start!r}|{o.end!r}|{o.slowed_s!r}\n".encode())
    return h.hexdigest()[:16]


def load(path: str, k: int):
    if path == "native":
        from simulator.engine import engine_native

        mod = engine_native.load()
        if mod is None:
            raise SystemExit("the compiled event loop is not available here (DMUON_SIM_ENGINE=python?)")

        class _Native:
            @staticmethod
            def run_fast(cl):
                return engine_native.run_native(cl, mod, engine.Op, engine.Collective)
        return _Native
    spec = importlib.util.spec_from_file_location(f"engine_ab_{k}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="SimConfig fields as k=v,k=v")
    ap.add_argument("engines", nargs="+", help="Python files defining run_fast(cluster), or native")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    loops = [load(p, k).run_fast for k, p in enumerate(a.engines)]
    with engine.paused_gc():
        cl = built_cluster(_parse(a.config))
        times: list[list[float]] = [[] for _ in loops]
        digests = [""] * len(loops)
        order = list(range(len(loops)))
        for rnd in range(a.rounds):
            turn = order[rnd % len(order):] + order[:rnd % len(order)]
            for k in (turn if rnd % 2 == 0 else turn[::-1]):
                cl.clear_times()
                t = time.process_time()
                loops[k](cl)
                times[k].append(time.process_time() - t)
                if rnd == 0:
                    digests[k] = digest(cl)
    for k, path in enumerate(a.engines):
        ratio = statistics.median(x / y for x, y in zip(times[k], times[0], strict=True))
        print(f"{path}: op times {digests[k]}, median {statistics.median(times[k]):.2f} s, "
              f"min {min(times[k]):.2f} s, median ratio to the first {ratio:.3f}")
    if len(set(digests)) > 1:
        raise SystemExit("the versions simulate different op times")


if __name__ == "__main__":
    main()
