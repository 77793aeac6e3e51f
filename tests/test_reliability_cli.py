"""The CLI under bad input: every command answers a bad value with one line ("error: ... accepted ...")
and exit code 2, never a traceback; hypothesis fuzzes the options of simulate / plan / run --set and the
custom-workload loader; `bench step` exits non-zero, in bounded time, when a worker process dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workloads import TINY

from dmuon.errors import InputError
from harness.cli import main
from harness.runners import RUNNERS
from simulator.models.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    w = {
        "tiny.toml": TINY,
        "bad_toml.toml": 'runner = "simulate"\n[fixed\n',
        "unknown_top.toml": 'runner = "simulate"\ncolour = 3\n[axes]\ngpus = [8]\n',
        "unknown_setting.toml": 'runner = "simulate"\n[fixed]\ngpuz = 8\n[axes]\ngpus = [8]\n',
        "empty_axis.toml": 'runner = "simulate"\n[axes]\ngpus = []\n',
        "wl_zero.toml": 'name = "w"\n[[matrices]]\nname = "a"\nrows = 0\ncols = 8\n',
        "wl_float.toml": 'name = "w"\n[[matrices]]\nname = "a"\nrows = 4.5\ncols = 8\n',
        "wl_unknown.toml": 'name = "w"\n[[matrices]]\nname = "a"\nrows = 8\ncols = 8\nshape = 3\n',
        "wl_sup.csv": "matrix,rows,cols\nq,\u00b2,8\n",
        "wl_neg.csv": "matrix,rows,cols\nq,-8,8\n",
        "prof_neg.toml": (ROOT / "simulator/profiles/a800.toml").read_text().replace(
            "nvlink_GBps = { value = 200.0", "nvlink_GBps = { value = -200.0"),
        "prof_unknown.toml": (ROOT / "simulator/profiles/a800.toml").read_text().replace(
            "gpus_per_node = 8", 'gpus_per_node = 8\ncolour = "red"'),
        "cost_neg.csv": "device,op,rows,cols,batch,method,dtype,time_s,source\ncpu,ns,8,8,1,gram,fp32,-1,x\n",
        "other_results.csv": "a,b\n1,2\n",
    }
    for name, text in w.items():
        (d / name).write_text(text)
    (d / "binary.toml").write_bytes(b"\xff\xfe\x00garbage")
    (d / "res" / "paper").mkdir(parents=True)
    (d / "res" / "paper" / "results.csv").write_text("a,b\n1,2\n")
    return d


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# (argv with {d} for the files folder, regex the one-line message must match)
BAD = [
    (["run", "nope"], r"unknown experiment 'nope'; accepted: ablation, .*<path>\.toml"),
    (["run", "{d}/missing.toml"], r"experiment file .*missing\.toml' does not exist"),
    (["run", "{d}/bad_toml.toml"], r"bad_toml\.toml: not valid TOML: Expected"),
    (["run", "{d}/binary.toml"], r"binary\.toml: not valid TOML"),
    (["run", "{d}/unknown_top.toml"], r"unknown_top\.toml: unknown key 'colour'; accepted: description"),
    (["run", "{d}/unknown_setting.toml"],
     r"unknown_setting\.toml: unknown setting 'gpuz' in \[fixed\]; accepted"),
    (["run", "{d}/empty_axis.toml"], r"axis 'gpus' is empty, so the sweep has no rows"),
    (["run", "paper", "--set", "gpus"], r"--set 'gpus': expected key=value"),
    (["run", "paper", "--set", "gpus=[8,"], r"not a TOML value .* or a list of them"),
    (["run", "paper", "--set", "gpus=[]"], r"axis 'gpus' is empty"),
    (["run", "paper", "--set", "gpus={a=1}"], r"a table or nested list is not a setting value"),
    (["run", "paper", "--set", "colour=red"], r"--set colour: unknown setting .* accepted: workload, gpus"),
    (["run", "paper", "--jobs", "0"], r"--jobs must be >= 1"),
    (["run", "paper", "--set", "workload=pi0", "--set", "gpus=[12]", "--out", "{d}/o1", "--no-figures"],
     r"gpus=12 is not a whole number of 8-GPU nodes .*nearest: 8 or 16"),
    (["run", "paper", "--set", "workload=pi0", "--set", "gpus=[-8]", "--out", "{d}/o2", "--no-figures"],
     r"gpus must be an integer >= 1"),
    (["run", "paper", "--set", "workload=pi0", "--set", "gpus=[8]", "--set", "gram=yes", "--out", "{d}/o3",
      "--no-figures"], r"gram must be true, false"),
    (["run", "paper", "--set", "workload=pi0", "--set", "gpus=[8]", "--out", "{d}/tiny.toml", "--no-figures"],
     r"--out .*tiny\.toml' is a file; give a folder"),
    (["run", "paper", "--set", "workload=pi0", "--set", "gpus=[8]", "--out", "/proc/nope/x", "--no-figures"],
     r"cannot use '/proc/nope"),
    (["simulate", "--workload", "nope"], r"unknown workload 'nope'; accepted: qwen2\.5-7b"),
    (["simulate", "--gpus", "0"], r"gpus must be an integer >= 1"),
    (["simulate", "--gpus", "12"], r"not a whole number of 8-GPU nodes"),
    (["simulate", "--gpu", "b200"], r"unknown gpu profile 'b200'; accepted: a100, a800"),
    (["simulate", "--gpu", "{d}/missing.toml"], r"gpu profile file .* does not exist; accepted"),
    (["simulate", "--gpu", "{d}/prof_neg.toml"], r"nvlink_GBps must be a non-negative number, got -200"),
    (["simulate", "--gpu", "{d}/prof_unknown.toml"], r"prof_unknown\.toml: unknown key 'colour'; accepted"),
    (["simulate", "--nic-gbps", "-5", "--gpus", "16"], r"--nic-gbps must be a positive number"),
    (["simulate", "--overlap-slowdown", "nan"], r"--overlap-slowdown must be a finite number >= 0"),
    (["simulate", "--workload", "{d}/wl_zero.toml"],
     r"matrices\[0\]: rows must be a positive integer, got 0"),
    (["simulate", "--workload", "{d}/wl_float.toml"], r"rows must be a positive integer, got 4\.5"),
    (["simulate", "--workload", "{d}/wl_unknown.toml"], r"unknown key 'shape'; accepted: name, rows, cols"),
    (["simulate", "--workload", "{d}/wl_sup.csv"], r"wl_sup\.csv:2: rows must be a positive integer"),
    (["simulate", "--workload", "{d}/wl_neg.csv"],
     r"wl_neg\.csv:2: rows must be a positive integer, got '-8'"),
    (["simulate", "--workload", "{d}/binary.toml"], r"binary\.toml: malformed TOML"),
    (["simulate", "--trace", "/proc/x.json", "--workload", "{d}/tiny.toml", "--strategy", "adamw"],
     r"cannot use '/proc/x\.json'"),
    (["plan"], r"harness plan needs --workload \(or --model\) and --ranks \(or --compare\)"),
    (["plan", "--workload", "pi0", "--ranks", "0"], r"--ranks must be a positive integer .*got 0"),
    (["plan", "--workload", "pi0", "--ranks", "x"], r"--ranks must be a positive integer, got 'x'"),
    (["plan", "--workload", "pi0", "--ranks", "8", "--balancer", "x"], r"unknown balancer 'x'; accepted"),
    (["plan", "--workload", "pi0", "--ranks", "8", "--profile", "{d}/cost_neg.csv"],
     r"cost_neg\.csv:2: time_s must be a positive finite number"),
    (["plan", "--workload", "pi0", "--ranks", "8", "--dtype", "int8"], r"unknown dtype 'int8'; accepted"),
    (["plan", "--workload", "pi0", "--ranks", "8", "--memory-cap-gb", "-1"],
     r"--memory-cap-gb must be a positive number of GB"),
    (["plan", "--workload", "pi0", "--ranks", "8", "--time-limit", "0", "--balancer", "milp"],
     r"--time-limit must be positive"),
    (["plan", "--workload", "pi0", "--ranks", "8", "--scale", "inf"],
     r"--scale must be a finite number > 0"),
    (["plan", "--compare", "--workload", ",", "--ranks", "8"], r"--workload: ',' names nothing"),
    (["plan", "--compare", "--workload", "pi0", "--ranks", "a,b"], r"--ranks: 'a' is not a valid int"),
    (["plan", "--workload", "pi0", "--ranks", "8", "--out", "/proc/p.json"], r"cannot use '/proc/p\.json'"),
    (["profile", "--device", "tpu"], r"unknown device 'tpu'; accepted: cpu, cuda"),
    (["profile", "--scale", "1/0"], r"--scale '1/0' is not a positive number"),
    (["profile", "--threads", "0"], r"--threads must be a positive integer"),
    (["profile", "--keep-faster", "{d}/nope.csv"], r"profile file .*nope\.csv' does not exist"),
    (["profile", "--methods", "x"], r"unknown method 'x'; accepted"),
    (["figures", "nope"], r"unknown experiment 'nope'; accepted: paper"),
    (["figures", "paper", "--results", "{d}/res", "--out", "{d}/figs"],
     r"results\.csv lacks the column .* Re-run `harness run paper`"),
    (["validate", "--no-measure", "--paper-results", "{d}/other_results.csv", "--no-figure", "--out",
      "{d}/v"],
     r"other_results\.csv lacks the column .*not the paper experiment's results table"),
    (["validate", "--no-measure", "--paper-results", "{d}/binary.toml", "--no-figure", "--out", "{d}/v"],
     r"binary\.toml is not a readable results table"),
    (["bench", "kernels", "--shapes", "x"], r"unknown shape set 'x'; accepted: qwen"),
    (["bench", "kernels", "--scale", "0"], r"scale must be a positive integer"),
    (["bench", "kernels", "--device", "tpu"], r"unknown device 'tpu'; accepted: cpu, cuda"),
    (["bench", "step", "--ranks", "0"], r"ranks must be an integer >= 1"),
    (["bench", "step", "--strategy", "sgd"], r"unknown strategy 'sgd'; accepted: dmuon"),
    (["bench", "step", "--width-scale", "1/0"], r"--width-scale '1/0' is not a number"),
    (["bench", "step", "--node-size", "3"], r"--node-size=3 does not divide the world size 2"),
    (["bench", "step", "--workload", "pi0"], r"bench step builds decoder-only LLMs"),
]


@pytest.mark.parametrize("argv, match", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_code_2(files, capsys, argv, match):
    rc, out, err = _run([a.replace("{d}", str(files)) for a in argv], capsys)
    assert rc == 2, (out, err)
    err = err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in out + err
    assert re.search(match, err), err


def test_a_partial_node_is_accepted(files, capsys):
    # fewer GPUs than a node holds is one partial node, by design; 12 on 8-GPU nodes is refused (above)
    rc, out, err = _run(["simulate", "--workload", files / "tiny.toml", "--gpus", "3", "--strategy", "adamw"],
                        capsys)
    assert rc == 0 and "1 node(s) of 3" in out, err


# ---- fuzzing the options ----------------------------------------------------------------------------
JUNK = st.one_of(
    st.sampled_from(["", "x", "-1", "0", "1.5", "nan", "inf", "-inf", "1e30", "10" * 15, "[1,x]", "[]",
                     "{a=1}", "true", "'", '"', "=", ",", "1/0", "\u00b2", "\x00", "/proc/x.toml", "a.csv",
                     "[[1]]"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
)


def _no_traceback(argv: list[str], capsys, ok=(0, 2)) -> None:
    rc, out, err = _run(argv, capsys)
    assert rc in ok, (argv, rc, err[-500:])
    assert "Traceback" not in out + err, (argv, err[-2000:])
    if rc == 2:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert last.startswith("error: ") or "Error" in err, (argv, err)  # ours, or click's usage box


SIM_OPTS = ["--workload", "--gpus", "--gpus-per-node", "--gpu", "--strategy", "--layout", "--seq-len",
            "--micro-batch", "--balancer", "--nic-gbps", "--overlap-slowdown", "--bucket-numel"]
PLAN_OPTS = ["--workload", "--ranks", "--balancer", "--profile", "--method", "--dtype", "--max-batch",
             "--bucket-numel", "--memory-cap-gb", "--time-limit", "--scale", "--blocks"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.sampled_from(SIM_OPTS), JUNK)
def test_fuzz_simulate_options(files, capsys, option, value):
    base = {"--workload": str(files / "tiny.toml"), "--gpus": "4", "--strategy": "dmuon"}
    base[option] = value
    _no_traceback(["simulate", *[x for kv in base.items() for x in kv]], capsys)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.sampled_from(PLAN_OPTS), JUNK)
def test_fuzz_plan_options(files, capsys, option, value):
    base = {"--workload": str(files / "tiny.toml"), "--ranks": "4", "--profile": "a800", "--time-limit": "5"}
    base[option] = value
    _no_traceback(["plan", *[x for kv in base.items() for x in kv], "--json"], capsys)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["simulate", "plan"]), st.data(), JUNK)
def test_fuzz_run_set_values(files, capsys, tmp_path_factory, runner, data, value):
    key = data.draw(st.sampled_from(sorted(RUNNERS[runner].settings)))
    exp = files / f"fuzz_{runner}.toml"
    if not exp.exists():
        exp.write_text(f'runner = "{runner}"\n[fixed]\nworkload = "{files / "tiny.toml"}"\n'
                       + ('strategy = "dmuon"\n' if runner == "simulate" else "") + "[axes]\ngpus = [2]\n")
    out = tmp_path_factory.mktemp("out")
    argv = ["run", str(exp), "--set", f"{key}={value}", "--out", str(out), "--no-figures", "--jobs", "1"]
    _no_traceback(argv, capsys)


# ---- fuzzing the custom-workload loader -------------------------------------------------------------
TOML_PARTS = ['name = "w"\n', "[[matrices]]\n", 'name = "a"\n', "rows = 8\n", "cols = 16\n", "count = 2\n",
              'optimizer = "adamw"\n', 'optimizer = "sgd"\n', "rows = -1\n", "rows = 1.5\n", 'rows = "8"\n',
              "rows = 0\n", "cols = true\n", "count = 100000000000\n", "notes = [1]\n", "[matrices]\n",
              "x = 1\n", "[[matrices\n", '"\n', "name = 3\n", "component = {a = 1}\n", "= 4\n", "\x00\n",
              "\u00b2\n"]
HEADS = {"toml": ['name = "w"\n[[matrices]]\n', "[[matrices]]\n", ""],
         "csv": ["matrix,rows,cols\n", "matrix,rows,cols,count,optimizer\n", "matrix,rows\n", ""]}
CSV_PARTS = ["matrix,rows,cols\n", "q,8,16\n", "q,8,16,2,muon\n", "k,8,16\n", "q,-1,8\n", "q,\u00b2,8\n",
             "q,\u0663,8\n", "q,8\n", "q,8,16,3,sgd,extra\n", '"q,8\n', "\x00\n", "k,8,8.5\n", ",8,8\n",
             "q,99999999999999999999,8\n", "q,8,8,0\n", "colour\n"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["toml", "csv"]), st.data())
def test_fuzz_custom_workload_files_raise_only_input_error(tmp_path_factory, suffix, data):
    parts = TOML_PARTS if suffix == "toml" else CSV_PARTS
    pieces = [data.draw(st.sampled_from(HEADS[suffix]))]
    pieces += data.draw(st.lists(st.one_of(st.sampled_from(parts), st.sampled_from(parts),
                                           st.text(max_size=20)), max_size=8))
    path = tmp_path_factory.mktemp("wl") / f"w.{suffix}"
    raw = "".join(pieces).encode("utf-8", "surrogatepass")
    if data.draw(st.booleans()):
        raw = bytes(b ^ 0x80 if i % 7 == 3 else b for i, b in enumerate(raw))  # some invalid UTF-8
    path.write_bytes(raw)
    try:
        wl = load_workload(str(path))
    except InputError as e:
        assert str(path) in str(e) or "workload" in str(e), e
        return
    assert wl.params and all(p.rows > 0 and p.cols > 0 for p in wl.params)


KNOWN_BAD = [  # each once broke the loader with another exception type
    ("csv", "matrix,rows,cols\nq,\u00b2,8\n"), ("csv", "matrix,rows,cols\nq,\u0663,8\n"),
    ("csv", "matrix,rows,cols\nq,8\n"), ("csv", "\x00matrix,rows,cols\n"), ("csv", '"q,8\n'),
    ("csv", "matrix,rows,cols\nq,8,16,2\n"), ("toml", "[[matrices]]\nname = 3\nrows = 8\ncols = 8\n"),
    ("toml", "[[matrices]]\nname = 'a'\nrows = 8\ncols = 8\ncount = 100000000000\n"),
    ("toml", "matrices = [1, 2]\n"), ("toml", "matrices = {}\n"), ("toml", "notes = [1]\n[[matrices]]\n"),
    ("toml", "[[matrices]]\nname = 'a'\nrows = 8\ncols = true\n"), ("toml", "\ud800"),
]


@pytest.mark.parametrize("suffix, text", KNOWN_BAD)
def test_known_bad_workload_files_raise_input_error(tmp_path, suffix, text):
    path = tmp_path / f"w.{suffix}"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    with pytest.raises(InputError, match=re.escape(str(path))):
        load_workload(str(path))


def test_huge_counts_are_refused_not_expanded(tmp_path):
    p = tmp_path / "w.toml"
    p.write_text('[[matrices]]\nname = "a"\nrows = 8\ncols = 8\ncount = 100000000000\n')
    with pytest.raises(InputError, match=r"count must be a positive integer <= 1000000"):
        load_workload(str(p))


# ---- bench step: a dead worker ends the command in bounded time --------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"resource_tracker" not in cmd:
                out.append(int(d))
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker processes through /proc")
def test_bench_step_exits_nonzero_soon_after_a_worker_dies(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "harness.cli", "bench", "step", "--ranks", "2", "--device", "cpu",
            "--width-scale", "1/64", "--layers", "1", "--seq-len", "16", "--micro-batch", "1", "--steps",
            "100000", "--warmup", "0", "--rounds", "1", "--threads", "1", "--timeout-s", "300"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            workers = _children(proc.pid)
            time.sleep(0.2)
        assert len(workers) == 2, "the two ranks did not start"
        time.sleep(3.0)  # let them get into the step loop (or not: either way the death must be seen)
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        waited = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode not in (0, None)
    assert waited < 30, f"the launcher took {waited:.1f} s to notice a dead rank"
    text = err.decode()
    assert "bench step failed" in text and ("died" in text or "rank 1" in text), text[-2000:]
    assert not [p for p in workers if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]


def test_bench_step_failure_is_one_line(capsys, monkeypatch):
    class _Proc:
        exitcode = -9

        def __init__(self, *a, **k):
            pass

        def start(self):
            pass

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return False

        def kill(self):
            pass

    class _Ctx:
        Process = _Proc

        @staticmethod
        def Queue():
            import queue

            return queue.Queue()

    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "get_context", lambda *_: _Ctx)
    rc, out, err = _run(["bench", "step", "--ranks", "2", "--device", "cpu", "--timeout-s", "30"], capsys)
    assert rc == 1 and err.strip().startswith("error: bench step") and "\n" not in err.strip()
