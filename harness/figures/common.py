"""Shared figure helpers: matplotlib set-up (no display), colours per strategy, atomic PNG + PDF saving,
reading a results table, and the caption line every figure carries (simulated with which profile, or
measured where).
"""

from __future__ import annotations

from pathlib import Path

STRATEGY_COLORS = {"adamw": "#4c72b0", "naive": "#c44e52", "dmuon": "#55a868"}
STRATEGY_LABELS = {"adamw": "AdamW", "naive": "naive Muon (gather-then-compute)", "dmuon": "DMuon"}
WALL_WM_NOTE = "Wall-WM: ASSUMPTION-based model (backbone size not public; Wan2.2-5B-like DiT)"


def plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as pyplot

    pyplot.rcParams.update(
        {
            "figure.dpi": 110,
            "savefig.dpi": 150,
            "font.size": 9,
            "axes.titlesize": 10,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "legend.fontsize": 8,
            "pdf.fonttype": 42,
        }
    )
    return pyplot


def read_results(path: Path):
    import pandas as pd

    from dmuon.errors import InputError

    path = Path(path)
    if not path.is_file():
        raise InputError(f"no results table at {path}; run the experiment first (harness run ...)")
    try:
        return pd.read_csv(path)
    except (UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise InputError(f"{path} is not a readable results table (CSV): {str(e).splitlines()[0]}; "
                         "re-run the experiment (harness run ...) to rewrite it") from None


def profile_caption(df) -> str:
    """'simulated, profile a800 (...)' from the rows' profile / profile_description / cost_source columns."""
    parts = []
    cols = [c for c in ("profile", "cost_source") if c in df.columns]
    if not cols:
        return "simulated"
    for key, sub in df.groupby("profile", sort=True):
        desc = str(sub["profile_description"].iloc[0]) if "profile_description" in sub else ""
        cost = str(sub["cost_source"].iloc[0]) if "cost_source" in sub else ""
        label = f"{key}" + (f", NS/elementwise cost table '{cost}'" if cost and cost != key else "")
        if "roofline" in cost:
            label += " (datasheet roofline, not measured)"
        parts.append(label + (f" [{desc.split(': ', 1)[-1]}]" if desc else ""))
    return "SIMULATED — profile " + "; ".join(parts)


# No date and no tool version in the files: the same figure gives the same bytes, so redrawing an
# unchanged figure leaves `git status` clean (tests/test_determinism.py).
METADATA = {
    "png": {"Software": None},
    "pdf": {"Creator": None, "Producer": None, "CreationDate": None, "ModDate": None},
    "svg": {"Creator": None, "Date": None},
}


def save(fig, out_dir: Path, stem: str, formats: tuple[str, ...] = ("png", "pdf")) -> list[Path]:
    """PNG and PDF (deterministic bytes: METADATA), each written to a temp file and renamed
    (`dmuon.io.atomic_path`)."""
    import matplotlib

    from dmuon.io import atomic_path

    paths = []
    for ext in formats:
        path = Path(out_dir) / f"{stem}.{ext}"
        with atomic_path(path) as tmp, matplotlib.rc_context({"svg.hashsalt": "dmuon"}):
            fig.savefig(tmp, format=ext, bbox_inches="tight", metadata=METADATA.get(ext))
        paths.append(path)
    return paths


def log2_axis(ax, ticks, label: str | None = None, fmt=str) -> None:
    """A log-2 x axis with one labelled tick per value (GPU counts, degrees) and an optional x label."""
    ticks = sorted(ticks)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([fmt(x) for x in ticks])
    if label:
        ax.set_xlabel(label)


def caption(fig, text: str) -> None:
    fig.text(0.01, -0.01, text, ha="left", va="top", fontsize=7.5, wrap=True, color="#333333")


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else (f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}")
