"""DMuon's step overhead over AdamW with our schedule and the public implementation's (`system="published"`),
side by side per layout, and what each mechanism of the published schedule costs there: the overhead with
every mechanism on less the overhead with that one off (simulator.programs.step_published.MECHANISMS; positive:
the public code pays it, i.e. our schedule's change saves it). Then the public README's 128-GPU VLA rows
(experiments/reference/published_128gpu_vla.csv) against both systems, in points.

    python -m scripts.published_vs_ours                      # pi0, wall-oss x 4 layouts, 128 A800s
    python -m scripts.published_vs_ours --workload qwen2.5-7b --gpus 64 --layouts fsdp-keep,hsdp-free
    python -m scripts.published_vs_ours --rows-only          # the public rows only
    python -m scripts.published_vs_ours --paper-8gpu         # the paper's 8 x A800 DMuon rows (reported.csv)
    python -m scripts.published_vs_ours --breakdown results/published/breakdown.csv   # figure 12's data
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from simulator.api import SimConfig
from simulator.programs.step_published import MECHANISMS
from simulator.published_compare import compare_systems

LAYOUTS = ("fsdp-keep", "fsdp-free", "hsdp-keep", "hsdp-free")  # FSDP-Z2, FSDP-Z3, HSDP-Z2, HSDP-Z3
PUBLIC_NAME = {"fsdp-keep": "FSDP-Z2", "fsdp-free": "FSDP-Z3", "hsdp-keep": "HSDP-Z2", "hsdp-free": "HSDP-Z3"}
ROWS = Path(__file__).resolve().parents[1] / "experiments" / "reference" / "published_128gpu_vla.csv"


def overheads(workload: str, gpus: int, layout: str, **kw) -> dict:
    """{"ours": %, "published": %, mechanism: points it costs} of DMuon over AdamW for one layout."""
    c = compare_systems(SimConfig(workload=workload, gpus=gpus, layout=layout, **kw))
    return {"ours": c.overhead_pct("ours"), "published": c.overhead_pct("published"), **c.points()}


PHASES = ("forward_s", "backward_s", "optimizer_s")
BREAKDOWN_WORKLOADS = ("qwen2.5-1.5b", "llama3.2-3b", "qwen2.5-7b", "llama3.1-8b", "pi0", "wall-oss", "wall-wm")


def breakdown(workload: str, gpus: int, layout: str) -> list[dict]:
    """DMuon's overhead over AdamW with `system="published"` split into parts (points of the AdamW step):
    our schedule's overhead by phase (DMuon's forward / backward / optimizer less AdamW's), then what
    each published mechanism adds on top (published less published with it off), and the interaction
    left over (published less the sum of the parts); plus the model's traits that set them."""
    c = compare_systems(SimConfig(workload=workload, gpus=gpus, layout=layout))
    a, o = c.adamw, c.ours
    pts = {f"ours {ph[:-2]}": (getattr(o, ph) - getattr(a, ph)) / a.step_s * 100 for ph in PHASES}
    pts.update(c.points())
    total = c.overhead_pct("published")
    pts["interaction"] = total - sum(pts.values())
    traits = _traits(workload)
    return [dict(workload=workload, gpus=gpus, layout=layout, part=k, points=v, published_pct=total,
                 ours_pct=(o.step_s / a.step_s - 1) * 100, **traits) for k, v in pts.items()]


def _traits(workload: str) -> dict:
    """The model's traits the breakdown is read against: AdamW (embedding, head, norms) share of the
    parameters, layers, Muon matrices per layer, and matrices under the public code's 5 M-element merge
    threshold (`SMALL_PARAM_THRESHOLD`)."""
    from simulator.models.workload import resolve_workload

    w = resolve_workload(workload, None, False)
    muon = [p for p in w.params if p.optimizer == "muon"]
    total = sum(p.numel for p in w.params)
    layers = len({p.layer for p in muon}) or 1
    return dict(adamw_share=sum(p.numel for p in w.params if p.optimizer != "muon") / total,
                layers=w.n_layers, muon_per_layer=len(muon) / layers,
                small_share=sum(1 for p in muon if p.numel < 5_000_000) / max(len(muon), 1))


def public_rows() -> list[dict]:
    with open(ROWS, newline="") as f:
        return list(csv.DictReader(f))


