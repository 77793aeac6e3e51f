"""Data safety: an interrupted `harness run` (SIGKILL, Ctrl-C, a raising row) keeps exactly its finished
rows and resume computes only the rest; every file is written atomically (the shared dmuon.io helper,
and no other writer in the project); a corrupt figure index is rebuilt."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from workloads import TINY

import simulator.api
from dmuon.io import atomic_path, atomic_write_bytes, atomic_write_text
from harness.experiment import load_experiment
from harness.store import JOURNAL, ResultStore
from harness.sweep import run_sweep

ROOT = Path(__file__).resolve().parent.parent
KEY = ["gpus", "strategy"]
METRICS = ["step_s", "optimizer_s", "forward_s", "ns_makespan_s", "comm_bytes_per_rank"]
# a child `harness run` whose rows take 1 s each, so it can be stopped mid-sweep
CHILD = """
import signal, sys, time
# as from an interactive shell: a test suite started in the background (`make test &`) hands its children
# SIGINT ignored, and Python then installs no KeyboardInterrupt handler
signal.signal(signal.SIGINT, signal.default_int_handler)
import simulator.api as api
real = api.run
def slow(cfg, **kwargs):
    time.sleep(1.0)  # wide enough that a loaded CI machine still interrupts mid-sweep
    return real(cfg, **kwargs)
