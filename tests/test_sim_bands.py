"""Error bands and sensitivity over the profile's uncertain inputs (simulator.calibration.bands, harness sensitivity)."""

import dataclasses

import pytest

from dmuon.errors import InputError
from harness.cli import main
from simulator.api import SimConfig
from simulator.calibration.bands import INPUTS, bands, ranges, sensitivity
from simulator.fabric.hardware import load_profile

CFG = SimConfig(workload="qwen2.5-1.5b", gpus=16, strategy="dmuon")


def test_a800_names_a_sourced_range_for_every_input():
    prof = load_profile("a800")
    got = {name: (lo, hi, src) for name, lo, hi, src in ranges(prof)}
    assert set(got) == set(INPUTS)
    for name, (lo, hi, src) in got.items():
        assert lo <= hi and src.strip(), name
    assert got["fwd_tflops"][0] < prof.fwd_flops / 1e12 < got["fwd_tflops"][1]  # rel: around the fit


def test_band_brackets_the_base_and_sensitivity_ranks_by_swing():
    base, rows = sensitivity(CFG)
    assert [r["swing"] for r in rows] == sorted((r["swing"] for r in rows), reverse=True)
    assert rows[0]["swing"] > 0
    b = bands(CFG)
    assert b["low"] < b["base"] == base < b["high"]
    with pytest.raises(InputError, match="unknown output 'speed'; accepted: .*step_s"):
        sensitivity(CFG, "speed")
    bare = dataclasses.replace(load_profile("a800"), uncertainty={})
    with pytest.raises(InputError, match="no \\[uncertainty\\] table"):
        sensitivity(dataclasses.replace(CFG, gpu=bare))


def test_bad_uncertainty_entries_are_one_line_errors(tmp_path):
    text = (tmp_path / "p.toml")
    src = load_profile.__globals__["PROFILE_DIR"] / "a800.toml"
    base = src.read_text().split("[uncertainty]")[0]
    for entry, match in (('nic = { low = 1, high = 2, source = "x" }', "unknown uncertain input .*'nic'"),
                         ('curve_scale = { low = 2, high = 1, source = "x" }', "low 2 is above high 1"),
                         ('curve_scale = { rel = 0.1, low = 1, source = "x" }', "give low and high, or rel"),
                         ('curve_scale = { rel = 0.1, source = "" }', "needs a source")):
        text.write_text(base + "[uncertainty]\n" + entry + "\n")
        with pytest.raises(InputError, match=match):
            load_profile(str(text))


def test_cli_sensitivity_writes_a_tornado_chart_and_simulate_prints_a_band(tmp_path, capsys):
    out = tmp_path / "rows.csv"
    assert main(["sensitivity", "--workload", "qwen2.5-1.5b", "--gpus", "8", "--figure-dir", str(tmp_path),
                 "--csv", str(out)]) == 0
    stem = "sensitivity_qwen2.5-1.5b_8_dmuon_step"  # not figure 11's configuration: not indexed
    assert (tmp_path / f"{stem}.png").is_file() and (tmp_path / f"{stem}.pdf").is_file()
    assert out.read_text().count("\n") == len(INPUTS) + 1
    assert not (tmp_path / "figures.json").exists()
    assert main(["simulate", "--workload", "qwen2.5-1.5b", "--gpus", "8", "--strategy", "adamw",
                 "--bands"]) == 0
    assert "band" in capsys.readouterr().out
    assert main(["sensitivity", "--figure-dir", str(tmp_path / "none")]) == 2


def test_cli_sensitivity_of_figure_11s_configuration_redraws_it_and_the_index(tmp_path, monkeypatch):
    import json

    import pandas as pd

    import harness.figures as figs
    from harness.figures.sensitivity import CONFIG_COLUMNS

    csv = "qwen2.5-1.5b_8_dmuon_step.csv"  # figure 11's registry entry pointed at a small configuration
    spec = dataclasses.replace(figs.FIGURES["sensitivity"], data=csv)
    monkeypatch.setitem(figs.FIGURES, "sensitivity", spec)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "sensitivity").mkdir(parents=True)
    (tmp_path / "paper_figures").mkdir()
    assert main(["sensitivity", "--workload", "qwen2.5-1.5b", "--gpus", "8", "--csv",
                 f"results/sensitivity/{csv}"]) == 0
    df = pd.read_csv(tmp_path / "results" / "sensitivity" / csv)
    assert set(CONFIG_COLUMNS) <= set(df.columns) and df["gpus"].eq(8).all()
    entry = json.loads((tmp_path / "paper_figures" / "figures.json").read_text())["sensitivity"]
    assert entry["number"] == 11 and entry["data"] == f"results/sensitivity/{csv}"
    assert (tmp_path / "paper_figures" / "sensitivity.png").is_file()
    assert "## 11. Sensitivity" in (tmp_path / "paper_figures" / "index.md").read_text()
