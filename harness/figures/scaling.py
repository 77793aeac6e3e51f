"""Figure 3: the scaling what-if (experiments/scaling.toml): throughput vs GPUs on A800 and H200 nodes,
per-GPU throughput relative to the smallest run, and step time vs NIC bandwidth and GPUs per node.
"""

from __future__ import annotations

from .common import STRATEGY_COLORS, STRATEGY_LABELS, caption, plt, profile_caption

STRATEGIES = ("adamw", "naive", "dmuon")
DEVICE_STYLE = {"a800": "-", "h200": "--", "h100": ":"}


def _grid(df, name: str):
    return df[df["grid"] == name] if "grid" in df.columns else df


def _device_label(df, gpu: str) -> str:
    sub = df[df["gpu"] == gpu]
    cost = str(sub["cost_source"].iloc[0]) if "cost_source" in sub and len(sub) else ""
    return f"{gpu.upper()}" + (" (roofline/borrowed profile)" if "roofline" in cost else "")


def scaling(df):
    pyplot = plt()
    fig, axes = pyplot.subplots(2, 2, figsize=(12, 8.5))
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
        a.set_xscale("log", base=2)
        gp = sorted(g["gpus"].unique())
        a.set_xticks(gp)
        a.set_xticklabels([str(x) for x in gp])
        a.set_xlabel("GPUs")
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
            panel.set_xscale("log", base=2)
            xs = sorted(d0[col].unique())
            panel.set_xticks(xs)
            panel.set_xticklabels([f"{x:g}" for x in xs])
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
        f"{df['balancer'].iloc[0]}.",
    )
    return fig
