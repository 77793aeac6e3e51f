"""Figure 4 and the ablation shares.

Additive path (variants of experiments/ablation.toml): naive -> +sym_gram -> +owners_lb ->
+batching_autotune -> +overlap (= full DMuon). For one (workload, gpus), the share of step k is
    share_k = (T(k-1) - T(k)) / (T(naive) - T(full))
with T the simulated training-step time (`step_s`; `optimizer_s` gives the optimizer-time shares). Shares sum
to 100% per configuration; a negative share means that step made the step slower there. The headline
share is the mean over the configurations. Leave-one-out: full DMuon with one optimization removed,
reported as the step-time increase over full DMuon; the `+split` variant (full DMuon with owner groups,
beyond the paper) is drawn beside them as its change over full DMuon.
"""

from __future__ import annotations

from .common import WALL_WM_NOTE, caption, plt, profile_caption

PATH = ("naive", "+sym_gram", "+owners_lb", "+batching_autotune", "+overlap")
STEP_LABELS = {
    "+sym_gram": "symmetric Gram kernel",
    "+owners_lb": "owner scheduling + load balancing",
    "+batching_autotune": "batching + autotuning",
    "+overlap": "overlap of publication",
}
PAPER_KEYS = {
    "+sym_gram": "symmetric_gram_kernel",
    "+owners_lb": "owner_scheduling_and_load_balancing",
    "+batching_autotune": "autotuning_and_batching",
}
COLORS = {
    "+sym_gram": "#4c72b0",
    "+owners_lb": "#55a868",
    "+batching_autotune": "#dd8452",
    "+overlap": "#8172b3",
    "unattributed": "#bbbbbb",
}
LEAVE_ONE_OUT = {
    "-sym_gram": "no symmetric Gram kernel (standard NS)",
    "-owners_lb": "no owners (gather-then-compute)",
    "-load_balance": "owners round-robin (no balancing)",
    "-batching_autotune": "no batching / autotuning",
    "-overlap": "no overlap",
    "+split": "+ split NS (owner groups, max_split 8)",  # beyond the paper: an addition, not a removal
}


def paper_shares() -> dict[str, float]:
    """The paper's shares (%) of the total speedup, from reported.csv paper_claims."""
    from simulator.validation.reference import reported_rows

    out = {}
    for r in reported_rows():
        if r["table"] == "paper_claims" and r["setting"] == "ablation":
            out[r["metric"]] = float(r["value"])
    return {k: out[v] for k, v in PAPER_KEYS.items() if v in out}


def shares(df, time: str = "step_s"):
    """One row per (workload, gpus) with the share (%) of each additive step, the total saving and speedup."""
    import pandas as pd

    rows = []
    for (w, g), sub in df.groupby(["workload", "gpus"], sort=False):
        t = sub.set_index("variant")[time]
        if not set(PATH) <= set(t.index):
            continue
        total = t[PATH[0]] - t[PATH[-1]]
        row = {
            "workload": w,
            "gpus": int(g),
            "naive_s": t[PATH[0]],
            "full_s": t[PATH[-1]],
            "total_saving_s": total,
            "speedup": t[PATH[0]] / t[PATH[-1]],
        }
        for a, b in zip(PATH, PATH[1:], strict=False):
            row[b] = 100 * (t[a] - t[b]) / total if total else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def mean_shares(df, time: str = "step_s") -> dict[str, float]:
    s = shares(df, time)
    return {k: float(s[k].mean()) for k in PATH[1:]} if len(s) else {}


def leave_one_out(df):
    """Step-time increase (%) of full DMuon when one optimization is removed, per (workload, gpus)."""
    import pandas as pd

    rows = []
    for (w, g), sub in df.groupby(["workload", "gpus"], sort=False):
        t = sub.set_index("variant")["step_s"]
        if "+overlap" not in t:
            continue
        for v in LEAVE_ONE_OUT:
            if v in t:
                rows.append(
                    {
                        "workload": w,
                        "gpus": int(g),
                        "variant": v,
                        "increase_pct": 100 * (t[v] / t["+overlap"] - 1),
                    }
                )
    return pd.DataFrame(rows)


