"""The sweep: experiment files, expansion, --set overrides, resume, whole-row storage, the runners."""

import json
import shutil

import pandas as pd
import pytest

import simulator.api
from dmuon.errors import InputError
from harness import sweep
from harness.experiment import expand, experiment_names, load_experiment, parse_overrides, run_id
from harness.runners import get_runner, kernel_shape, measure_kernels
from harness.store import JOURNAL, ResultStore
from harness.sweep import run_sweep

TINY_WORKLOAD = """
name = "tiny"
[[matrices]]
name = "embed"
rows = 512
cols = 64
optimizer = "adamw"
[[matrices]]
name = "wq"
rows = 64
cols = 64
count = 2
[[matrices]]
name = "w_up"
rows = 64
cols = 192
count = 2
"""


@pytest.fixture
def tiny(tmp_path):
    wl = tmp_path / "tiny.toml"
    wl.write_text(TINY_WORKLOAD)
    exp = tmp_path / "tinyexp.toml"
    exp.write_text(f"""
description = "tiny"
runner = "simulate"
[fixed]
workload = "{wl}"
gpu = "a800"
seq_len = 64
micro_batch = 1
[axes]
gpus = [1, 2]
strategy = ["adamw", "naive", "dmuon"]
""")
    return exp


@pytest.fixture
def count_runs(monkeypatch):
    calls = []
    real = simulator.api.run

    def counting(cfg, **kwargs):
        calls.append(cfg)
        return real(cfg, **kwargs)

    monkeypatch.setattr(simulator.api, "run", counting)
    return calls


def test_every_shipped_experiment_expands():
    sizes = {n: len(expand(load_experiment(n))) for n in experiment_names()}
    assert sizes["paper"] == 4 * 6 * 3
    assert sizes["ablation"] == 4 * 2 * 11  # 10 paper variants + "+split"
    assert sizes["balancers"] == 4 * 6 * 3
    assert sizes["kernels"] == 3
    assert sizes["moe"] == 3 * 2 * 2 * 3  # models x clusters x GPU counts x strategies
    assert sizes["moe_ep"] == 3 * 3 * 5  # models x rank counts x EP degrees
    assert sizes["scaling"] == 2 * 8 * 3 + 6 * 3 + 3 * 3 + 8 * 2  # ... + the split grid (dmuon only)


def test_expansion_is_the_product_with_fixed_settings(tiny):
    rows = expand(load_experiment(str(tiny)))
    assert [(r["gpus"], r["strategy"]) for r in rows] == [
        (g, s) for g in (1, 2) for s in ("adamw", "naive", "dmuon")
    ]
    assert all(r["seq_len"] == 64 and r["gpu"] == "a800" for r in rows)
    assert list(rows[0])[:3] == ["workload", "gpus", "gpu"]  # lead columns first
    assert len({run_id(r) for r in rows}) == 6


def test_overrides_make_axes_or_fix_values(tiny):
    exp = load_experiment(str(tiny), ["gpus=[1, 2, 4]", "strategy=dmuon", "seq_len=32"])
    rows = expand(exp)
    assert [r["gpus"] for r in rows] == [1, 2, 4]
    assert {r["strategy"] for r in rows} == {"dmuon"} and {r["seq_len"] for r in rows} == {32}
    assert exp.overrides == {"gpus": [1, 2, 4], "strategy": "dmuon", "seq_len": 32}
    assert parse_overrides(["workload=pi0", "overlap=false", 'gpu="h200"']) == {
        "workload": "pi0",
        "overlap": False,
        "gpu": "h200",
    }
    assert parse_overrides(["workload=[qwen2.5-7b, pi0]", "gpus=[8,16]", "x=[a800, 8, true]"]) == {
        "workload": ["qwen2.5-7b", "pi0"],
        "gpus": [8, 16],
        "x": ["a800", 8, True],
    }


@pytest.mark.parametrize(
    "bad, message",
    [
        ("gpus", "expected key=value"),
        ("=3", "expected key=value"),
        ("gpus=[8,", "is not a TOML value"),
        ("gpus=[[8]]x", "is not a TOML value"),
        ("workload=two words", "is not a TOML value"),
        ("gpus=[]", "is empty"),
        ("warp_speed=9", "unknown setting for experiment 'tinyexp'"),
        ("variant=fast", "not a variant"),
    ],
)
def test_bad_overrides_raise_input_error(tiny, bad, message):
    with pytest.raises(InputError, match=message):
        load_experiment(str(tiny), [bad])


