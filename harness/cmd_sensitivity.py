"""`harness sensitivity`: which uncertain input of the profile moves a simulated output most.

One-at-a-time over the profile's `[uncertainty]` ranges (simulator.bands): the configuration is simulated
with each input at its low and at its high end; the rows, ranked by swing, go to a CSV and a tornado chart
(paper_figures/sensitivity.png and .pdf unless --figure-dir / --stem say otherwise). The compute rates
are not refitted when an input moves: the swing is the model's, at fixed calibration. SIMULATED.
"""

from __future__ import annotations

from pathlib import Path

FIGURE_DIR = Path("paper_figures")


def register(app, bench) -> None:
    import typer

    @app.command("sensitivity")
    def sensitivity_cmd(
        workload: str = typer.Option("qwen2.5-7b", help="Catalog workload or a .toml / .csv file."),
        gpus: int = typer.Option(128, help="Data-parallel ranks (GPUs)."),
        gpu: str = typer.Option("a800", help="Hardware profile with an [uncertainty] table (a800)."),
        strategy: str = typer.Option("dmuon", help="adamw | naive | dmuon."),
        layout: str = typer.Option("fsdp-keep", help="fsdp-keep | fsdp-free | hsdp-keep | hsdp-free | ddp | "
                                                     "sharded."),
        seq_len: int = typer.Option(2048, help="Tokens per sequence."),
        micro_batch: int = typer.Option(2, help="Sequences per GPU per step."),
        output: str = typer.Option("step_s", help="The SimResult number to rank inputs by (step_s, "
                                                  "optimizer_s, exposed_comm_s, ...)."),
        csv: str = typer.Option(None, help="Write the rows to this CSV as well."),
        figure_dir: str = typer.Option(str(FIGURE_DIR), help="Where the tornado chart goes."),
        stem: str = typer.Option("sensitivity", help="File name of the chart (PNG and PDF)."),
    ):
        """Rank the profile's uncertain inputs by how much each moves OUTPUT; tornado chart + table."""
        from dmuon.errors import InputError
        from simulator.api import SimConfig
        from simulator.bands import sensitivity

        if not Path(figure_dir).is_dir():
            raise InputError(f"--figure-dir {figure_dir!r} is not a directory")
        cfg = SimConfig(workload=workload, gpus=gpus, gpu=gpu, strategy=strategy, layout=layout,
                        seq_len=seq_len, micro_batch=micro_batch)
        base, rows = sensitivity(cfg, output)
        print(f"{output} of {strategy} {workload} on {gpus} x {gpu} ({layout}), SIMULATED: base {base:.6g}")
        for r in rows:
            print(f"  {r['input']:18s} {r['input_low']:>9.4g} .. {r['input_high']:<9.4g} -> "
                  f"{r['at_low']:.6g} .. {r['at_high']:.6g}  swing {r['swing']:.4g}  ({r['source']})")
        if csv:
            import pandas as pd

            from dmuon.io import atomic_path

            with atomic_path(Path(csv)) as tmp:
                pd.DataFrame(rows).to_csv(tmp, index=False)
        from .figures.sensitivity import tornado

        title = f"Sensitivity of {output}: {strategy}, {workload}, {gpus} x {gpu}, {layout}"
        note = (f"SIMULATED with profile {gpu}; one input at a time over the profile's [uncertainty] ranges, "
                "others at the profile's values; compute rates not refitted (harness sensitivity)")
        for p in tornado(rows, base, title, note, Path(figure_dir), stem):
            print(f"figure: {p}")
