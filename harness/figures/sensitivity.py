"""The tornado chart of `harness sensitivity`: one bar per uncertain input, from the output at the input's
low end to the output at its high end, ranked by swing, around the simulated base value."""

from __future__ import annotations

from pathlib import Path

from .common import caption, plt, save


def tornado(rows: list[dict], base: float, title: str, note: str, out_dir: Path, stem: str) -> list[Path]:
    pyplot = plt()
    scale, unit = (1e3, "ms") if rows and rows[0]["output"].endswith("_s") else (1.0, "")
    fig, ax = pyplot.subplots(figsize=(7.0, 0.45 * len(rows) + 1.4))
    for i, r in enumerate(reversed(rows)):  # largest swing on top
        lo, hi = r["at_low"] * scale, r["at_high"] * scale
        for v, colour in ((lo, "#4c72b0"), (hi, "#c44e52")):
            ax.barh(i, v - base * scale, left=base * scale, color=colour, alpha=0.8, height=0.6)
        ax.text(max(lo, hi), i, f"  {r['input_low']:.4g} .. {r['input_high']:.4g}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [r["input"] for r in reversed(rows)])
    ax.axvline(base * scale, color="black", lw=0.8)
    ax.set_xlabel(f"{rows[0]['output'] if rows else ''} {unit} (blue: input at its low end, red: high end)")
    ax.set_title(title)
    caption(fig, note)
    paths = save(fig, out_dir, stem)
    pyplot.close(fig)
    return paths
