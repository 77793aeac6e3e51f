"""Same simulation, same bytes: `harness run` and `harness figures` write into tracked files only what the
same code and inputs reproduce, so `make run` on a fresh clone leaves `git status` clean. What changes
from run to run (git commit, host, date, wall times, each row's code version) goes to `.provenance/`
beside the table, which git does not track."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from harness.cli import main
from harness.figures import render_experiment
from harness.store import VOLATILE, ResultStore

ROOT = Path(__file__).resolve().parents[1]
# 3 rows (adamw, naive, dmuon) of the paper experiment, with its Chrome traces; well under a second
SUBSET = ["run", "paper", "--set", "workload=qwen2.5-7b", "--set", "gpus=8", "--jobs", "1", "--no-figures"]


def _tracked_bytes(out: Path) -> dict[str, bytes]:
    """Every file under `out` except the untracked .provenance/."""
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".provenance" not in p.relative_to(out).parts
    }


@pytest.fixture(scope="module")
def paper_subset(tmp_path_factory):
    out = tmp_path_factory.mktemp("det") / "paper"
    assert main([*SUBSET, "--out", str(out)]) == 0
    return out


def test_a_rerun_from_a_fresh_clone_rewrites_the_same_bytes(paper_subset, tmp_path, capsys):
    out = tmp_path / "paper"
    shutil.copytree(paper_subset, out)
    first = _tracked_bytes(out)
    assert {"results.csv", "config.json", "provenance.json"} <= set(first)
    assert any(k.startswith("traces/") for k in first)
    shutil.rmtree(out / ".provenance")  # a fresh clone: the tables without their volatile provenance
    capsys.readouterr()
    assert main([*SUBSET, "--out", str(out)]) == 0
    assert "3 run, 0 already done; 3 stored rows were from other or unknown code" in capsys.readouterr().out
    assert _tracked_bytes(out) == first
    assert main([*SUBSET, "--out", str(out)]) == 0  # resumed: nothing runs, nothing changes
    assert "(0 run, 3 already done)" in capsys.readouterr().out
    assert _tracked_bytes(out) == first


def test_volatile_fields_stay_out_of_the_tracked_files(paper_subset):
    df = pd.read_csv(paper_subset / "results.csv")
    assert not set(VOLATILE) & set(df.columns)
    prov = json.loads((paper_subset / "provenance.json").read_text())
    assert not {"git_commit", "git_dirty", "host", "cpu", "python", "date_utc", "wall_s", "jobs",
                "load_1m_at_end"} & set(prov)
    assert prov["command"] == "harness run paper --set gpus=8 --set workload=qwen2.5-7b"
    assert "code" not in json.loads((paper_subset / "config.json").read_text())["columns"]
    # ... and are still there for whoever wants them, and for resume
    run = json.loads((paper_subset / ".provenance" / "run.json").read_text())
    assert run["wall_s"] >= 0 and run["git_commit"] and run["command_line"].startswith("harness run paper")
    rows = ResultStore(paper_subset).read_rows()
    assert len(rows) == 3 and all(r["code"] and r["sim_wall_s"] > 0 for r in rows)


def test_figures_are_written_without_timestamps(paper_subset, tmp_path):
    names = ["optimizer_time", "step_speedup"]
    a, b = tmp_path / "a", tmp_path / "b"
    render_experiment("paper", paper_subset.parent, a, names, results_dir=paper_subset)
    render_experiment("paper", paper_subset.parent, b, names, results_dir=paper_subset)
    files = sorted(p.name for p in a.iterdir())
    assert files == ["01_optimizer_time.pdf", "01_optimizer_time.png", "02_step_speedup.pdf",
                     "02_step_speedup.png", "figures.json", "index.md"]
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    pdf = (a / "01_optimizer_time.pdf").read_bytes()
    assert b"/CreationDate" not in pdf and b"/ModDate" not in pdf and b"Matplotlib" not in pdf
    assert b"Software" not in (a / "01_optimizer_time.png").read_bytes()
    assert all("generated_utc" not in e for e in json.loads((a / "figures.json").read_text()).values())


def test_git_ignores_the_volatile_provenance_and_tracks_the_tables():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0

    assert ignored("results/paper/.provenance/run.json")
    assert ignored("results/moe_ep/.provenance/rows.json")
    assert ignored("my_out/pi0/.provenance/run.json")  # harness run --out anywhere in the tree
    assert not ignored("results/paper/results.csv") and not ignored("results/paper/provenance.json")


def test_committed_tables_hold_no_volatile_fields():
    """The committed results are in the reproducible form (regenerated, or moved over, by this commit's
    code): no code version or wall time in results.csv, no commit, host or date in provenance.json."""
    for prov_file in sorted((ROOT / "results").glob("*/provenance.json")):
        prov = json.loads(prov_file.read_text())
        assert not {"git_commit", "host", "date_utc", "wall_s"} & set(prov), prov_file
    for csv in sorted((ROOT / "results").glob("*/results.csv")):
        assert not set(VOLATILE) & set(pd.read_csv(csv, nrows=1).columns), csv
    figures = json.loads((ROOT / "paper_figures" / "figures.json").read_text())
    assert all("generated_utc" not in e for e in figures.values())
    for pdf in sorted((ROOT / "paper_figures").glob("*.pdf")):
        assert b"/CreationDate" not in pdf.read_bytes(), pdf.name
