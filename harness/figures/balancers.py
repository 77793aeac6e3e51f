"""Figure 5: owner balancers (experiments/balancers.toml): per-rank NS load of round-robin, LPT and MILP at
one GPU count per workload, and makespan efficiency and solve time over GPU counts.
"""

from __future__ import annotations

import json

from .common import WALL_WM_NOTE, caption, log2_axis, plt

COLORS = {"round_robin": "#c44e52", "lpt": "#dd8452", "milp": "#55a868"}
LABELS = {"round_robin": "round-robin", "lpt": "LPT (greedy)", "milp": "MILP"}
STYLES = {"round_robin": "-", "lpt": "--", "milp": "-"}
DETAIL_GPUS = 32


def balancer_loads(df, detail_gpus: int = DETAIL_GPUS):
    pyplot = plt()
    ws = list(dict.fromkeys(df["workload"]))
    gpus = sorted(df["gpus"].unique())
    n = detail_gpus if detail_gpus in gpus else gpus[len(gpus) // 2]
    fig, axes = pyplot.subplots(3, len(ws), figsize=(3.5 * len(ws), 8.6), squeeze=False)
    for k, w in enumerate(ws):
        sub = df[df["workload"] == w]
        ax = axes[0, k]
        d = sub[sub["gpus"] == n]
        for _, r in d.iterrows():
            loads = sorted(json.loads(r["loads_s"]), reverse=True)
            ax.step(
                range(len(loads)),
                [x * 1e3 for x in loads],
                where="mid",
                color=COLORS[r["balancer"]],
                ls=STYLES[r["balancer"]],
                label=f"{LABELS[r['balancer']]}: makespan {r['makespan_s'] * 1e3:.1f} ms",
            )
        if len(d):
            ax.axhline(
                d["lower_bound_s"].iloc[0] * 1e3,
                color="#333333",
                ls=":",
                lw=1,
                label=f"lower bound {d['lower_bound_s'].iloc[0] * 1e3:.1f} ms",
            )
        ax.set_title(f"{w}{' (ASSUMPTION)' if w == 'wall-wm' else ''}: {n} ranks")
        ax.set_xlabel("rank (sorted by load)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)
        for bal in LABELS:
            e = sub[sub["balancer"] == bal].sort_values("gpus")
            if len(e):
                for row, col in ((1, "efficiency"), (2, "solve_time_s")):
                    axes[row, k].plot(
                        e["gpus"],
                        e[col],
                        marker="o",
                        ls=STYLES[bal],
                        color=COLORS[bal],
                        label=LABELS[bal],
                        ms=4,
                        zorder=3 if bal == "lpt" else 2,
                    )
        for row in (1, 2):
            a = axes[row, k]
            log2_axis(a, gpus, "ranks (GPUs)")
        axes[1, k].set_ylim(0, 1.05)
        axes[2, k].set_yscale("log")
    axes[0, 0].set_ylabel("NS load per rank (ms)")
    axes[1, 0].set_ylabel("efficiency = lower bound / makespan")
    axes[2, 0].set_ylabel("solve time (s, log scale)")
    axes[1, 0].legend(fontsize=7)
    r = df.iloc[0]
    fig.suptitle("Owner load balancing: per-rank optimizer (NS) load, efficiency and solve time", y=1.0)
    fig.tight_layout()
    caption(
        fig,
        f"Plans priced by the '{r['cost_source']}' cost table ({r['method']}, {r['dtype']}, batching "
        f"{'on' if r['batching'] else 'off'}, max batch {r['max_batch']}); loads and makespans are "
        f"cost-table predictions (PLANNED, not run); solve times are wall seconds MEASURED on this "
        f"2-core CPU while other work ran (MILP time limit {r['time_limit_s']:g} s)."
        + (f" {WALL_WM_NOTE}." if "wall-wm" in ws else ""),
    )
    return fig
