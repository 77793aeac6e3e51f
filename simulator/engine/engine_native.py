"""The cluster's event loop compiled: `engine_native.c` (with its headers) is `simulator.engine.engine_fast`
written in C (the same model, arithmetic and timer order: the same op times, bit for bit;
tests/test_sim_engine_fast.py), built on first use with the machine's C compiler and kept in a cache
directory. Where no compiler or no Python headers
are found, `Cluster.run` runs the Python loop instead (same results, slower) and says why once. The same
module replays step templates (`replay`, engine_native_replay.h: `simulator.programs.step_template`) and
scans a finished run's ops for the metrics (`phase_ends`, `compute_gaps`, engine_native_measure.h:
`simulator.engine.metrics`), each beside the Python loop it mirrors (tests/test_sim_symmetry_replay.py).

Why: at 4096 ranks a MoE step program has ~7 M ops; the Python loop spends ~3.5 us per op there (memory
latency on ~10^7 scattered objects plus the interpreter). The C loop copies what it reads of the ops into
arrays in one pass in memory order, runs on those and writes the times back into the ops' slots in another
(engine_native.c: `number_ops`, `op_times`).

Environment:
  DMUON_SIM_ENGINE   auto (default: native where it builds, else python) | native (fail if it cannot
                     build) | python (always the Python loop)
  DMUON_CACHE_DIR    where the compiled module is kept (`dmuon.io.cache_dir`, default ~/.cache/dmuon, beside
                     the Triton autotune cache); one file per source / compiler-flag / Python version
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

from dmuon.errors import InputError
from dmuon.io import atomic_path, cache_dir

from .engine_fast import MAX_SM_SHARE

SRC = Path(__file__).with_name("engine_native.c")
HEADERS = ("engine_native_state.h", "engine_native_loop.h", "engine_native_replay.h",
           "engine_native_measure.h")  # included by SRC
# -ffp-contract=off: no fused multiply-adds, so every sum and product rounds as Python's do
CFLAGS = ("-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fwrapv")
MODES = ("auto", "native", "python")
_loaded: dict = {}  # key -> module, or the reason it could not be built (str)


def mode() -> str:
    m = os.environ.get("DMUON_SIM_ENGINE", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise InputError(f"DMUON_SIM_ENGINE={m!r} is not an engine; accepted: {', '.join(MODES)}")
    return m


def _compiler() -> list[str] | None:
    cc = shlex.split(sysconfig.get_config_var("CC") or "") or ["cc"]
    if shutil.which(cc[0]):
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def _key(cc: list[str]) -> str:
    h = hashlib.sha256(SRC.read_bytes())
    for name in HEADERS:
        h.update(SRC.with_name(name).read_bytes())
    h.update(repr((cc, CFLAGS, sys.version, sysconfig.get_config_var("EXT_SUFFIX"))).encode())
    return h.hexdigest()[:16]


def build() -> Path:
    """The compiled module's path, compiling it first if the cache lacks it. Raises OSError with the reason
    (no compiler, no Python.h, compile error). Written to a temporary file and renamed into place, so a
    failed or concurrent build never leaves a half-written module."""
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found (tried $CC, cc, gcc, clang)")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise OSError(f"Python.h not found in {include} (install the Python development headers)")
    out = cache_dir() / f"_engine_native-{_key(cc)}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if out.exists():
        return out
    with atomic_path(out) as tmp:  # dmuon.io: renamed into place on success, removed on failure
        cmd = [*cc, *CFLAGS, f"-I{include}", str(SRC), "-o", str(tmp)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise OSError(f"compiling {SRC.name} failed ({' '.join(cmd)}): {p.stderr.strip()[-2000:]}")
    return out


def load():
    """The compiled loop's module, or None where the Python loop should run (DMUON_SIM_ENGINE=python, or
    auto and it cannot be built: warned once per process with the reason)."""
    m = mode()
    if m == "python":
        return None
    got = _loaded.get("module")
    if got is None:
        try:
            path = build()
            loader = importlib.machinery.ExtensionFileLoader("_engine_native", str(path))
            spec = importlib.util.spec_from_file_location("_engine_native", path, loader=loader)
            got = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(got)
        except (OSError, ImportError, subprocess.SubprocessError) as e:
            got = str(e) or type(e).__name__
            warnings.warn(f"simulator: the compiled event loop is not available ({got}); running the Python "
                          "loop (same results, slower)", RuntimeWarning, stacklevel=2)
        _loaded["module"] = got
    if isinstance(got, str):
        if m == "native":
            raise InputError(f"DMUON_SIM_ENGINE=native but the compiled event loop cannot be built: {got}")
        return None
    return got


def run_native(cl, mod, op_type, coll_type) -> float:
    """Run cluster `cl` with the compiled loop `mod` (from `load()`); returns the final clock, as
    `engine_fast.run_fast`, and leaves every op and collective with the same times."""
    slow = cl.overlap_slowdown > 0 or any(c.sm_share > 0 for c in cl.collectives)
    comm_slow = cl.comm_overlap_slowdown > 0
    order = sorted(cl.queues.items(), key=lambda kv: kv[0][1] == cl.compute_stream)
    streams = [(ops, rank, stream == cl.compute_stream) for (rank, stream), ops in order if ops]
    now, late, busy, sm_used, ends = mod.run(streams, cl.collectives, cl.n_ranks, slow, comm_slow,
                                             1.0 + cl.overlap_slowdown, 1.0 / (1.0 + cl.comm_overlap_slowdown),
                                             MAX_SM_SHARE, op_type, coll_type)
    cl._busy, cl._sm_used = busy, sm_used
    cl.phase_ends = ends  # simulator.engine.metrics: the phase ends per step, read while writing the times
    return max(now, late)
