"""Figure 3: the scaling what-if (experiments/scaling.toml): throughput vs GPUs on A800 and H200 nodes,
per-GPU throughput relative to the smallest run, step time vs NIC bandwidth and GPUs per node, and the
'split' grid: DMuon's optimizer time and NS makespan vs GPUs with one owner per batch (max_split 1) and
with owner groups of up to 8 ranks (max_split 8).
"""

from __future__ import annotations

from .common import STRATEGY_COLORS, STRATEGY_LABELS, caption, log2_axis, plt, profile_caption

STRATEGIES = ("adamw", "naive", "dmuon")
DEVICE_STYLE = {"a800": "-", "h200": "--", "h100": ":"}


def _grid(df, name: str):
    return df[df["grid"] == name] if "grid" in df.columns else df


def _device_label(df, gpu: str) -> str:
    """'A800 (NS: measured table)' or 'H200 (roofline/borrowed profile)', from the rows' cost_source."""
    sub = df[df["gpu"] == gpu]
    cost = str(sub["cost_source"].iloc[0]) if "cost_source" in sub and len(sub) else ""
    if not cost or cost == "nan":
        return gpu.upper()
    return gpu.upper() + (" (roofline/borrowed profile)" if "roofline" in cost else " (NS: measured table)")


SPLIT_STYLE = {1: ("-", "o", "one owner per batch"), 8: ("--", "s", "owner groups of up to 8 ranks")}


def split_series(df) -> dict[int, object]:
    """The 'split' grid's DMuon rows per max_split value, sorted by GPUs (empty when the grid is absent)."""
    d0 = _grid(df, "split")
    if "grid" not in df.columns or "max_split" not in d0.columns or not len(d0):
        return {}
    d0 = d0[d0["strategy"] == "dmuon"] if "strategy" in d0.columns else d0
    return {int(k): sub.sort_values("gpus") for k, sub in d0.groupby("max_split", sort=True)}


def _split_panels(df, ax_opt, ax_ns) -> None:
    series = split_series(df)
    if not series:
        ax_opt.set_visible(False)
        ax_ns.set_visible(False)
        return
    for k, d in series.items():
        style, marker, what = SPLIT_STYLE.get(k, (":", "^", f"owner groups of up to {k} ranks"))
        devices = sorted(set(d["gpu"]))
        lab = f"DMuon, max_split {k} ({what}), " + ", ".join(_device_label(df, g) for g in devices)
        ax_opt.plot(d["gpus"], d["optimizer_s"] * 1e3, style, marker=marker, ms=4,
                    color=STRATEGY_COLORS["dmuon"], label=lab)
        if "ns_makespan_s" in d.columns:
            ax_ns.plot(d["gpus"], d["ns_makespan_s"] * 1e3, style, marker=marker, ms=4,
                       color=STRATEGY_COLORS["dmuon"], label=lab)
    gp = sorted({int(g) for d in series.values() for g in d["gpus"]})
    first = next(iter(series.values()))
    where = f"{str(first['gpu'].iloc[0]).upper()}, {first['layout'].iloc[0]}" if "layout" in first else ""
    for a, ylabel, title in (
        (ax_opt, "optimizer time (ms)", f"(e) DMuon optimizer time: split NS or not ({where})"),
        (ax_ns, "NS makespan, slowest rank (ms)", "(f) DMuon NS makespan: split NS or not"),
    ):
        log2_axis(a, gp, "GPUs")
        a.set_ylim(bottom=0)
        a.set_ylabel(ylabel)
        a.set_title(title, fontsize=9)
        a.legend(fontsize=6.5)


def scaling(df):
    pyplot = plt()
    fig, axes = pyplot.subplots(3, 2, figsize=(12, 12.5))
    g = _grid(df, "gpus")
    ax, ax_eff = axes[0, 0], axes[0, 1]
    for gpu in dict.fromkeys(g["gpu"]):
        for s in STRATEGIES:
            d = g[(g["gpu"] == gpu) & (g["strategy"] == s)].sort_values("gpus")
            if not len(d):
                continue
            style = DEVICE_STYLE.get(gpu, "-.")
            lab = f"{STRATEGY_LABELS[s].split(' (')[0]}, {_device_label(df, gpu)}"
            ax.plot(
                d["gpus"], d["tokens_per_s"], style, marker="o", ms=3.5, color=STRATEGY_COLORS[s], label=lab
            )
            per_gpu = d["tokens_per_s"] / d["gpus"]
            ax_eff.plot(
                d["gpus"],
                100 * per_gpu / per_gpu.iloc[0],
                style,
                marker="o",
                ms=3.5,
                color=STRATEGY_COLORS[s],
                label=lab,
            )
    for a in (ax, ax_eff):
        log2_axis(a, g["gpus"].unique(), "GPUs")
    ax.set_yscale("log")
    ax.set_ylabel("throughput (tokens/s, log scale)")
    ax.set_title("(a) throughput vs GPUs")
    ax.legend(fontsize=6.5)
    ax_eff.set_ylabel("tokens/s per GPU, % of the smallest run")
    ax_eff.set_title("(b) per-GPU throughput (weak scaling)")
    for panel, name, col, xlabel, xlog in (
        (axes[1, 0], "nic", "nic_gbps", "NIC bandwidth per node (Gbit/s)", True),
        (axes[1, 1], "gpus_per_node", "gpus_per_node", "GPUs per node", True),
    ):
        d0 = _grid(df, name)
        if "grid" not in df.columns or not len(d0):
            panel.set_visible(False)
            continue
        for s in STRATEGIES:
            d = d0[d0["strategy"] == s].sort_values(col)
            panel.plot(
                d[col], d["step_s"] * 1e3, "o-", color=STRATEGY_COLORS[s], label=STRATEGY_LABELS[s], ms=4
            )
        if xlog:
            log2_axis(panel, d0[col].unique(), fmt=lambda x: f"{x:g}")
        panel.set_ylim(bottom=0)
        panel.set_xlabel(xlabel)
        panel.set_ylabel("training step time (ms)")
        r = d0.iloc[0]
        panel.set_title(
            f"({'c' if name == 'nic' else 'd'}) {r['gpu'].upper()}, {int(r['gpus'])} GPUs: "
            + (
                "inter-node bandwidth"
                if name == "nic"
                else "node size (same NIC bandwidth per node, so per GPU it grows as nodes shrink)"
            ),
            fontsize=9,
        )
        panel.legend(fontsize=6.5)
    _split_panels(df, axes[2, 0], axes[2, 1])
    w = df["workload"].iloc[0]
    fig.suptitle(
        f"Scaling what-if: {w}, seq {df['seq_len'].iloc[0]}, micro-batch {df['micro_batch'].iloc[0]} per "
        f"GPU (weak scaling), {df['layout'].iloc[0]}",
        y=1.0,
    )
    fig.tight_layout()
    caption(
        fig,
        f"{profile_caption(df)}. H200: no step or NS kernel measured on an H200 here: compute = the A800 "
        f"fit's fraction of peak x datasheet peak, NS priced by the datasheet roofline. DMuon balancer: "
        f"{df['balancer'].iloc[0]}."
        + (" (e, f): grid 'split', DMuon with max_split 1 vs 8 (split NS only where the plan finds it pays)."
           if split_series(df) else ""),
    )
    return fig
