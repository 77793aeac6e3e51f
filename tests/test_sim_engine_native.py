"""The compiled event loop (simulator.engine.engine_native): on programs too big for the SimPy reference it gives
every op and collective the Python loop's times bit for bit; it is built once per source into a cache,
never half-written; where it cannot be built the Python loop runs and says why (or, when asked for
explicitly, a one-line error names the reason and the accepted engines)."""

import hashlib
import shutil
import subprocess

import pytest

from dmuon.errors import InputError
from simulator.engine import engine, engine_native
from simulator.api import SimConfig, build_programs
from simulator.engine.engine_fast import run_fast


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A loader that has tried nothing yet, with an empty cache directory of its own."""
    monkeypatch.setattr(engine_native, "_loaded", {})
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _native():
    try:
        mod = engine_native.load()
    except InputError as e:
        pytest.skip(str(e))
    if mod is None:
        pytest.skip("the compiled event loop cannot be built here")
    return mod


def _state(cl, end) -> str:
    h = hashlib.sha256(repr(end).encode())
    for ops in cl.queues.values():
        for o in ops:
            h.update(f"{o.start!r}|{o.end!r}|{o.slowed_s!r}|{o.done!r}\n".encode())
    for c in cl.collectives:
        h.update(f"{c.arrived}|{c.start!r}|{c.end!r}|{c.ranks!r}\n".encode())
    h.update(repr((cl._busy, cl._sm_used)).encode())
    return h.hexdigest()


BIG = [
    dict(model="qwen3-30b-a3b", gpus=256, ep=8, strategy="dmuon"),
    dict(model="qwen3-30b-a3b", gpus=128, ep=16, strategy="dmuon", layout="hsdp-free"),
    # every rank: they are one class (simulator.engine.symmetry), whose single rank is no big program
    dict(model="qwen3-30b-a3b", gpus=16, ep=4, strategy="naive", gpu="cpu", layout="hsdp-free",
         all_ranks=True),
    dict(workload="wall-oss", gpus=64, strategy="dmuon", max_split=4),
    dict(workload="qwen2.5-7b", gpus=128, strategy="dmuon", layout="hsdp-free", jitter=0.2),
    dict(workload="qwen2.5-1.5b", gpus=32, strategy="dmuon", gpu="cpu", layout="sharded"),
]


@pytest.mark.parametrize("kw", BIG, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_native_equals_python_loop_on_big_programs(kw):
    """Same cluster, each loop in turn: every op's start, end, slowdown and waiting list, every
    collective's arrivals, times and participants, the ranks' running counts and the end time agree."""
    mod = _native()
    kw = dict(kw)
    all_ranks = kw.pop("all_ranks", False)
    cl = build_programs(SimConfig(**kw), all_ranks=all_ranks).cluster
    with engine.paused_gc():
        py_end = run_fast(cl)
        py = _state(cl, py_end)
        n_ops = sum(len(q) for q in cl.queues.values())
        cl.clear_times()
        c_end = engine_native.run_native(cl, mod, engine.Op, engine.Collective)
    assert n_ops > 10_000
    assert c_end == py_end and c_end > 0
    assert _state(cl, c_end) == py


def test_unknown_engine_names_the_accepted(monkeypatch):
    monkeypatch.setenv("DMUON_SIM_ENGINE", "fortran")
    with pytest.raises(InputError, match="DMUON_SIM_ENGINE='fortran'.*accepted: auto, native, python"):
        engine_native.load()


def test_without_a_compiler_the_python_loop_runs(fresh, monkeypatch):
    monkeypatch.setattr(engine_native, "_compiler", lambda: None)
    monkeypatch.setenv("DMUON_SIM_ENGINE", "auto")
    cl = engine.Cluster(1)
    cl.compute(0, "a", 1.0, phase="fwd", step=0)
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        assert cl.run().end_s == 1.0
    assert cl.engine == "python"
    monkeypatch.setenv("DMUON_SIM_ENGINE", "native")
    with pytest.raises(InputError, match="DMUON_SIM_ENGINE=native but .* no C compiler found"):
        engine_native.load()


def test_a_failed_build_leaves_nothing_behind(fresh, monkeypatch, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("engine_native.c", *engine_native.HEADERS):
        shutil.copy(engine_native.SRC.with_name(name), src / name)
    with open(src / "engine_native.c", "a") as f:
        f.write("\nthis is not C;\n")
    monkeypatch.setattr(engine_native, "SRC", src / "engine_native.c")
    if engine_native._compiler() is None:
        pytest.skip("no C compiler here")
    with pytest.raises(OSError, match="compiling engine_native.c failed"):
        engine_native.build()
    assert list(fresh.iterdir()) == []


def test_built_once_then_taken_from_the_cache(fresh, monkeypatch):
    if engine_native._compiler() is None:
        pytest.skip("no C compiler here")
    path = engine_native.build()
    assert path.parent == fresh and path.exists()
    assert [p.name for p in fresh.iterdir()] == [path.name]

    def no_compiler_call(*a, **k):
        raise AssertionError("compiled again although the cache holds the module")

    monkeypatch.setattr(subprocess, "run", no_compiler_call)
    assert engine_native.build() == path


def test_native_rejects_a_collective_outside_the_cluster(monkeypatch):
    monkeypatch.setenv("DMUON_SIM_ENGINE", "native")
    _native()
    cl = engine.Cluster(2)
    stray = engine.Collective("x", "all_gather", 2, 1.0)  # not made by cl.new_collective
    for r in range(2):
        cl.collective(stray, r, phase="fwd", step=0)
    with pytest.raises(ValueError, match="not in its cluster's collectives"):
        cl.run()


def test_native_rejects_a_dependency_outside_the_streams_and_leaves_the_ops_as_they_were(monkeypatch):
    """The compiled loop numbers the ops in their `done` slots while it reads them: a program it rejects
    leaves every slot None again and the garbage collector as it was; an op run before is refused."""
    import gc

    monkeypatch.setenv("DMUON_SIM_ENGINE", "native")
    _native()
    cl = engine.Cluster(2)
    stray = engine.Op(0, "compute", "stray", "fwd", 0, 1.0)  # in no stream
    first = cl.compute(0, "a", 1.0, phase="fwd", step=0)
    cl.compute(1, "b", 1.0, phase="fwd", step=0, deps=(first, stray))
    assert gc.isenabled()
    with pytest.raises(ValueError, match="an op depends on an op in none of the cluster's streams"):
        engine_native.run_native(cl, engine_native.load(), engine.Op, engine.Collective)
    assert gc.isenabled() and all(o.done is None for ops in cl.queues.values() for o in ops)
    first.done = "waiting"
    with pytest.raises(ValueError, match="an op is in two streams, or ran before"):
        engine_native.run_native(cl, engine_native.load(), engine.Op, engine.Collective)
    assert first.done == "waiting" and all(o.done is None for o in cl.queues[(1, "compute")])


def test_native_phase_ends_only_for_steps_it_can_hold(monkeypatch):
    """The loop's phase ends per step (Cluster.phase_ends, read by metrics.measure) cover steps 0..65535;
    an op of a larger or a non-int step leaves them to measure's own scans."""
    monkeypatch.setenv("DMUON_SIM_ENGINE", "native")
    _native()
    for step, given in ((1, True), (70_000, False), ("1", False)):
        cl = engine.Cluster(1)
        cl.compute(0, "f", 1.0, phase="fwd", step=0)
        cl.compute(0, "o", 2.0, phase="opt", step=step)
        cl.run()
        assert (cl.phase_ends is not None) == given
        if given:
            assert cl.phase_ends == ([1.0, 0.0], [0.0, 0.0], [0.0, 3.0], [0.0, 0.0])