def test_unknown_keys_in_the_file_name_the_file_and_key(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text('runner = "simulate"\n[fixed]\nworkload = "pi0"\ngpuz = 8\n[axes]\ngpus = [8]\n')
    with pytest.raises(InputError, match=r"x\.toml: unknown setting 'gpuz' in \[fixed\]"):
        load_experiment(str(p))
    p.write_text('runner = "simulate"\nsweeps = 3\n')
    with pytest.raises(InputError, match=r"x\.toml: unknown key 'sweeps'"):
        load_experiment(str(p))
    p.write_text('runner = "simulate"\n[axes]\ngpus = []\n')
    with pytest.raises(InputError, match="empty"):
        load_experiment(str(p))
    p.write_text('runner = "teleport"\n')
    with pytest.raises(InputError, match="unknown runner 'teleport'"):
        load_experiment(str(p))
    with pytest.raises(InputError, match="unknown experiment 'nope'; accepted: ablation"):
        load_experiment("nope")


def test_variants_and_grids(tmp_path):
    p = tmp_path / "v.toml"
    p.write_text("""
runner = "simulate"
[fixed]
workload = "pi0"
[[grid]]
name = "a"
axes = { variant = ["slow", "fast"], gpus = [8] }
[[grid]]
name = "b"
fixed = { gpus = 16 }
axes = { strategy = ["adamw", "naive"] }
[variants.slow]
strategy = "naive"
[variants.fast]
strategy = "dmuon"
batching = false
""")
    rows = expand(load_experiment(str(p)))
    assert [(r["grid"], r.get("variant"), r["strategy"], r["gpus"]) for r in rows] == [
        ("a", "slow", "naive", 8),
        ("a", "fast", "dmuon", 8),
        ("b", None, "adamw", 16),
        ("b", None, "naive", 16),
    ]
    assert rows[1]["batching"] is False and rows[0]["batching"] is True
    p.write_text(
        p.read_text().replace(
            'axes = { variant = ["slow", "fast"], gpus = [8] }',
            'axes = { variant = ["slow"], strategy = ["adamw"] }',
        )
    )
    with pytest.raises(InputError, match="also axes"):
        expand(load_experiment(str(p)))


def test_results_schema_and_resume_skips_finished_rows(tiny, tmp_path, count_runs):
    out = tmp_path / "out"
    exp = load_experiment(str(tiny))
    s = run_sweep(exp, out, jobs=1)
    assert (s.ran, s.skipped, len(count_runs)) == (6, 0, 6)
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 6 and df["run_id"].is_unique
    for col in (
        "gpus",
        "strategy",
        "workload",
        "seq_len",
        "run_id",
        "step_s",
        "optimizer_s",
        "forward_s",
        "tokens_per_s",
        "ns_makespan_s",
        "profile",
        "kind",
    ):
        assert col in df.columns
    assert df["step_s"].gt(0).all() and set(df["kind"]) == {"simulated"}
    prov = json.loads((out / "provenance.json").read_text())
    for key in ("project_version", "profiles", "kind", "command", "rows"):
        assert key in prov
    assert prov["profiles"] == ["a800"] and prov["kind"] == "simulated"
    # what changes from run to run is kept out of the tracked files, in .provenance/ (not tracked)
    assert not {"git_commit", "host", "date_utc", "wall_s"} & set(prov)
    assert not {"code", "sim_wall_s"} & set(pd.read_csv(out / "results.csv").columns)
    run = json.loads((out / ".provenance" / "run.json").read_text())
    for key in ("git_commit", "git_dirty", "code_version", "host", "cpu", "date_utc", "wall_s", "jobs"):
        assert key in run
    assert json.loads((out / "config.json").read_text())["rows"] == 6
    s = run_sweep(load_experiment(str(tiny)), out, jobs=1)
    assert (s.ran, s.skipped, len(count_runs)) == (0, 6, 6)
    s = run_sweep(load_experiment(str(tiny), ["gpus=[1, 2, 4]"]), out, jobs=1)
    assert (s.ran, s.skipped, len(count_runs)) == (3, 6, 9)
    assert len(pd.read_csv(out / "results.csv")) == 9
    s = run_sweep(load_experiment(str(tiny), ["gpus=[1, 2, 4]"]), out, jobs=1, resume=False)
    assert (s.ran, len(count_runs)) == (9, 18)
    assert {r["code"] for r in ResultStore(out).read_rows()} == {sweep.code_version()}


def test_rows_stored_by_other_code_are_run_again(tiny, tmp_path, count_runs, monkeypatch):
    out = tmp_path / "out"
    run_sweep(load_experiment(str(tiny)), out, jobs=1)
    monkeypatch.setattr(sweep, "code_version", lambda: "0123456789ab")
    s = run_sweep(load_experiment(str(tiny)), out, jobs=1)
    assert (s.ran, s.skipped, s.stale, len(count_runs)) == (6, 0, 6, 12)
    assert {r["code"] for r in ResultStore(out).read_rows()} == {"0123456789ab"}
    assert all(r["sim_wall_s"] > 0 for r in ResultStore(out).read_rows())


def test_rows_of_unknown_code_are_run_again_into_the_same_bytes(tiny, tmp_path, count_runs):
    """A fresh clone has results.csv but no .provenance/: every row runs again, and results.csv and
    provenance.json come out byte for byte as they were (git status stays clean)."""
    out = tmp_path / "out"
    run_sweep(load_experiment(str(tiny)), out, jobs=1)
    tracked = {p: (out / p).read_bytes() for p in ("results.csv", "provenance.json", "config.json")}
    shutil.rmtree(out / ".provenance")
    s = run_sweep(load_experiment(str(tiny)), out, jobs=1)
    assert (s.ran, s.skipped, s.stale, len(count_runs)) == (6, 0, 6, 12)
    assert {p: (out / p).read_bytes() for p in tracked} == tracked
    s = run_sweep(load_experiment(str(tiny)), out, jobs=1)  # the row provenance is back: resume skips
    assert (s.ran, s.skipped) == (0, 6)
    with open(out / "results.csv", "a") as f:  # results.csv changed without it (git pull): rows run again
        f.write("\n")
    s = run_sweep(load_experiment(str(tiny)), out, jobs=1)
    assert (s.ran, s.stale) == (6, 6) and {p: (out / p).read_bytes() for p in tracked} == tracked


def test_interrupted_sweep_leaves_only_whole_rows(tiny, tmp_path, monkeypatch):
    real = simulator.api.run
    calls = []

    def flaky(cfg, **kwargs):
        calls.append(cfg)
        if len(calls) == 3:
            raise RuntimeError("node lost")
        return real(cfg, **kwargs)

    monkeypatch.setattr(simulator.api, "run", flaky)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="node lost"):
        run_sweep(load_experiment(str(tiny)), out, jobs=1)
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 2 and df[["step_s", "optimizer_s", "run_id"]].notna().all().all()
    assert not (out / JOURNAL).exists()
    s = run_sweep(load_experiment(str(tiny)), out, jobs=1)
    assert (s.ran, s.skipped) == (4, 2) and len(pd.read_csv(out / "results.csv")) == 6


