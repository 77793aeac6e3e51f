"""Figure 10: MoE owner plans under expert parallelism (experiments/moe_ep.toml): per model, the DMuon NS
makespan (plan) and its lower bound vs the EP degree, one line per rank count. EP 1 = no expert
parallelism (every matrix balanced over every rank)."""

from __future__ import annotations

from .common import caption, log2_axis, plt

COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974")


def moe_ep(df):
    pyplot = plt()
    models = list(dict.fromkeys(df["workload"]))
    fig, axes = pyplot.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for j, model in enumerate(models):
        ax = axes[0, j]
        d0 = df[df["workload"] == model]
        for ci, g in enumerate(sorted(d0["gpus"].unique())):
            d = d0[d0["gpus"] == g].sort_values("ep")
            color = COLORS[ci % len(COLORS)]
            ax.plot(d["ep"], d["makespan_s"] * 1e3, "o-", ms=3.5, color=color, label=f"{g} ranks: plan")
            ax.plot(d["ep"], d["lower_bound_s"] * 1e3, ":", color=color, label=f"{g} ranks: lower bound")
        log2_axis(ax, d0["ep"].unique(), "expert-parallel degree (1 = none)")
        ax.set_yscale("log")
        ax.set_ylabel("NS makespan per step (ms, log)")
        ax.set_title(model, fontsize=9)
        if j == 0:
            ax.legend(fontsize=6)
    fig.tight_layout()
    r = df.iloc[0]
    caption(fig, f"Plans priced by the '{r['cost_source']}' cost table ({r['method']}, {r['dtype']}, "
                 f"balancer {r['balancer']}); not a simulated step. With EP an expert is owned inside its EP "
                 "rank's replica group; the plan is the better of balancing the experts first or the dense "
                 "matrices first (dmuon.plan.ep).")
    return fig