api.run = slow
from harness.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def exp(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    path = tmp_path / "exp.toml"
    path.write_text(f'runner = "simulate"\n[fixed]\nworkload = "{tmp_path / "tiny.toml"}"\nseq_len = 64\n'
                    'micro_batch = 1\n[axes]\ngpus = [1, 2, 4, 8]\nstrategy = ["adamw", "naive", "dmuon"]\n')
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 12 rows of an uninterrupted run (the simulator is deterministic)."""
    d = tmp_path_factory.mktemp("ref")
    (d / "tiny.toml").write_text(TINY)
    path = d / "exp.toml"
    path.write_text(f'runner = "simulate"\n[fixed]\nworkload = "{d / "tiny.toml"}"\nseq_len = 64\n'
                    'micro_batch = 1\n[axes]\ngpus = [1, 2, 4, 8]\nstrategy = ["adamw", "naive", "dmuon"]\n')
    run_sweep(load_experiment(str(path)), d / "out", jobs=1)
    return pd.read_csv(d / "out" / "results.csv").set_index(KEY).sort_index()


def _start_child(exp: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, "run", str(exp), "--out", str(out), "--no-figures", "--jobs", "1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _wait_for_rows(out: Path, proc: subprocess.Popen, n: int, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        journal = out / JOURNAL
        if journal.exists() and journal.read_text().count("\n") >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the child wrote fewer than {n} rows in {timeout_s} s")


def _resume_and_check(exp: Path, out: Path, kept: set[str], reference: pd.DataFrame, monkeypatch) -> None:
    calls = []
    real = simulator.api.run

    def counting(cfg, **kwargs):
        calls.append(cfg)
        return real(cfg, **kwargs)

    monkeypatch.setattr(simulator.api, "run", counting)
    s = run_sweep(load_experiment(str(exp)), out, jobs=1)
    assert (s.skipped, s.ran, len(calls)) == (len(kept), 12 - len(kept), 12 - len(kept))
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 12 and df["run_id"].is_unique and set(kept) <= set(df["run_id"])
    pd.testing.assert_frame_equal(df.set_index(KEY).sort_index()[METRICS], reference[METRICS])
    assert not (out / JOURNAL).exists()
    # no temp file left behind (.provenance/ holds the untracked run and row provenance, nothing else)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".provenance"]
    assert sorted(p.name for p in (out / ".provenance").iterdir()) == ["rows.json", "run.json"]


def test_sigkill_mid_sweep_keeps_the_finished_rows_and_resume_runs_the_rest(exp, tmp_path, reference,
                                                                              monkeypatch):
    out = tmp_path / "out"
    proc = _start_child(exp, out)
    _wait_for_rows(out, proc, 3)
    os.killpg(proc.pid, signal.SIGKILL)  # no cleanup at all: only the flushed journal survives
    proc.wait(timeout=30)
    kept = {json.loads(line)["run_id"] for line in (out / JOURNAL).read_text().splitlines()}
    assert 3 <= len(kept) < 12
    assert ResultStore(out).finished_ids() == kept
    _resume_and_check(exp, out, kept, reference, monkeypatch)


def test_ctrl_c_mid_sweep_writes_whole_rows_and_resume_runs_the_rest(exp, tmp_path, reference, monkeypatch):
    out = tmp_path / "out"
    proc = _start_child(exp, out)
    _wait_for_rows(out, proc, 2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"Traceback" not in err, err.decode()[-3000:]  # as any command
    df = pd.read_csv(out / "results.csv")  # finalized on the way out: whole rows only
    assert 2 <= len(df) < 12 and df[["run_id", *METRICS]].notna().all().all()
    assert not (out / JOURNAL).exists()
    _resume_and_check(exp, out, set(df["run_id"]), reference, monkeypatch)


def test_a_raising_row_keeps_the_rows_before_it(exp, tmp_path, reference, monkeypatch):
    real = simulator.api.run
    calls = []

    def flaky(cfg, **kwargs):
        calls.append(cfg)
        if len(calls) == 5:
            raise RuntimeError("node lost")
        return real(cfg, **kwargs)

    monkeypatch.setattr(simulator.api, "run", flaky)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="node lost"):
        run_sweep(load_experiment(str(exp)), out, jobs=1)
    monkeypatch.undo()
    kept = set(pd.read_csv(out / "results.csv")["run_id"])
    assert len(kept) == 4
    _resume_and_check(exp, out, kept, reference, monkeypatch)


# ---- atomic writes ----------------------------------------------------------------------------------
def test_atomic_writes_replace_whole_files_and_leave_nothing_on_failure(tmp_path):
    path = tmp_path / "sub" / "table.csv"
    atomic_write_text(path, "a,b\n1,2\n")  # creates the folder
    assert path.read_text() == "a,b\n1,2\n"
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # not mkstemp's 0o600
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(path) as tmp:
        tmp.write_text("a,b\n3")  # half a file ...
        raise RuntimeError("disk full")  # ... and the writer dies
    assert path.read_text() == "a,b\n1,2\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["table.csv"]
    atomic_write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    with pytest.raises(FileNotFoundError) as e:  # an unwritable folder names the file asked for
        atomic_write_text("/proc/no/such/dir/x.csv", "x")
    assert e.value.filename == "/proc/no/such/dir/x.csv"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# writers that may touch the file system directly, and why (everything else goes through dmuon.io)
ALLOWED = {
    "dmuon/io.py": "the helper itself",
    "dmuon/kernels/autotune.py": "json.dump into dmuon.io.atomic_path's temp file",
    "dmuon/kernels/compile_check.py": "a PTX file in a TemporaryDirectory for ptxas",
    "harness/store.py": "the append-only journal: whole lines, flushed and fsynced; torn last lines ignored",
}
WRITE = re.compile(r"open\([^)]*['\"][wax]b?['\"]|\.to_csv\(|\.savefig\(|\.write_text\(|\.write_bytes\(|"
                   r"\.to_parquet\(|\.to_json\(\s*['\"/]|json\.dump\(|os\.replace\(")


def test_every_writer_in_the_project_is_atomic():
    offenders = []
    for pkg in ("dmuon", "harness", "simulator", "experiments", "scripts"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            text = f.read_text()
            for m in WRITE.finditer(text):
                line = text[: m.start()].count("\n") + 1
                src = text.splitlines()[line - 1]
                near = text[max(0, m.start() - 400): m.start()]
                if rel in ALLOWED or "os.devnull" in src or '"/proc/' in src or "atomic_path" in near:
                    continue
                offenders.append(f"{rel}:{line}: {src.strip()}")
    assert not offenders, "non-atomic writes (use dmuon.io):\n" + "\n".join(offenders)


def test_a_corrupt_figure_index_is_rebuilt_with_a_warning(tmp_path):
    from harness.figures import write_index

    entry = {"number": 8, "name": "kernels", "title": "Kernels", "caption": "measured", "data": "x.csv",
             "files": ["08_kernels.png", "08_kernels.pdf"], "command": "harness run kernels",
             "redraw": "harness figures kernels", "generated_utc": "now"}
    (tmp_path / "figures.json").write_text('{"08_kernels": {"number": 8')  # torn by a crash
    with pytest.warns(UserWarning, match="ignoring corrupt .*figures.json"):
        write_index(tmp_path, [entry])
    assert json.loads((tmp_path / "figures.json").read_text()) == {"08_kernels": entry}
    assert "## 8. Kernels" in (tmp_path / "index.md").read_text()
    (tmp_path / "figures.json").write_text('{"01_x": {"number": 1}}')  # valid JSON, not an index
    with pytest.warns(UserWarning, match="not a map of figure entries"):
        write_index(tmp_path, [entry])
    assert list(json.loads((tmp_path / "figures.json").read_text())) == ["08_kernels"]