def test_a_torn_journal_line_is_ignored(tmp_path):
    store = ResultStore(tmp_path)
    store.append([{"run_id": "a", "x": 1}, {"run_id": "b", "x": 2}])
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('{"run_id": "c", "x"')  # the process died mid-write
    assert store.finished_ids() == {"a", "b"}
    assert store.finalize(["a", "b", "c"], ["run_id", "x"]) == 2
    assert list(pd.read_csv(tmp_path / "results.csv")["run_id"]) == ["a", "b"]


def test_parallel_workers_give_the_same_rows(tiny, tmp_path):
    one = run_sweep(load_experiment(str(tiny)), tmp_path / "one", jobs=1)
    two = run_sweep(load_experiment(str(tiny)), tmp_path / "two", jobs=2)
    a, b = (pd.read_csv(x.out_dir / "results.csv") for x in (one, two))
    cols = ["run_id", "step_s", "optimizer_s", "ns_makespan_s", "comm_bytes_per_rank"]
    pd.testing.assert_frame_equal(a[cols], b[cols])


def test_naive_ns_method_switch():
    from simulator.api import SimConfig, simulate

    std = simulate(SimConfig(workload="pi0", gpus=8, strategy="naive"))
    sym = simulate(SimConfig(workload="pi0", gpus=8, strategy="naive", naive_ns_method="gram_sym"))
    assert sym.ns_makespan_s < 0.95 * std.ns_makespan_s
    assert sym.step_s - std.step_s == pytest.approx(sym.ns_makespan_s - std.ns_makespan_s, rel=1e-6)
    auto = simulate(SimConfig(workload="pi0", gpus=8, strategy="naive", naive_ns_method="auto"))
    assert auto.ns_makespan_s <= min(std.ns_makespan_s, sym.ns_makespan_s) + 1e-12  # cheapest per shape
    with pytest.raises(InputError, match="unknown naive NS method 'fastest'"):
        simulate(SimConfig(workload="pi0", gpus=8, strategy="naive", naive_ns_method="fastest"))


