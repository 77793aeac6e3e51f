"""What-if: DMuon's step overhead over AdamW for Llama 3.1 70B and 405B at their best TP / PP layout on
1,024-16,384 H100s, beside naive Muon, with error bands (docs/simulator.md, "Tensor and pipeline
parallelism").

    PYTHONPATH=. python scripts/tp_pp_whatif.py [--gpus 1024,4096,16384] [--models 70b,405b] [--no-bands]
                                                [--json out.json]

Setting (stated, not measured): H100 profile (simulator/profiles/h100.toml), tp = 8 (one node), global batch
2,048 sequences of 8,192 tokens (16M tokens: Llama 3 405B's final batch, Dubey et al. 2024,
arXiv:2407.21783, Sec. 3.4.1) for both models, micro-batch 1 sequence, microbatches = 2048 / dp, FSDP
(fsdp-keep) over the data-parallel ranks, no recomputation. Layout grid: pp in 1, 2, 4, 8, 16 and vpp in 1, 2
wherever simulator.parallel accepts them (pp x vpp dividing the layers or layers + 2, microbatches >= pp,
a multiple of pp when interleaved). Memory is not checked here (not every layout of the grid fits 80 GB).
"Best layout" = the layout of the shortest step for each strategy; the overhead is reported both at
AdamW's best layout and best-against-best.
Bands: simulator.bands.sensitivity of each strategy at AdamW's best layout, each uncertain input at its low
and high end; the overhead (dmuon / adamw - 1) is recomputed at each end and the deviations combined in
quadrature, as simulator.bands combines a step's. The h100 profile has no [uncertainty] table of its own:
the a800 profile's ranges are borrowed (inter_efficiency, curve_scale, nccl_channels, overlap_slowdown, and
fwd / bwd_tflops as relative fit residuals; the NIC's absolute A800 range is left out: the H100 NICs are
the datasheet's 8 x 400 Gb/s), each source saying so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dmuon.errors import InputError  # noqa: E402
from simulator.api import SimConfig, simulate  # noqa: E402
from simulator.bands import sensitivity  # noqa: E402
from simulator.hardware import load_profile  # noqa: E402

SEQUENCES, SEQ_LEN = 2048, 8192
MODELS = {"70b": "llama-3.1-70b", "405b": "llama-3.1-405b"}
STRATEGIES = ("adamw", "dmuon", "naive")


def h100_with_bands():
    """The h100 profile with the a800 profile's uncertainty ranges borrowed (module docstring)."""
    h100, a800 = load_profile("h100"), load_profile("a800")
    borrowed = {k: {**v, "source": f"borrowed from the a800 profile's [uncertainty]: {v['source']}"}
                for k, v in a800.uncertainty.items() if k != "nic_gbps_per_node"}
    return replace(h100, uncertainty=borrowed)


def layouts(gpus: int):
    for pp in (1, 2, 4, 8, 16):
        for vpp in ((1, 2) if pp > 1 else (1,)):
            dp, rem = divmod(gpus, 8 * pp)
            if rem or SEQUENCES % dp:
                continue
            yield {"tp": 8, "pp": pp, "vpp": vpp, "microbatches": SEQUENCES // dp}


def config(model: str, gpus: int, profile, strategy: str, lay: dict) -> SimConfig:
    return SimConfig(model=model, gpus=gpus, gpu=profile, strategy=strategy, seq_len=SEQ_LEN, micro_batch=1,
                     **lay)


def overhead_band(cfgs: dict) -> tuple[float, float, float, float]:
    """(dmuon overhead, its low, its high, naive overhead ...) over the uncertain inputs (module docstring)."""
    base, rows = {}, {}
    for s, cfg in cfgs.items():
        base[s], rs = sensitivity(cfg)
        rows[s] = {r["input"]: r for r in rs}
    out = []
    for s in ("dmuon", "naive"):
        o = base[s] / base["adamw"] - 1
        ends = [(rows[s][i][e] / rows["adamw"][i][e] - 1) for i in rows["adamw"] for e in ("at_low", "at_high")]
        pairs = list(zip(ends[::2], ends[1::2], strict=True))
        down = math.sqrt(sum(max(0.0, o - min(p)) ** 2 for p in pairs))
        up = math.sqrt(sum(max(0.0, max(p) - o) ** 2 for p in pairs))
        out += [o, o - down, o + up]
    return tuple(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="1024,4096,16384")
    ap.add_argument("--models", default="70b,405b")
    ap.add_argument("--no-bands", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    profile = h100_with_bands()
    rows = []
    for key in a.models.split(","):
        model = MODELS[key]
        for gpus in (int(g) for g in a.gpus.split(",")):
            steps: dict = {}
            for lay in layouts(gpus):
                try:
                    steps[tuple(lay.items())] = {s: simulate(config(model, gpus, profile, s, lay)).step_s
                                                 for s in STRATEGIES}
                except InputError:
                    continue
            best = {s: min(steps, key=lambda k, s=s: steps[k][s]) for s in STRATEGIES}
            at = steps[best["adamw"]]
            row = {"model": model, "gpus": gpus, "layouts_tried": len(steps),
                   "adamw_best": dict(best["adamw"]), "adamw_step_s": at["adamw"],
                   "dmuon_at_adamw_best": at["dmuon"] / at["adamw"] - 1,
                   "naive_at_adamw_best": at["naive"] / at["adamw"] - 1,
                   "dmuon_best": dict(best["dmuon"]), "dmuon_best_vs_best": steps[best["dmuon"]]["dmuon"]
                   / at["adamw"] - 1,
                   "naive_best": dict(best["naive"]), "naive_best_vs_best": steps[best["naive"]]["naive"]
                   / at["adamw"] - 1}
            if not a.no_bands:
                d, dlo, dhi, n, nlo, nhi = overhead_band(
                    {s: config(model, gpus, profile, s, dict(best["adamw"])) for s in STRATEGIES})
                row.update(dmuon_band=[dlo, dhi], naive_band=[nlo, nhi])
            rows.append(row)
            lay = row["adamw_best"]
            band = (f" [{row['dmuon_band'][0]:+.1%} .. {row['dmuon_band'][1]:+.1%}]" if "dmuon_band" in row
                    else "")
            nband = (f" [{row['naive_band'][0]:+.1%} .. {row['naive_band'][1]:+.1%}]" if "naive_band" in row
                     else "")
            print(f"{model} {gpus:>6} GPUs: AdamW best tp{lay['tp']} pp{lay['pp']} vpp{lay['vpp']} "
                  f"m{lay['microbatches']} {row['adamw_step_s']:.2f} s; there DMuon "
                  f"{row['dmuon_at_adamw_best']:+.1%}{band}, naive {row['naive_at_adamw_best']:+.1%}{nband}; "
                  f"best vs best: DMuon {row['dmuon_best_vs_best']:+.1%} (pp{row['dmuon_best']['pp']} "
                  f"vpp{row['dmuon_best']['vpp']}), naive {row['naive_best_vs_best']:+.1%} "
                  f"(pp{row['naive_best']['pp']} vpp{row['naive_best']['vpp']}); {len(steps)} layouts",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
