"""What-if: DMuon's step overhead over AdamW for Llama 3.1 70B and 405B at their best TP / PP layout on
1,024-16,384 H100s, beside naive Muon, with error bands (docs/simulator.md, "Tensor and pipeline
parallelism").

    PYTHONPATH=. python scripts/tp_pp_whatif.py [--gpus 1024,4096,16384] [--models 70b,405b] [--no-bands]
                                                [--json out.json]

Setting (stated, not measured): H100 profile (simulator/profiles/h100.toml), tp = 8 (one node), global batch
2,048 sequences of 8,192 tokens (16M tokens: Llama 3 405B's final batch, Dubey et al. 2024,
arXiv:2407.21783, Sec. 3.4.1) for both models, micro-batch 1 sequence, microbatches = 2048 / dp, FSDP
over the data-parallel ranks. Grid: pp in 1, 2, 4, 8, 16 and vpp in 1, 2 wherever simulator.parallel
accepts them (pp x vpp dividing the layers or layers + 2, microbatches >= pp, a multiple of pp when
interleaved), data-parallel layout fsdp-keep or fsdp-free, each with the least recomputation (none,
selective, full) with which that strategy fits the GPU's memory by simulator.api.memory_of (for DMuon
also its largest NS batch, max_batch 8, 2 or 1: the NS workspace of a batch of whole 405B matrices is
tens of GB; a configuration where nothing fits is left out). Each strategy's best = its shortest
fitting step; overhead = its best step / AdamW's best step - 1 (best against best).
Bands: simulator.bands.sensitivity of each strategy at its best configuration, each uncertain input at its low
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
from simulator.api import SimConfig, memory_of, simulate  # noqa: E402
from simulator.bands import sensitivity  # noqa: E402
from simulator.hardware import load_profile  # noqa: E402

SEQUENCES, SEQ_LEN = 2048, 8192
MODELS = {"70b": "llama-3.1-70b", "405b": "llama-3.1-405b"}
STRATEGIES = ("adamw", "dmuon", "naive")
RECOMPUTE = ("none", "selective", "full")
DP_LAYOUTS = ("fsdp-keep", "fsdp-free")
DMUON_MAX_BATCH = (8, 2, 1)  # DMuon's largest NS batch (SimConfig.max_batch): smaller where 8 does not fit


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
    """(dmuon overhead, its low, its high, naive overhead ...) over the uncertain inputs (module
    docstring)."""
    base, rows = {}, {}
    for s, cfg in cfgs.items():
        base[s], rs = sensitivity(cfg)
        rows[s] = {r["input"]: r for r in rs}
    out = []
    for s in ("dmuon", "naive"):
        o = base[s] / base["adamw"] - 1
        ends = [(rows[s][i][e] / rows["adamw"][i][e] - 1) for i in rows["adamw"]
                for e in ("at_low", "at_high")]
        pairs = list(zip(ends[::2], ends[1::2], strict=True))
        down = math.sqrt(sum(max(0.0, o - min(p)) ** 2 for p in pairs))
        up = math.sqrt(sum(max(0.0, max(p) - o) ** 2 for p in pairs))
        out += [o, o - down, o + up]
    return tuple(out)


def best_fitting(model: str, gpus: int, profile, strategy: str, lay: dict):
    """(config, SimResult) of `strategy` on layout `lay`: per data-parallel layout (fsdp-keep, fsdp-free)
    the least recomputation with which it fits (simulator.memory), the faster of the two; None if none
    fits."""
    out = None
    for dp_layout in DP_LAYOUTS:
        cfg = None
        for rc, mb in ((r, b) for r in RECOMPUTE for b in (DMUON_MAX_BATCH if strategy == "dmuon" else (8,))):
            c = replace(config(model, gpus, profile, strategy, lay), layout=dp_layout, recompute=rc,
                        max_batch=mb)
            if memory_of(c).fits:
                cfg = c
                break
        if cfg is not None:
            r = simulate(cfg)
            if out is None or r.step_s < out[1].step_s:
                out = (cfg, r)
    return out


def _label(cfg) -> str:
    return (f"pp {cfg.pp}" + (f" vpp {cfg.vpp}" if cfg.vpp > 1 else "") + f", m {cfg.microbatches}, "
            f"{cfg.layout}" + (f", recompute {cfg.recompute}" if cfg.recompute != "none" else "")
            + (f", max_batch {cfg.max_batch}" if cfg.max_batch != SimConfig.max_batch else ""))


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
            best: dict = {}
            tried = 0
            for lay in layouts(gpus):
                try:
                    for s in STRATEGIES:
                        got = best_fitting(model, gpus, profile, s, lay)
                        if got is not None and (s not in best or got[1].step_s < best[s][1].step_s):
                            best[s] = got
                    tried += 1
                except InputError:
                    continue
            if "adamw" not in best:
                print(f"{model} {gpus:>6} GPUs: no layout of the grid fits for AdamW", flush=True)
                continue
            ad = best["adamw"][1].step_s
            row = {"model": model, "gpus": gpus, "layouts_tried": tried}
            for s in STRATEGIES:
                if s in best:
                    cfg, r = best[s]
                    row[s] = {"layout": _label(cfg), "step_s": r.step_s, "overhead": r.step_s / ad - 1,
                              "peak_mem_gib": r.peak_mem_gib}
                else:
                    row[s] = None
            if not a.no_bands and all(best.get(s) for s in STRATEGIES):
                d, dlo, dhi, n, nlo, nhi = overhead_band({s: best[s][0] for s in STRATEGIES})
                row["dmuon"]["band"], row["naive"]["band"] = [dlo, dhi], [nlo, nhi]
            rows.append(row)
            parts = []
            for s in STRATEGIES:
                x = row[s]
                if x is None:
                    parts.append(f"{s}: no fitting layout")
                    continue
                band = f" [{x['band'][0]:+.1%} .. {x['band'][1]:+.1%}]" if "band" in x else ""
                what = f"{x['step_s']:.2f} s" if s == "adamw" else f"{x['overhead']:+.1%}{band}"
                parts.append(f"{s} {what} ({x['layout']}, {x['peak_mem_gib']:.0f} GiB)")
            print(f"{model} {gpus:>6} GPUs, {tried} layouts: " + "; ".join(parts), flush=True)
    if a.json:
        from dmuon.io import atomic_write_text

        atomic_write_text(a.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