def _stacked(ax, labels, data: list[dict], keys):
    for y, d in enumerate(data):
        pos, neg = 0.0, 0.0
        for k in keys:
            v = d.get(k, 0.0)
            if v != v:  # nan
                continue
            left = pos if v >= 0 else neg + v
            ax.barh(y, abs(v), left=left, color=COLORS[k], edgecolor="white", linewidth=0.5)
            if abs(v) >= 6:
                ax.text(
                    left + abs(v) / 2, y, f"{v:.0f}", ha="center", va="center", fontsize=6.5, color="white"
                )
            if v >= 0:
                pos += v
            else:
                neg += v
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()


def ablation(df):
    pyplot = plt()
    s = shares(df)
    paper = paper_shares()
    fig, (ax, ax2) = pyplot.subplots(
        1, 2, figsize=(13, 0.32 * (len(s) + 3) + 2.2), gridspec_kw={"width_ratios": [1.35, 1]}
    )
    keys = list(PATH[1:]) + ["unattributed"]
    labels = [f"{r.workload}, {r.gpus} GPUs ({r.speedup:.2f}x)" for r in s.itertuples()]
    data = s.to_dict("records")  # (column names like "+sym_gram" are not attribute names)
    means = mean_shares(df)
    labels.append("ours: mean of the above")
    data.append(means)
    if paper:
        labels.append("paper (reported.csv)")
        data.append({**paper, "unattributed": 100 - sum(paper.values())})
    _stacked(ax, labels, data, keys)
    for k in keys:
        ax.barh(0, 0, color=COLORS[k], label=STEP_LABELS.get(k, "not attributed by the paper"))
    ax.axvline(0, color="#444444", lw=0.6)
    ax.axvline(100, color="#444444", lw=0.6, ls=":")
    ax.set_xlabel("share of the step-time saving naive -> full DMuon (%)")
    ax.set_title(
        "Added one at a time (naive -> +sym Gram -> +owners/LB -> +batching -> +overlap)", fontsize=9
    )
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.06), ncol=3, fontsize=7)
    lo = leave_one_out(df)
    if len(lo):
        piv = lo.pivot_table(index=["workload", "gpus"], columns="variant", values="increase_pct", sort=False)
        order = [v for v in LEAVE_ONE_OUT if v in piv.columns]
        n = len(order)
        width = 0.8 / n
        for j, v in enumerate(order):
            ax2.barh(
                [i + j * width - 0.4 + width / 2 for i in range(len(piv))],
                piv[v].values,
                height=width,
                label=LEAVE_ONE_OUT[v],
            )
        ax2.set_yticks(range(len(piv)))
        ax2.set_yticklabels([f"{w}, {g} GPUs" for w, g in piv.index], fontsize=7)
        ax2.invert_yaxis()
        ax2.set_xscale("symlog", linthresh=1)
        ax2.set_xlabel("step-time increase over full DMuon (%, symlog)")
        title = "Removed one at a time from full DMuon" + (" (and + split NS)" if "+split" in order else "")
        ax2.set_title(title, fontsize=9)
        ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=6.5)
    fig.suptitle("Ablation: where DMuon's step-time saving comes from", y=1.02)
    fig.tight_layout()
    paper_txt = ", ".join(f"{STEP_LABELS[k]} {v:.0f}%" for k, v in paper.items())
    ours_txt = ", ".join(f"{STEP_LABELS[k]} {v:.0f}%" for k, v in means.items())
    caption(
        fig,
        f"{profile_caption(df)}. Share of step k = (T(k-1) - T(k)) / (T(naive) - T(full DMuon)), T = "
        f"simulated training-step time. Ours (mean): {ours_txt}. Paper: {paper_txt}. The paper's "
        f"order of adding the optimizations is not public; ours is the path above."
        + (f" {WALL_WM_NOTE}." if "wall-wm" in set(df["workload"]) else ""),
    )
    return fig
