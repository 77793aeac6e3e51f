"""Digest of simulated op times for a fixed set of configurations, to show a simulator speed change keeps
every number: `python -m scripts.sim_digest --out a.json` before and after, then `--compare a.json b.json`.

Per configuration: a sha256 over every simulated op's (rank, stream, name, start, end, slowed_s) and every
collective's (name, start, end), and one over every SimResult field (repr of floats: bit for bit). The op
digest covers only the simulated ranks (representative ranks), so a change of which ranks are simulated
changes it while the results stay equal; the result digest is the one that must never move.
Options: --quick (the small set only), --only SUBSTRING (configurations whose label contains it)."""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from dmuon.io import atomic_write_text
from simulator.api import SimConfig, run
from simulator.engine.engine import paused_gc

WORKLOADS = ("qwen2.5-7b", "pi0", "wall-oss", "wall-wm")


def configs(quick: bool) -> list[tuple[str, dict]]:
    out = []
    gpus = (8, 64, 256) if quick else (8, 64, 256, 1024)
    for w in WORKLOADS:
        for g in gpus:
            for lay in ("fsdp-keep", "hsdp-free"):
                for s in ("adamw", "naive", "dmuon"):
                    out.append((f"{w}/{g}/{lay}/{s}", dict(workload=w, gpus=g, layout=lay, strategy=s)))
    out += [
        ("qwen2.5-7b/64/jitter", dict(workload="qwen2.5-7b", gpus=64, jitter=0.05)),
        ("qwen2.5-7b/64/split8", dict(workload="qwen2.5-7b", gpus=64, max_split=8)),
        ("pi0/256/hsdp-free/split8", dict(workload="pi0", gpus=256, layout="hsdp-free", max_split=8)),
        ("qwen2.5-1.5b/8/cpu/dmuon", dict(workload="qwen2.5-1.5b", gpus=8, gpu="cpu")),
        ("qwen2.5-1.5b/8/cpu/naive", dict(workload="qwen2.5-1.5b", gpus=8, gpu="cpu", strategy="naive")),
        ("qwen2.5-7b/64/fsdp-free", dict(workload="qwen2.5-7b", gpus=64, layout="fsdp-free")),
        ("qwen2.5-7b/64/sharded", dict(workload="qwen2.5-7b", gpus=64, layout="sharded")),
        ("qwen2.5-7b/64/ddp", dict(workload="qwen2.5-7b", gpus=64, layout="ddp")),
        ("qwen3-30b-a3b/64/ep8", dict(model="qwen3-30b-a3b", gpus=64, ep=8)),
        ("qwen3-30b-a3b/128/ep16/free", dict(model="qwen3-30b-a3b", gpus=128, ep=16, layout="fsdp-free")),
    ]
    # EP on ddp and sharded (adamw / naive on sharded run as fsdp-keep); adamw / naive on fsdp-keep and
    # hsdp-keep (their per-rank optimizer elements and tensors: simulator.programs.step_ep._rank_muon)
    for lay, strategies in (("ddp", ("adamw", "naive", "dmuon")), ("sharded", ("dmuon",)),
                            ("fsdp-keep", ("adamw", "naive")), ("hsdp-keep", ("adamw", "naive", "dmuon"))):
        out += [(f"qwen3-30b-a3b/64/ep8/{lay}/{s}", dict(model="qwen3-30b-a3b", gpus=64, ep=8, layout=lay,
                                                          strategy=s)) for s in strategies]
    if not quick:
        out += [("kimi-k2-like/1024/ep64", dict(model="kimi-k2-like", gpus=1024, ep=64)),
                ("deepseek-v3-like/1024/ep64", dict(model="deepseek-v3-like", gpus=1024, ep=64))]
    return out


def digest(kw: dict) -> dict:
    with paused_gc():
        res, built = run(SimConfig(**kw), all_ranks=False)
        h = hashlib.sha256()
        for (rank, stream), ops in sorted(built.cluster.queues.items()):
            for o in ops:
                h.update(f"{rank}|{stream}|{o.name}|{o.start!r}|{o.end!r}|{o.slowed_s!r}\n".encode())
        for c in built.cluster.collectives:
            h.update(f"{c.name}|{c.start!r}|{c.end!r}\n".encode())
        d = res.to_dict()
        d.pop("provenance", None)  # names files and versions, not simulated numbers
        r = hashlib.sha256(repr(sorted(d.items())).encode()).hexdigest()
        return {"ops": h.hexdigest(), "result": r, "step_s": res.step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--compare", nargs=2)
    a = ap.parse_args()
    if a.compare:
        x, y = (json.load(open(p)) for p in a.compare)
        bad = 0
        for k in sorted(set(x) & set(y)):
            for f in ("result", "ops"):
                if x[k][f] != y[k][f]:
                    bad += f == "result"
                    print(f"{k}: {f} differs ({x[k]['step_s']!r} vs {y[k]['step_s']!r})")
        print(f"{len(set(x) & set(y))} common configurations, {bad} results differ")
        raise SystemExit(1 if bad else 0)
    out = {}
    for label, kw in configs(a.quick):
        if a.only not in label:
            continue
        t0 = time.process_time()
        out[label] = digest(kw)
        print(f"{label}: {time.process_time() - t0:.2f} s cpu", flush=True)
    if a.out:
        atomic_write_text(a.out, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
