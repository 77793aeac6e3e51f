"""Figure 8: orthogonalization variants measured on this machine (experiments/kernels.toml): standard vs
Gram NS, Jordan vs Polar Express coefficients, batched vs loop, per matrix shape.
"""

from __future__ import annotations

from .common import caption, plt

BARS = (
    ("standard_jordan_s", "standard NS, Jordan", "#c44e52"),
    ("gram_jordan_s", "Gram NS, Jordan", "#55a868"),
    ("standard_polar_s", "standard NS, Polar Express", "#dd8452"),
    ("gram_polar_s", "Gram NS, Polar Express", "#4c72b0"),
)


def kernels(df):
    pyplot = plt()
    fig, (ax, ax2) = pyplot.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.6, 1]})
    labels = [f"{r.matrix}\n{r.n}x{r.m}" for r in df.itertuples()]
    width = 0.8 / len(BARS)
    for j, (col, lab, color) in enumerate(BARS):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(df))]
        ax.bar(xs, df[col] * 1e3, width=width, color=color, label=lab)
    for i, r in enumerate(df.itertuples()):
        ax.text(
            i, r.standard_jordan_s * 1e3 * 1.15, f"Gram {r.gram_speedup_jordan:.2f}x", ha="center", fontsize=7
        )
    ax.set_yscale("log")
    ax.set_xticks(range(len(df)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("time per orthogonalization (ms, log scale)")
    ax.set_title("one matrix: standard vs Gram NS, Jordan vs Polar Express")
    ax.set_ylim(top=df[[c for c, _, _ in BARS]].max().max() * 1e3 * 4)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    xs = range(len(df))
    ax2.bar(
        [i - 0.2 for i in xs],
        df["loop_s"] / df["batch"] * 1e3,
        width=0.4,
        color="#999999",
        label="loop of single calls",
    )
    ax2.bar(
        [i + 0.2 for i in xs],
        df["batched_s"] / df["batch"] * 1e3,
        width=0.4,
        color="#55a868",
        label="one batched call",
    )
    for i, r in enumerate(df.itertuples()):
        ax2.text(
            i + 0.2,
            r.batched_s / r.batch * 1e3,
            f"{r.batch_speedup:.2f}x",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax2.set_yscale("log")
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels([f"{r.matrix}\nbatch {r.batch}" for r in df.itertuples()])
    ax2.set_ylabel("time per matrix (ms, log scale)")
    ax2.set_title("batched vs loop (Gram NS, Jordan)")
    ax2.set_ylim(top=(df["loop_s"] / df["batch"]).max() * 1e3 * 4)
    ax2.legend(fontsize=7, loc="upper left")
    r = df.iloc[0]
    fig.suptitle(f"Orthogonalization variants, {r['workload']} shapes / {r['scale']} — {r['device']}", y=1.0)
    fig.tight_layout()
    caption(
        fig,
        f"MEASURED {r['device'].removeprefix('measured ')}, {r['dtype']}, torch kernels, "
        f"{r['threads']} thread(s), median of {r['repeats']} interleaved repeats after a warm-up "
        f"(load average {df['load_1m_before'].min():.1f}-{df['load_1m_after'].max():.1f}: shared "
        f"machine). The Triton symmetric kernels need a GPU and are not in this figure.",
    )
    return fig
