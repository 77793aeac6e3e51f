"""The CLI: --help of every command, `harness run paper` end to end on a reduced grid, bad input -> exit 2,
`harness validate` exits 1 when a bound breaks."""

import json

import pandas as pd
import pytest

from harness.cli import main

COMMANDS = [
    ["run"],
    ["simulate"],
    ["plan"],
    ["profile"],
    ["bench", "kernels"],
    ["bench", "step"],
    ["figures"],
    ["validate"],
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_help_of_every_command(cmd, capsys):
    assert main([*cmd, "--help"]) == 0
    assert "Usage" in capsys.readouterr().out


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "paper"
    code = main(
        [
            "run",
            "paper",
            "--set",
            "workload=qwen2.5-7b",
            "--set",
            "gpus=[8,16]",
            "--set",
            "milp_time_limit_s=2",
            "--out",
            str(out),
            "--jobs",
            "1",
        ]
    )
    return code, out


def test_run_paper_on_a_reduced_grid(paper_run):
    code, out = paper_run
    assert code == 0
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 6 and set(df["gpus"]) == {8, 16} and set(df["workload"]) == {"qwen2.5-7b"}
    assert set(df["strategy"]) == {"adamw", "naive", "dmuon"} and set(df["profile"]) == {"a800"}
    piv = df.pivot_table(index="gpus", columns="strategy", values="optimizer_s")
    assert (piv["naive"] > 5 * piv["dmuon"]).all()  # the paper's story holds on this grid
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["kind"] == "simulated" and prov["rows"] == 6
    assert json.loads((out / "config.json").read_text())["overrides"]["gpus"] == [8, 16]
    for stem in ("01_optimizer_time", "02_step_speedup", "06_timeline"):
        assert (out / "figures" / f"{stem}.png").is_file() and (out / "figures" / f"{stem}.pdf").is_file()
    assert "01_optimizer_time.png" in (out / "figures" / "index.md").read_text()
    assert "step speedup DMuon / naive" in (out / "figures" / "comparison.md").read_text()
    assert sorted(p.name for p in (out / "traces").iterdir()) == [
        f"qwen2.5-7b_8_a800_{s}.json" for s in ("adamw", "dmuon", "naive")
    ]


def test_run_resumes(paper_run, capsys):
    code, out = paper_run
    assert (
        main(
            [
                "run",
                "paper",
                "--set",
                "workload=qwen2.5-7b",
                "--set",
                "gpus=[8,16]",
                "--set",
                "milp_time_limit_s=2",
                "--out",
                str(out),
                "--no-figures",
            ]
        )
        == 0
    )
    assert "(0 run, 6 already done)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "paper", "--set", "gpus"], "expected key=value"),
        (["run", "paper", "--set", "colour=red"], "unknown setting for experiment 'paper'"),
        (["run", "nope"], "unknown experiment 'nope'"),
        (["figures", "nope"], "unknown experiment 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_validate_exits_1_when_a_bound_breaks(paper_run, tmp_path, capsys):
    _, out = paper_run
    val = tmp_path / "validation"
    val.mkdir()
    # a measured CPU run 3x slower than the simulator predicts for it: outside the 15% closed-loop bound
    pd.DataFrame(
        [
            {
                "ranks": 1,
                "strategy": "dmuon",
                "overlap": True,
                "width_scale": 0.0625,
                "layers": 2,
                "seq_len": 32,
                "micro_batch": 1,
                "step_s": 30.0,
                "optimizer_s": 10.0,
                "workload": "qwen2.5-7b",
                "threads_per_rank": 1,
                "device": "cpu",
                "load_1m": 0.5,
            }
        ]
    ).to_csv(val / "bench_rows.csv")
    code = main(
        [
            "validate",
            "--no-measure",
            "--out",
            str(val),
            "--paper-results",
            str(out / "results.csv"),
            "--no-figure",
        ]
    )
    assert code == 1
    df = pd.read_csv(val / "validation.csv")
    assert set(df["check"]) == {"published_8xa800", "ns_replay", "headline", "closed_loop",
                                "multinode_public", "memory_formulas", "memory_public", "memory_cpu",
                                "megatron_public"}
    cl = df[df["check"] == "closed_loop"]
    assert list(cl["metric"]) == ["step", "optimizer"] and not cl["within_bound"].any()
    pub = df[df["check"] == "published_8xa800"]
    assert (
        len(pub) == 56 and pub["bounded"].sum() == pub["note"].isna().sum() >= 30
    )  # shown-only rows say why
    assert not pub[pub["label"].str.contains("DDP")]["bounded"].any()
    assert "outside" in capsys.readouterr().out


def test_validate_out_elsewhere_reads_the_committed_closed_loop_rows(tmp_path):
    # --out outside results/validation, no bench rows there: the committed validation rows are read, not
    # the first table under results/bench (another bench set-up, outside the closed loop's bounds)
    main(["validate", "--no-measure", "--no-figure", "--out", str(tmp_path / "v")])
    cl = pd.read_csv(tmp_path / "v" / "validation.csv").query("check == 'closed_loop'")
    assert len(cl) and cl["note"].str.contains("stored rows results/validation/bench_rows.csv").all()
