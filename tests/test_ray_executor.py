"""`harness run --executor ray`: the same results.csv bytes (and traces, config.json, provenance.json) as the
local executor, resume across executors, a failing group handled as the local pool handles it; and the
errors for an unknown executor, --address without --executor ray and Ray not installed (these need no Ray).

The Ray tests run on a local Ray instance with 2 CPUs and are skipped where Ray is not installed (the
`ray` extra: pip install 'dmuon-harness[ray]'; CI installs only `dev`)."""

from __future__ import annotations

import json
import os
import sys

import pandas as pd
import pytest
from test_sweep import TINY_WORKLOAD

from dmuon.errors import InputError
from harness.cli import main
from harness.executors import EXECUTORS, RAY_MISSING, LocalExecutor, make_executor
from harness.experiment import load_experiment
from harness.store import JOURNAL
from harness.sweep import run_sweep

GRID = ["--set", "workload=qwen2.5-7b", "--set", "milp_time_limit_s=2", "--no-figures"]


def _run(out, *extra) -> int:
    return main(["run", "paper", *GRID, "--out", str(out), *extra])


def _tracked(out) -> dict[str, bytes]:
    """Every file of a results folder but the untracked .provenance/ (wall times, host, executor)."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".provenance" not in p.relative_to(out).parts
    }


# ---- errors (no Ray needed) ------------------------------------------------------------------------
def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_unknown_executor_lists_the_accepted_ones(tmp_path, capsys):
    assert main(["run", "paper", "--executor", "dask", "--out", str(tmp_path / "o")]) == 2
    assert "unknown executor 'dask'; accepted: local, ray" in _one_line_error(capsys)
    assert not (tmp_path / "o").exists()
    assert EXECUTORS == ("local", "ray")


def test_address_needs_the_ray_executor(tmp_path, capsys):
    assert main(["run", "paper", "--address", "head:6379", "--out", str(tmp_path / "o")]) == 2
    err = _one_line_error(capsys)
    assert "--address 'head:6379'" in err and "needs --executor ray" in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(InputError, match="needs --executor ray"):
        run_sweep(load_experiment("paper"), tmp_path / "o", executor="local", address="head:6379")


def test_ray_missing_names_the_extra_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without Ray
    assert main(["run", "paper", "--executor", "ray", "--out", str(tmp_path / "o")]) == 2
    err = _one_line_error(capsys)
    assert "pip install 'dmuon-harness[ray]'" in err and "pip install ray" in err
    with pytest.raises(InputError) as e:
        run_sweep(load_experiment("paper", ["workload=qwen2.5-7b"]), tmp_path / "o", executor="ray")
    assert str(e.value) == RAY_MISSING
    assert not (tmp_path / "o").exists()  # nothing written before the error
    assert isinstance(make_executor("local", jobs=3), LocalExecutor)  # local never imports Ray


def test_a_worker_of_other_code_runs_nothing(monkeypatch):
    """The body of a Ray task (plain Python, tested here without Ray): a worker whose code version is not
    the driver's hands back an error naming its host, and no rows."""
    import platform

    from harness import executors
    from harness.errors import RunFailed

    monkeypatch.setattr(executors, "_WORKER_CODE", "0123456789ab")
    group, ctx = [{"run_id": "x"}], {"traces": []}
    rows, error, files, host = executors.ray_group("simulate", group, ctx, "fedcba987654")
    assert rows == [] and files == {} and host == platform.node() and isinstance(error, RunFailed)
    assert "runs code version 0123456789ab, the driver fedcba987654" in str(error) and host in str(error)


# ---- on a local Ray instance with 2 CPUs -----------------------------------------------------------
def test_ray_writes_the_local_executors_bytes_and_resumes(tmp_path, capsys):
    ray = pytest.importorskip("ray")
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    local, by_ray, mixed = tmp_path / "local", tmp_path / "ray", tmp_path / "mixed"
    assert _run(local, "--set", "gpus=[8,16]", "--jobs", "1") == 0
    # no --address: the executor starts a local instance with --jobs CPUs, and shuts it down
    assert _run(by_ray, "--set", "gpus=[8,16]", "--executor", "ray", "--jobs", "2") == 0
    assert not ray.is_initialized() and os.environ.get("RAY_AUTH_MODE") == auth_mode
    a, b = _tracked(local), _tracked(by_ray)
    assert (by_ray / "results.csv").read_bytes() == (local / "results.csv").read_bytes()
    assert a == b and len(pd.read_csv(local / "results.csv")) == 6
    assert "traces/qwen2.5-7b_8_a800_dmuon.json" in b  # written on a worker, shipped back
    run = json.loads((by_ray / ".provenance" / "run.json").read_text())
    assert run["executor"] == "ray" and run["ray_address"] == "local instance" and run["rows_run"] == 6
    capsys.readouterr()
    # resume with the ray executor: nothing runs (and no Ray starts)
    assert _run(by_ray, "--set", "gpus=[8,16]", "--executor", "ray") == 0
    assert "(0 run, 6 already done)" in capsys.readouterr().out
    assert _tracked(by_ray) == a
    # half the sweep by the local executor, the rest by ray: the same bytes again
    assert _run(mixed, "--set", "gpus=[8]", "--jobs", "1") == 0
    assert _run(mixed, "--set", "gpus=[8,16]", "--executor", "ray", "--jobs", "2") == 0
    assert "(3 run, 3 already done)" in capsys.readouterr().out
    assert _tracked(mixed) == a


@pytest.fixture
def ray_instance():
    """A local Ray instance started by the caller (the executor uses it and leaves it running)."""
    ray = pytest.importorskip("ray")
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth_mode




def test_a_failing_group_keeps_whole_rows_and_raises_on_the_driver(ray_instance, tmp_path):
    wl, exp = tmp_path / "tiny.toml", tmp_path / "exp.toml"
    wl.write_text(TINY_WORKLOAD)
    exp.write_text(f"""
description = "every group fails at its second row"
runner = "simulate"
[fixed]
workload = "{wl}"
gpu = "a800"
seq_len = 64
[axes]
gpus = [1, 2]
micro_batch = [1, -1]
""")
    out = tmp_path / "out"
    with pytest.raises(InputError, match="micro_batch must be an integer >= 1, got -1"):
        run_sweep(load_experiment(str(exp)), out, executor="ray", jobs=2)
    assert ray_instance.is_initialized()  # the caller's Ray stays up
    df = pd.read_csv(out / "results.csv")
    assert 1 <= len(df) <= 2 and set(df["micro_batch"]) == {1} and df["step_s"].notna().all()
    assert not (out / JOURNAL).exists()
    # fixed, the sweep resumes from the rows stored: only the rest runs
    exp.write_text(exp.read_text().replace("micro_batch = [1, -1]", "micro_batch = [1, 2]"))
    s = run_sweep(load_experiment(str(exp)), out, executor="ray", jobs=2)
    assert (s.ran, s.skipped, s.total) == (4 - len(df), len(df), 4)
    local = run_sweep(load_experiment(str(exp)), tmp_path / "local", jobs=1)
    assert (out / "results.csv").read_bytes() == (local.out_dir / "results.csv").read_bytes()
