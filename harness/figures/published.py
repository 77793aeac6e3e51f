"""Figure 12: why DMuon's overhead over AdamW differs between models (issue 28, item 3). For each model and
layout (128 A800s, `system="published"`), the overhead split into parts: our schedule's overhead by phase
(DMuon's forward / backward / optimizer less AdamW's) and what each mechanism of the public
implementation's schedule adds on top (simulator.programs.step_published), with the interaction left over; the
black tick is the total. Drawn from `python -m scripts.published_vs_ours --breakdown CSV`.
"""

from __future__ import annotations

from .common import WALL_WM_NOTE, caption, plt

PART_COLORS = {
    "ours forward": "#4c72b0", "ours backward": "#64b5cd", "ours optimizer": "#8172b3",
    "owner_cost": "#17becf", "ns_per_matrix": "#dd8452", "opt_order": "#937860", "drain": "#da8bc3",
    "flat_exchange": "#c44e52", "param_collectives": "#bcbd22",
    "coalesce": "#55a868", "hsdp_stages": "#ccb974", "master_fp32": "#8c8c8c", "fwd_prefetch": "#e377c2",
    "adamw_unfused": "#17becf", "ns_eager": "#bcbd22",  # simulator.programs.published_host
    "interaction": "#dddddd",
}


def overhead_breakdown(df):
    for col in ("workload", "layout", "part", "points", "published_pct", "adamw_share", "layers"):
        if col not in df.columns:
            raise KeyError(col)
    pyplot = plt()
    layouts = list(dict.fromkeys(df["layout"]))
    models = list(dict.fromkeys(df["workload"]))
    fig, axes = pyplot.subplots(1, len(layouts), figsize=(5.2 * len(layouts), 0.5 * len(models) + 1.8),
                                sharey=True, squeeze=False)
    parts = list(dict.fromkeys(df["part"]))
    for ax, lay in zip(axes[0], layouts, strict=True):
        sub = df[df["layout"] == lay]
        for i, m in enumerate(models):
            rows = sub[sub["workload"] == m].set_index("part")
            pos = neg = 0.0
            for p in parts:
                v = float(rows["points"].get(p, 0.0))
                left = pos if v >= 0 else neg
                ax.barh(i, v, left=left, color=PART_COLORS.get(p, "#444444"), height=0.6,
                        label=p if i == 0 else None)
                pos, neg = (pos + v, neg) if v >= 0 else (pos, neg + v)
            total = float(rows["published_pct"].iloc[0])
            ax.plot([total, total], [i - 0.35, i + 0.35], color="black", lw=2)
        ax.axvline(0, color="black", lw=0.6)
        ax.set_yticks(range(len(models)))
        ax.set_yticklabels([f"{m} (AdamW {100 * float(df[df['workload'] == m]['adamw_share'].iloc[0]):.0f}%, "
                            f"{int(df[df['workload'] == m]['layers'].iloc[0])} layers)" for m in models])
        ax.invert_yaxis()
        ax.set_xlabel("points of the AdamW step")
        ax.set_title(f"{lay} ({df[df['layout'] == lay]['gpus'].iloc[0]} GPUs)")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    caption(fig, "SIMULATED — profile a800, seq 2048, micro-batch 2. Parts: ours = our schedule's DMuon "
                 "minus AdamW per phase; black tick = DMuon over AdamW with the published schedule; each mechanism = the published schedule's step less the same with "
                 "that mechanism off (simulator.programs.step_published); interaction = the rest. AdamW % = share of "
                 "parameters in the AdamW pass (embeddings, heads, norms). " + WALL_WM_NOTE)
    return fig
