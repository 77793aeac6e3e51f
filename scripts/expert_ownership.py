"""What-if: DMuon's fused MoE experts owned whole (one owner per fused expert parameter, its E or 2E
matrices in one batched NS call: what the runtime runs at ep = 1) against one owner per expert matrix
(`Workload.experts_apart()`, the simulator's per-expert model before transformers 5's fused experts).

    .venv/bin/python scripts/expert_ownership.py [--model experiments/models/qwen3-30b-a3b]
                                                 [--gpus 64,256,1024]

Prints the simulated DMuon step and optimizer phase (a800 profile, fsdp-keep) for both, side by side."""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="experiments/models/qwen3-30b-a3b")
    ap.add_argument("--gpus", default="64,256,1024")
    ap.add_argument("--layout", default="fsdp-keep")
    args = ap.parse_args()
    from simulator.api import SimConfig, simulate
    from simulator.models.hf_config import load_model

    whole = load_model(args.model)
    apart = whole.experts_apart()
    print(f"{'gpus':>6} {'owners':>10} {'step ms':>10} {'optimizer ms':>13}")
    for g in (int(x) for x in args.gpus.split(",")):
        for label, wl in (("whole", whole), ("per matrix", apart)):
            r = simulate(SimConfig(workload=wl, gpus=g, strategy="dmuon", layout=args.layout))
            print(f"{g:>6} {label:>10} {r.step_s * 1e3:>10.1f} {r.optimizer_s * 1e3:>13.1f}")


if __name__ == "__main__":
    main()
