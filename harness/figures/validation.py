"""Figure 7: validation (results/validation/validation.csv from `harness validate`): simulated vs published
(the 8 x A800 step table, the NS-only replay) and simulated vs measured (closed loop on this CPU), as parity
plots (top) and the error of every point (bottom) with the bound it is checked against.
"""

from __future__ import annotations

from .common import STRATEGY_COLORS, caption, plt

PANELS = (
    ("published_8xa800", "8 x A800 step table (published)"),
    ("ns_replay", "NS-only replay, 8 x A800 (published)"),
    ("closed_loop", "closed loop: real CPU runs (measured)"),
)
MARKERS = {"forward": "v", "backward": "^", "optimizer": "o", "step": "s", "ns_time": "D"}


def _color(r) -> str:
    return STRATEGY_COLORS.get(str(r["strategy"]), "#777777")


def validation(df):
    pyplot = plt()
    panels = [(c, t) for c, t in PANELS if (df["check"] == c).any()]
    fig, axes = pyplot.subplots(
        2,
        len(panels),
        figsize=(4.6 * len(panels), 8.2),
        squeeze=False,
        gridspec_kw={"height_ratios": [1.15, 1]},
    )
    for k, (check, title) in enumerate(panels):
        d = df[df["check"] == check].reset_index(drop=True)
        ax, ax2 = axes[0, k], axes[1, k]
        ref, sim = d["reference"] * 1e3, d["simulated"] * 1e3
        lo, hi = min(ref.min(), sim.min()) * 0.7, max(ref.max(), sim.max()) * 1.4
        bound = d["bound"].dropna().max() if d["bound"].notna().any() else 0.25
        xs = [lo, hi]
        ax.plot(xs, xs, color="#333333", lw=0.8)
        ax.fill_between(
            xs,
            [x * (1 - bound) for x in xs],
            [x * (1 + bound) for x in xs],
            color="#cccccc",
            alpha=0.4,
            label=f"±{bound:.0%}",
        )
        for i, r in d.iterrows():
            filled = bool(r["bounded"])
            ax.scatter(
                ref[i],
                sim[i],
                marker=MARKERS.get(r["metric"], "o"),
                s=26,
                facecolors=_color(r) if filled else "none",
                edgecolors=_color(r),
                linewidths=1,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("published / measured (ms, log)" if check != "closed_loop" else "measured (ms, log)")
        ax.set_ylabel("simulated (ms, log)")
        ax.set_title(title, fontsize=9)
        rows = sorted(set(d["label"].astype(str)))  # one row per point label; its metrics as markers
        for _, r in d.iterrows():
            ax2.scatter(
                100 * r["error"],
                rows.index(str(r["label"])),
                marker=MARKERS.get(r["metric"], "o"),
                s=24,
                facecolors=_color(r) if r["bounded"] else "none",
                edgecolors=_color(r),
                alpha=0.9,
            )
        ax2.axvline(0, color="#333333", lw=0.8)
        for sgn in (-1, 1):
            ax2.axvline(100 * sgn * bound, color="#c44e52", ls=":", lw=1)
        ax2.set_yticks(range(len(rows)))
        ax2.set_yticklabels(rows, fontsize=7)
        ax2.invert_yaxis()
        ax2.set_xlabel("error of the simulation (%)")
        n_b = int(d["bounded"].sum())
        n_ok = int((d["bounded"] & d["within_bound"]).sum())
        ax2.set_title(
            f"{n_ok} of {n_b} checked points within ±{bound:.0%} (hollow: shown, not checked)", fontsize=8
        )
    for m, mk in MARKERS.items():
        axes[0, 0].scatter([], [], marker=mk, color="#555555", label=m)
    for s, c in STRATEGY_COLORS.items():
        axes[0, 0].scatter([], [], marker="s", color=c, label=s)
    axes[0, 0].legend(fontsize=6.5, loc="upper left")
    fig.suptitle(
        "Validation of the simulator: simulated vs published (A800) and vs measured (this CPU)", y=1.0
    )
    fig.tight_layout()
    prof = ", ".join(sorted(set(df["profile"].dropna().astype(str))))
    caption(
        fig,
        f"SIMULATED with profiles {prof}. Published: reported.csv (8 x A800, bf16, seq 2048, micro-batch 2; "
        "the grad-sync tail counted in backward as published); filled = checked against the bound, hollow = "
        "shown only (in-sample fit points, or rows outside the paper's FSDP2 setting). Closed loop: "
        "`harness bench step` runs MEASURED on this shared 2-core CPU, simulated with the cpu profile.",
    )
    return fig
