"""Figures of the `paper` experiment: (1) optimizer-step time per workload and GPU count, (2) step time,
speedup over naive and overhead over AdamW, (6) a simulated timeline of one step per strategy (Gantt from
the saved Chrome traces). Plus `headline(df)`: the ranges the paper's abstract quotes.
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import (
    STRATEGY_COLORS,
    STRATEGY_LABELS,
    WALL_WM_NOTE,
    caption,
    fmt_ms,
    log2_axis,
    plt,
    profile_caption,
)

STRATEGIES = ("adamw", "naive", "dmuon")
OPT_DEF = (
    "optimizer = end of backward to the end of step(), with the gradient reduce-scatter tail counted in "
    "backward as the published tables do"
)


def _workloads(df) -> list[str]:
    return list(dict.fromkeys(df["workload"]))


def _title(w: str) -> str:
    return f"{w} (ASSUMPTION-based model)" if w == "wall-wm" else w


def _settings(df) -> str:
    r = df.iloc[0]
    return (
        f"{r.get('layout')}, seq {r.get('seq_len')}, micro-batch {r.get('micro_batch')}, "
        f"{r.get('gpus_per_node')} GPUs/node; DMuon: balancer {r.get('balancer')}, NS method "
        f"{r.get('ns_method')}"
    )


def _pivot(df, value: str):
    return df.pivot_table(index=["workload", "gpus"], columns="strategy", values=value, aggfunc="first")


def headline(df) -> dict:
    """Ranges over every (workload, gpus): optimizer speedup (both conventions), step speedup, overhead."""
    p = _pivot(df, "optimizer_s")
    pp = _pivot(df, "optimizer_published_s")
    st = _pivot(df, "step_s")
    fb = _pivot(df, "forward_s") + _pivot(df, "backward_s")
    opt = p["naive"] / p["dmuon"]
    optp = pp["naive"] / pp["dmuon"]
    step = st["naive"] / st["dmuon"]
    over = st["dmuon"] / st["adamw"] - 1
    return {
        "optimizer_speedup_min": opt.min(),
        "optimizer_speedup_max": opt.max(),
        "optimizer_speedup_published_min": optp.min(),
        "optimizer_speedup_published_max": optp.max(),
        "step_speedup_min": step.min(),
        "step_speedup_max": step.max(),
        "step_overhead_mean_pct": 100 * over.mean(),
        "step_overhead_max_pct": 100 * over.max(),
        "naive_optimizer_over_fwd_bwd_min": (p["naive"] / fb["naive"]).min(),
        "naive_optimizer_over_fwd_bwd_max": (p["naive"] / fb["naive"]).max(),
        "points": len(opt),
    }


def optimizer_time(df):
    pyplot = plt()
    ws = _workloads(df)
    cols = min(4, len(ws))
    rows = (len(ws) + cols - 1) // cols
    fig, axes = pyplot.subplots(rows, cols, figsize=(3.6 * cols, 3.3 * rows), squeeze=False, sharey=True)
    for ax, w in zip(axes.flat, ws, strict=False):
        sub = df[df["workload"] == w]
        for s in STRATEGIES:
            d = sub[sub["strategy"] == s].sort_values("gpus")
            if len(d):
                ax.plot(
                    d["gpus"],
                    d["optimizer_published_s"] * 1e3,
                    "o-",
                    color=STRATEGY_COLORS[s],
                    label=STRATEGY_LABELS[s],
                    ms=4,
                )
        p = sub.pivot_table(index="gpus", columns="strategy", values="optimizer_published_s", aggfunc="first")
        if {"naive", "dmuon"} <= set(p.columns):
            for g, r in p.iterrows():  # the speedup, written just under the naive curve
                x = r["naive"] / r["dmuon"]
                ax.annotate(
                    f"{x:.0f}x" if x >= 10 else f"{x:.1f}x",
                    (g, r["naive"] * 1e3),
                    textcoords="offset points",
                    xytext=(0, -12),
                    ha="center",
                    fontsize=7,
                    color=STRATEGY_COLORS["dmuon"],
                    fontweight="bold",
                )
        log2_axis(ax, sub["gpus"].unique())
        ax.set_yscale("log")
        ax.set_title(_title(w))
        ax.set_xlabel("GPUs")
    for ax in axes[:, 0]:
        ax.set_ylabel("optimizer step time (ms, log scale)")
    for ax in list(axes.flat)[len(ws) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(
        "Optimizer step time — AdamW vs naive Muon vs DMuon (green numbers: DMuon speedup over naive)", y=1.06
    )
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    caption(
        fig,
        f"{profile_caption(df)}. {_settings(df)}. {OPT_DEF}."
        + (f" {WALL_WM_NOTE}." if "wall-wm" in ws else ""),
    )
    return fig


def step_speedup(df):
    pyplot = plt()
    ws = _workloads(df)
    fig, axes = pyplot.subplots(2, len(ws), figsize=(3.6 * len(ws), 6.0), squeeze=False)
    for k, w in enumerate(ws):
        sub = df[df["workload"] == w]
        p = sub.pivot_table(index="gpus", columns="strategy", values="step_s", aggfunc="first").sort_index()
        xs = list(range(len(p.index)))  # GPU counts as evenly spaced categories (both rows)
        ax, ax2 = axes[0, k], axes[1, k]
        for s in STRATEGIES:
            if s in p.columns:
                ax.plot(xs, p[s].values * 1e3, "o-", color=STRATEGY_COLORS[s], label=STRATEGY_LABELS[s], ms=4)
        ax.set_title(_title(w))
        ax.set_ylim(bottom=0)
        if {"naive", "dmuon"} <= set(p.columns):
            sp = p["naive"] / p["dmuon"]
            bars = ax2.bar(
                xs,
                sp.values,
                color=STRATEGY_COLORS["dmuon"],
                alpha=0.8,
                width=0.6,
                label="step speedup DMuon vs naive",
            )
            for b, v in zip(bars, sp.values, strict=True):
                ax2.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=7)
            ax2.set_ylim(0, max(sp.max() * 1.25, 1.2))
        if {"adamw", "dmuon"} <= set(p.columns):
            ov = 100 * (p["dmuon"] / p["adamw"] - 1)
            t = ax2.twinx()
            t.plot(
                xs,
                ov.values,
                "s--",
                color=STRATEGY_COLORS["adamw"],
                ms=4,
                label="DMuon overhead over AdamW (%)",
            )
            t.axhline(0, color=STRATEGY_COLORS["adamw"], lw=0.6, ls=":")
            lim = max(5.0, float(abs(ov).max()) * 1.3)
            t.set_ylim(-lim, lim)
            t.grid(False)
            t.tick_params(axis="y", colors=STRATEGY_COLORS["adamw"], labelsize=7)
            if k == len(ws) - 1:
                t.set_ylabel("DMuon step overhead over AdamW (%)", color=STRATEGY_COLORS["adamw"])
            if k == 0:
                h1, l1 = ax2.get_legend_handles_labels()
                h2, l2 = t.get_legend_handles_labels()
                ax2.legend(h1 + h2, l1 + l2, loc="lower left", fontsize=6.5, framealpha=0.9)
        for a in (ax, ax2):
            a.set_xticks(xs)
            a.set_xticklabels([str(g) for g in p.index])
        ax2.set_xlabel("GPUs")
    axes[0, 0].set_ylabel("training step time (ms)")
    axes[1, 0].set_ylabel("step speedup over naive (x)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle("Training step time, DMuon speedup over naive Muon, and overhead over AdamW", y=1.06)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1.02), ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    caption(
        fig,
        f"{profile_caption(df)}. {_settings(df)}. Step = forward + backward + optimizer, steady state."
        + (f" {WALL_WM_NOTE}." if "wall-wm" in ws else ""),
    )
    return fig


# ---- timeline --------------------------------------------------------------------------------------
PHASE_COLORS = {"fwd": "#4c72b0", "bwd": "#dd8452", "opt": "#55a868", "pub": "#8172b3"}
PHASE_LABELS = {"fwd": "forward", "bwd": "backward", "opt": "optimizer", "pub": "publication (overlapped)"}


def load_trace(path: Path) -> tuple[list[dict], dict[int, str], dict]:
    doc = json.loads(Path(path).read_text())
    names = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e["tid"]] = e["args"]["name"]
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"], names, doc.get("otherData", {})


def timeline(df, results_dir: Path, max_ranks: int = 8):
    pyplot = plt()
    from dmuon.errors import InputError

    if "trace_file" not in df.columns or df["trace_file"].isna().all():
        raise InputError("the results have no trace_file column: add a [[trace]] point to the experiment")
    rows = df[df["trace_file"].notna()]
    first = rows.iloc[0]
    rows = rows[(rows["workload"] == first["workload"]) & (rows["gpus"] == first["gpus"])]
    rows = rows.sort_values("strategy", key=lambda s: s.map({k: i for i, k in enumerate(STRATEGIES)}))
    fig, axes = pyplot.subplots(
        len(rows), 1, figsize=(12, 1.2 + 1.45 * len(rows)), squeeze=False, sharex=True
    )
    t_end = 0.0
    for ax, (_, r) in zip(axes[:, 0], rows.iterrows(), strict=True):
        events, names, meta = load_trace(Path(results_dir) / r["trace_file"])
        t0 = min(e["ts"] for e in events)
        tracks = sorted({e["tid"] for e in events})
        tracks = [t for t in tracks if int(names.get(t, "rank 0").split()[1]) < max_ranks]
        ypos = {t: i for i, t in enumerate(tracks)}
        bars: dict[tuple, list] = {}  # one collection per (track, phase): thousands of events draw in ~1 s
        for e in events:
            if e["tid"] not in ypos:
                continue
            start, dur = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            bars.setdefault((e["tid"], e.get("cat")), []).append((start, max(dur, 1e-3)))
            t_end = max(t_end, start + dur)
        for (tid, cat), spans in bars.items():
            ax.broken_barh(
                spans, (ypos[tid] - 0.4, 0.8), facecolors=PHASE_COLORS.get(cat, "#999999"), linewidth=0
            )
        ax.set_yticks(range(len(tracks)))
        ax.set_yticklabels([names.get(t, str(t)).replace("rank ", "r") for t in tracks], fontsize=6)
        ax.invert_yaxis()
        ax.set_title(
            f"{STRATEGY_LABELS[r['strategy']]}: step {fmt_ms(r['step_s'])} ms, optimizer "
            f"{fmt_ms(r['optimizer_s'])} ms",
            loc="left",
        )
        ax.grid(axis="y", alpha=0)
    for ph, c in PHASE_COLORS.items():
        axes[0, 0].bar(0, 0, color=c, label=PHASE_LABELS[ph])
    axes[0, 0].legend(loc="upper right", ncol=4, fontsize=7)
    axes[-1, 0].set_xlabel("time since the step began (ms)")
    axes[-1, 0].set_xlim(0, t_end * 1.01)
    fig.suptitle(
        f"Simulated timeline of one training step: {_title(first['workload'])} on {first['gpus']} GPUs "
        f"(compute and communication stream per rank)",
        y=1.0,
    )
    fig.tight_layout()
    caption(
        fig,
        f"{profile_caption(rows)}. Second simulated step (steady state) from the simulator's trace events; "
        f"open the JSON files in Perfetto for details.",
    )
    return fig
