"""Figure 11, the tornado chart of `harness sensitivity`: one bar per uncertain input, from the output at the
input's low end to the output at its high end, ranked by swing, around the simulated base value.

`tornado(rows, ...)` draws and saves it from the command's rows; `sensitivity(df)` draws it from the CSV
the command writes (`--csv`: the rows plus the configuration's columns), which is how `harness figures
sensitivity` redraws paper_figures/sensitivity.png from results/sensitivity/.
"""

from __future__ import annotations

from pathlib import Path

from .common import caption, plt, save

CONFIG_COLUMNS = ("workload", "gpus", "gpu", "strategy", "layout", "seq_len", "micro_batch")


def title_and_note(cfg: dict, output: str) -> tuple[str, str]:
    title = (f"Sensitivity of {output}: {cfg['strategy']}, {cfg['workload']}, {cfg['gpus']} x {cfg['gpu']}, "
             f"{cfg['layout']}")
    note = (f"SIMULATED with profile {cfg['gpu']}; one input at a time over the profile's [uncertainty] "
            "ranges, others at the profile's values; compute rates not refitted (harness sensitivity)")
    return title, note


def _draw(rows: list[dict], base: float, title: str, note: str):
    pyplot = plt()
    scale, unit = (1e3, "ms") if rows and str(rows[0]["output"]).endswith("_s") else (1.0, "")
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
    return fig


def tornado(rows: list[dict], base: float, title: str, note: str, out_dir: Path, stem: str) -> list[Path]:
    fig = _draw(rows, base, title, note)
    paths = save(fig, out_dir, stem)
    plt().close(fig)
    return paths


def sensitivity(df):
    """The chart from a `harness sensitivity --csv` table (rows ranked by swing, one configuration)."""
    from dmuon.errors import InputError

    missing = [c for c in (*CONFIG_COLUMNS, "output", "base") if c not in df.columns]
    if missing:
        raise KeyError(missing[0])
    if df[list(CONFIG_COLUMNS)].drop_duplicates().shape[0] != 1 or df["output"].nunique() != 1:
        raise InputError("a sensitivity table holds one configuration and one output; this one mixes "
                         f"{df[list(CONFIG_COLUMNS)].drop_duplicates().shape[0]} configurations")
    rows = df.sort_values("swing", ascending=False).to_dict("records")
    cfg = rows[0]
    title, note = title_and_note(cfg, str(cfg["output"]))
    return _draw(rows, float(cfg["base"]), title, note)