def paper_8gpu() -> None:
    """The paper's own 8 x A800 table (reported.csv a800_8gpu_llm: DMuon and FSDP2+AdamW steps, seq 2048 x
    micro-batch 2, FSDP2 ZeRO-2-like = fsdp-keep) against DMuon over AdamW under both schedules, with the
    published mechanisms that cost more than half a point there."""
    from simulator.validation.reference import LLM_GPUS, LLM_MICRO_BATCH, LLM_SEQ_LEN, llm_rows

    steps = {(r.workload, r.method): r.step_s for r in llm_rows()}
    errs = {"ours": [], "published": []}
    print(f"paper's {LLM_GPUS} x A800 rows (reported.csv): DMuon over FSDP2+AdamW, %")
    for w in sorted({w for w, m in steps if m == "DMuon"}):
        paper = (steps[(w, "DMuon")] / steps[(w, "FSDP2+AdamW")] - 1) * 100
        o = overheads(w, LLM_GPUS, "fsdp-keep", seq_len=LLM_SEQ_LEN, micro_batch=LLM_MICRO_BATCH)
        for k in errs:
            errs[k].append(o[k] - paper)
        big = ", ".join(f"{m} {o[m]:+.2f}" for m in MECHANISMS if abs(o[m]) > 0.5)
        print(f"{w:12} paper {paper:+6.2f}  ours {o['ours']:+6.2f} ({o['ours'] - paper:+5.2f})  published "
              f"{o['published']:+6.2f} ({o['published'] - paper:+5.2f})  [{big}]", flush=True)
    print_errors(errs)


def print_errors(errs: dict) -> None:
    """Mean and largest |error| in points per system."""
    for k, v in errs.items():
        print(f"mean |error| {k}: {sum(abs(x) for x in v) / len(v):.2f} points, max {max(abs(x) for x in v):.2f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="pi0,wall-oss")
    ap.add_argument("--gpus", type=int, default=128)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--rows-only", action="store_true")
    ap.add_argument("--paper-8gpu", action="store_true", help="the paper's 8 x A800 DMuon rows instead")
    ap.add_argument("--breakdown", metavar="CSV", help="write the per-model breakdown (figure 12, "
                    "`harness figures published`) of BREAKDOWN_WORKLOADS x fsdp-keep / hsdp-free to CSV")
    a = ap.parse_args(argv)
    if a.paper_8gpu:
        paper_8gpu()
        return
    if a.breakdown:
        rows = [r for w in BREAKDOWN_WORKLOADS for lay in ("fsdp-keep", "hsdp-free")
                for r in breakdown(w, a.gpus, lay)]
        from dmuon.io import atomic_path

        with atomic_path(a.breakdown) as tmp, open(tmp, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
        print(f"wrote {len(rows)} rows to {a.breakdown}")
        return
    if not a.rows_only:
        names = list(MECHANISMS)
        print(f"DMuon over AdamW, % of the AdamW step ({a.gpus} GPUs, a800, seq 2048 x micro-batch 2); per "
              "mechanism: points the published schedule pays for it")
        print(f"{'workload':12} {'layout':16} {'ours':>7} {'publ.':>7} " + " ".join(f"{m[:11]:>11}" for m in names))
        for w in a.workload.split(","):
            for lay in a.layouts.split(","):
                o = overheads(w, a.gpus, lay)
                print(f"{w:12} {lay + ' ' + PUBLIC_NAME.get(lay, ''):16} {o['ours']:+7.2f} {o['published']:+7.2f} "
                      + " ".join(f"{o[m]:+11.2f}" for m in names), flush=True)
    print("\npublic 128-GPU VLA rows (README): DMuon over AdamW, points")
    errs = {"ours": [], "published": []}
    for row in public_rows():
        o = overheads(row["workload"], int(row["gpus"]), row["layout"])
        pub = float(row["delta_pct"])
        for k in errs:
            errs[k].append(o[k] - pub)
        print(f"{row['workload']:10} {row['public_layout']:8} public {pub:+5.1f}  ours {o['ours']:+6.2f} "
              f"({o['ours'] - pub:+5.2f})  published {o['published']:+6.2f} ({o['published'] - pub:+5.2f})",
              flush=True)
    print_errors(errs)


if __name__ == "__main__":
    main()
