"""`harness sensitivity`: which uncertain input of the profile moves a simulated output most.

One-at-a-time over the profile's `[uncertainty]` ranges (simulator.calibration.bands): the configuration is simulated
with each input at its low and at its high end; the rows, ranked by swing, go to a CSV (with the
configuration's columns, so the chart can be redrawn from it) and a tornado chart. The configuration of
figure 11 (qwen2.5-7b DMuon on 128 A800s, `--csv results/sensitivity/qwen2.5-7b_128_dmuon_step.csv`) is
drawn through the figure registry: paper_figures/sensitivity.png and .pdf, listed in figures.json and
index.md (`harness figures sensitivity` redraws it from the CSV). Any other configuration's chart is
<figure-dir>/sensitivity_<workload>_<gpus>_<strategy>_<output>.png unless --stem names it, and is not
indexed. The compute rates are not refitted when an input moves: the swing is the model's, at fixed
calibration. SIMULATED.
"""

from __future__ import annotations

from pathlib import Path

FIGURE_DIR = Path("paper_figures")
RESULTS_DIR = Path("results/sensitivity")


def register(app, bench) -> None:
    import typer

    from .profile_help import gpu_help

    @app.command("sensitivity")
    def sensitivity_cmd(
        workload: str = typer.Option("qwen2.5-7b", help="Catalog workload or a .toml / .csv file."),
        gpus: int = typer.Option(128, help="Data-parallel ranks (GPUs)."),
        gpu: str = typer.Option("a800", help=gpu_help("Hardware profile with an uncertainty table",
                                                        "uncertainty", path=False)),
        strategy: str = typer.Option("dmuon", help="adamw | naive | dmuon."),
        layout: str = typer.Option("fsdp-keep", help="fsdp-keep | fsdp-free | hsdp-keep | hsdp-free | ddp | "
                                                     "sharded."),
        seq_len: int = typer.Option(2048, help="Tokens per sequence."),
        micro_batch: int = typer.Option(2, help="Sequences per GPU per step."),
        output: str = typer.Option("step_s", help="The SimResult number to rank inputs by (step_s, "
                                                  "optimizer_s, exposed_comm_s, ...)."),
        csv: str = typer.Option(None, help="Write the rows to this CSV as well."),
        figure_dir: str = typer.Option(str(FIGURE_DIR), help="Where the tornado chart goes."),
        stem: str = typer.Option(None, help="File name of the chart (PNG and PDF); default: figure 11's "
                                            "'sensitivity' for its CSV, else sensitivity_<workload>_<gpus>_"
                                            "<strategy>_<output>."),
    ):
        """Rank the profile's uncertain inputs by how much each moves OUTPUT; tornado chart + table."""
        from dmuon.errors import InputError
        from simulator.api import SimConfig
        from simulator.calibration.bands import sensitivity

        if not Path(figure_dir).is_dir():
            raise InputError(f"--figure-dir {figure_dir!r} is not a directory")
        cfg = SimConfig(workload=workload, gpus=gpus, gpu=gpu, strategy=strategy, layout=layout,
                        seq_len=seq_len, micro_batch=micro_batch)
        base, rows = sensitivity(cfg, output)
        conf = {"workload": workload, "gpus": gpus, "gpu": gpu, "strategy": strategy, "layout": layout,
                "seq_len": seq_len, "micro_batch": micro_batch}
        print(f"{output} of {strategy} {workload} on {gpus} x {gpu} ({layout}), SIMULATED: base {base:.6g}")
        for r in rows:
            print(f"  {r['input']:18s} {r['input_low']:>9.4g} .. {r['input_high']:<9.4g} -> "
                  f"{r['at_low']:.6g} .. {r['at_high']:.6g}  swing {r['swing']:.4g}  ({r['source']})")
        if csv:
            import pandas as pd

            from dmuon.io import atomic_path

            with atomic_path(Path(csv)) as tmp:
                pd.DataFrame([{**r, **conf} for r in rows]).to_csv(tmp, index=False)
        from .figures import FIGURES, render, write_index
        from .figures.sensitivity import title_and_note, tornado

        spec = FIGURES["sensitivity"]
        indexed = csv and stem is None and Path(csv).resolve() == (RESULTS_DIR / spec.data).resolve()
        if indexed:  # figure 11: drawn from the CSV just written, entered in figures.json / index.md
            entry = render("sensitivity", RESULTS_DIR, Path(figure_dir))
            write_index(Path(figure_dir), [entry])
            print(f"figure {entry['number']}: {Path(figure_dir) / entry['files'][0]} (index updated)")
            return
        title, note = title_and_note(conf, output)
        name = Path(workload).stem if workload.endswith((".toml", ".csv", ".json")) else Path(workload).name
        stem = stem or f"sensitivity_{name}_{gpus}_{strategy}_{output.removesuffix('_s')}"
        for p in tornado(rows, base, title, note, Path(figure_dir), stem):
            print(f"figure: {p}")
