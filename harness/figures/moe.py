"""Figure 9: the MoE what-if (experiments/moe.toml): per model, training-step and optimizer time vs GPUs
for AdamW / naive Muon / DMuon on each cluster file, labelled with the cluster's source (datasheet or
measured) and the cost table that priced NS.
"""

from __future__ import annotations

import re

from .common import STRATEGY_COLORS, STRATEGY_LABELS, caption, log2_axis, plt, profile_caption

STRATEGIES = ("adamw", "naive", "dmuon")
STYLES = ("-", "--", ":", "-.")


def cluster_label(df, cluster: str) -> str:
    """'h100-ndr (datasheet)': the cluster file's source, read from the profile description the simulator
    wrote ('cluster <name> (<source>): ...'); the roofline note where NS was priced from datasheet peaks."""
    sub = df[df["cluster"] == cluster]
    desc = str(sub["profile_description"].iloc[0]) if "profile_description" in sub and len(sub) else ""
    m = re.search(r"cluster \S+ \((datasheet|measured)\)", desc)
    source = m.group(1) if m else "source not recorded"
    cost = str(sub["cost_source"].iloc[0]) if "cost_source" in sub and len(sub) else ""
    return f"{cluster} ({source}" + (", NS: datasheet roofline" if "roofline" in cost else "") + ")"


def moe(df):
    pyplot = plt()
    models = list(dict.fromkeys(df["workload"]))
    clusters = list(dict.fromkeys(df["cluster"]))
    fig, axes = pyplot.subplots(2, len(models), figsize=(4.2 * len(models), 7.5), squeeze=False)
    for j, model in enumerate(models):
        d0 = df[df["workload"] == model]
        for row, (col, ylabel) in enumerate((("step_s", "training step time (s, log)"),
                                             ("optimizer_s", "optimizer step time (s, log)"))):
            ax = axes[row, j]
            for ci, cl in enumerate(clusters):
                for s in STRATEGIES:
                    d = d0[(d0["cluster"] == cl) & (d0["strategy"] == s)].sort_values("gpus")
                    if not len(d):
                        continue
                    ax.plot(d["gpus"], d[col], STYLES[ci % len(STYLES)], marker="o", ms=3.5,
                            color=STRATEGY_COLORS[s],
                            label=f"{STRATEGY_LABELS[s].split(' (')[0]}, {cluster_label(df, cl)}")
            log2_axis(ax, d0["gpus"].unique(), "GPUs")
            ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}: {'step' if row == 0 else 'optimizer'}", fontsize=9)
            if j == 0 and row == 0:
                ax.legend(fontsize=6)
    r = df.iloc[0]
    fig.suptitle(f"MoE what-if: seq {r['seq_len']}, micro-batch {r['micro_batch']} per GPU, {r['layout']}, "
                 "experts FSDP-sharded like dense matrices (no expert parallelism)", y=1.0)
    fig.tight_layout()
    caption(fig, f"{profile_caption(df)}. Clusters: " + "; ".join(cluster_label(df, c) for c in clusters)
            + f". DMuon balancer: {r['balancer']}, NS method {r['ns_method']}.")
    return fig