def test_plan_runner_rows(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY_WORKLOAD)
    runner = get_runner("plan")
    rows = list(
        runner.run_group(
            [
                {**runner.settings, "workload": str(tmp_path / "tiny.toml"), "gpus": 3, "balancer": b}
                for b in ("round_robin", "lpt")
            ],
            {},
        )
    )
    for r in rows:
        loads = json.loads(r["loads_s"])
        assert len(loads) == 3 and max(loads) == pytest.approx(r["makespan_s"], rel=1e-6, abs=1e-9)  # ns
        assert r["lower_bound_s"] <= r["makespan_s"] * (1 + 1e-9)
        assert 0 < r["efficiency"] <= 1 + 1e-9
    assert rows[1]["makespan_s"] <= rows[0]["makespan_s"] * (
        1 + 1e-9
    )  # LPT never worse than round-robin here


def test_kernel_measurement_row():
    assert kernel_shape("qwen2.5-7b", "q_proj", 8) == (448, 448, 28)
    assert kernel_shape("qwen2.5-7b", "down_proj", 8)[:2] == (448, 2368)  # (18944, 3584): NS shape (min, max)
    with pytest.raises(InputError, match="no Muon matrix 'lm_head'"):
        kernel_shape("qwen2.5-7b", "lm_head", 8)
    s = {
        **get_runner("measure-kernels").settings,
        "matrix": "k_proj",
        "scale": 32,
        "repeats": 1,
        "max_batch": 3,
    }
    r = measure_kernels(s)
    assert (r["n"], r["m"], r["batch"]) == (16, 112, 3)
    for col in (
        "standard_jordan_s",
        "gram_jordan_s",
        "standard_polar_s",
        "gram_polar_s",
        "loop_s",
        "batched_s",
    ):
        assert r[col] > 0
    assert r["gram_speedup_jordan"] == pytest.approx(r["standard_jordan_s"] / r["gram_jordan_s"])
    assert r["device"].startswith("measured on ") and r["kind"] == "measured"


def test_rows_sharing_a_plan_build_it_once(tiny, tmp_path, monkeypatch):
    import dmuon.plan.build

    built = []
    real = dmuon.plan.build.build_plan

    def counting(*args, **kwargs):
        built.append(kwargs.get("balancer"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dmuon.plan.build, "build_plan", counting)
    exp = load_experiment(
        str(tiny),
        [
            "gpus=[2, 3]",
            "strategy=[adamw, naive, dmuon]",
            "overlap=[true, false]",
            "balancer=milp",
            "milp_time_limit_s=1",
        ],
    )
    s = run_sweep(exp, tmp_path / "out", jobs=1)
    assert s.ran == 12
    assert len(built) == 2  # one plan per GPU count: overlap on/off and the other strategies reuse it


def test_every_rank_is_simulated_only_where_a_trace_is_written(tiny, tmp_path, monkeypatch):
    seen = []
    real = simulator.api.run

    def recording(cfg, all_ranks=True):
        seen.append((cfg.gpus, cfg.strategy, all_ranks))
        return real(cfg, all_ranks=all_ranks)

    monkeypatch.setattr(simulator.api, "run", recording)
    tiny.write_text(tiny.read_text() + "[[trace]]\ngpus = 2\nstrategy = \"dmuon\"\n")
    s = run_sweep(load_experiment(str(tiny)), tmp_path / "out", jobs=1)
    assert s.ran == 6 and len(seen) == 6
    assert {(g, st) for g, st, every in seen if every} == {(2, "dmuon")}
    rows = pd.read_csv(tmp_path / "out" / "results.csv")
    assert rows["trace_file"].notna().sum() == 1
    # the representative-rank rows are the all-rank results (tests/test_sim_multinode.py checks every field)
    full = real(simulator.api.SimConfig(workload=str(tmp_path / "tiny.toml"), gpus=2, strategy="naive",
                                        gpu="a800", seq_len=64, micro_batch=1))[0]
    naive2 = rows[(rows.gpus == 2) & (rows.strategy == "naive")].iloc[0]
    assert naive2["step_s"] == pytest.approx(full.step_s, rel=1e-9)
