#!/usr/bin/env bash
# GPU check of the symmetric Triton kernels: correctness on CUDA, the kernel benchmark, the NS profile.
#
# For a machine with an NVIDIA GPU (target: H200) and torch + triton preinstalled; needs no internet,
# no pulp/highspy/simpy, no pip install (runs with PYTHONPATH=<repo>), installs nothing. ~5 minutes.
#   1. kernel tests on CUDA: pytest tests/test_kernels_cuda.py tests/test_kernels.py if pytest is
#      importable, else `python -m dmuon.kernels.selfcheck` (the same CUDA cases, no pytest)
#   2. `python -m harness.cmd_bench_kernels`: bf16 on all shapes -> results/gpu/h200_kernels.csv,
#      fp16 on the Qwen shapes -> results/gpu/h200_kernels_fp16.csv
#   3. dmuon.plan.profile.profile_device on the Qwen2.5-7B + Wall-OSS Muon shapes, batch 1..8,
#      methods standard|gram|gram_sym, bf16 and fp16 -> dmuon/plan/profiles/h200.csv
# The autotune cache starts empty (a temp DMUON_CACHE_DIR) and is kept as results/gpu/h200_autotune.json;
# everything is logged to results/gpu/gpu_check.log. With $OUT set, the outputs are copied there too.
# Not run here: issue 17's optimizer-pass check (do DMuon's momentum / AdamW passes pay the FSDP2+AdamW
# intercept?), a separate < 3 min command: `PYTHONPATH=. python3 scripts/gpu_opt_passes.py` (docs/simulator.md).
#
# Dry run on a CPU (tiny shapes, Triton interpreter, nothing written outside the results folder):
#   DMUON_GPU_CHECK_CPU=1 DMUON_GPU_CHECK_RESULTS=/tmp/x scripts/gpu_check.sh
# Environment: PYTHON (default python3), DMUON_GPU_CHECK_RESULTS (default results/gpu),
# DMUON_GPU_CHECK_PROFILE (default dmuon/plan/profiles/h200.csv; the dry run writes into the results folder).
# Exit status: 0 when every step passed, else 1 (every step runs regardless, each under its own timeout).
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
CPU_MODE=${DMUON_GPU_CHECK_CPU:-0}
RESULTS=${DMUON_GPU_CHECK_RESULTS:-results/gpu}
mkdir -p "$RESULTS"
CACHE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/dmuon_gpu_check.XXXXXX")
export DMUON_CACHE_DIR="$CACHE_DIR"

if [ "$CPU_MODE" = "1" ]; then
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 OMP_NUM_THREADS=1
    PREFIX=cpu_dryrun
    PROFILE=${DMUON_GPU_CHECK_PROFILE:-$RESULTS/cpu_dryrun_profile.csv}
    BENCH_ARGS=(--device cpu --dtype fp32 --shapes qwen --scale 64 --repeats 1)
    BENCH2_ARGS=()
    T_TEST=120 T_BENCH=120 T_BENCH2=0 T_PROFILE=120
else
    PREFIX=h200
    PROFILE=${DMUON_GPU_CHECK_PROFILE:-dmuon/plan/profiles/h200.csv}
    BENCH_ARGS=(--device cuda --dtype bf16 --shapes all --repeats 5)
    BENCH2_ARGS=(--device cuda --dtype fp16 --shapes qwen --repeats 5)
    T_TEST=120 T_BENCH=110 T_BENCH2=50 T_PROFILE=180  # worst case 460 s + start-up: < 8 min
fi
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
FAILED=()

say() { echo "== $*" | tee -a "$LOG"; }
run_step() {  # run_step NAME TIMEOUT_S CMD...: run, log, record a failure; never stop the script
    local name=$1 limit=$2
    shift 2
    say "$name (limit ${limit}s): $*"
    local t0=$SECONDS rc
    if command -v timeout >/dev/null 2>&1; then
        timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    else
        "$@" 2>&1 | tee -a "$LOG"
    fi
    rc=${PIPESTATUS[0]}
    say "$name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || FAILED+=("$name (exit $rc)")
}

say "gpu_check: mode $([ "$CPU_MODE" = 1 ] && echo cpu-dry-run || echo cuda), results in $RESULTS, profile $PROFILE"
run_step environment 60 "$PY" -c '
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "| sms", p.multi_processor_count, "| mem GiB", round(p.total_memory / 2**30, 1),
          "| capability", torch.cuda.get_device_capability(0))
for mod in ("pytest", "typer", "rich", "pandas", "simpy", "pulp", "highspy"):
    try:
        __import__(mod)
        print(mod, "available")
    except ImportError:
        print(mod, "missing")
'
if [ "$CPU_MODE" != "1" ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "no CUDA GPU visible to torch: run with DMUON_GPU_CHECK_CPU=1 for the CPU dry run"
    exit 1
fi

# 1. correctness (the dry run always takes the pytest-free path: it may itself run under pytest)
if [ "$CPU_MODE" != "1" ] && "$PY" -c 'import pytest' 2>/dev/null; then
    run_step kernel-tests "$T_TEST" "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py \
        tests/test_kernels.py
else
    run_step kernel-selfcheck "$T_TEST" "$PY" -m dmuon.kernels.selfcheck
fi

# 2. benchmark
run_step bench "$T_BENCH" "$PY" -m harness.cmd_bench_kernels "${BENCH_ARGS[@]}" \
    --csv "$RESULTS/${PREFIX}_kernels.csv"
if [ ${#BENCH2_ARGS[@]} -gt 0 ]; then
    run_step bench-fp16 "$T_BENCH2" "$PY" -m harness.cmd_bench_kernels "${BENCH2_ARGS[@]}" \
        --csv "$RESULTS/${PREFIX}_kernels_fp16.csv"
fi

# 3. NS profile for the cost table (the Plan package's profiler and CSV writer)
run_step profile "$T_PROFILE" "$PY" - "$PROFILE" "$CPU_MODE" <<'EOF'
# peaks and elementwise passes first (seconds), then NS shape by shape; the file is rewritten
# (atomically) after each shape, so a timeout still leaves every finished shape on disk
import sys, time
from dmuon.plan.profile import ns_shapes_of, profile_elementwise, profile_ns, profile_peaks
from dmuon.plan.profile_io import write_profile

path, cpu = sys.argv[1], sys.argv[2] == "1"
t0 = time.perf_counter()
if cpu:
    device, name, dtypes, methods, max_batch, repeats = "cpu", "cpu-dryrun", ("fp32",), ("standard", "gram"), 2, 1
    shapes, numels = [(8, 24), (16, 40)], (1 << 10,)
else:
    from simulator.models.workload import load_workload
    device, name, dtypes, methods, max_batch, repeats = "cuda", "h200", ("bf16", "fp16"), (
        "standard", "gram", "gram_sym"), 8, 5
    by_size = lambda s: s[0] * s[0] * s[1]  # noqa: E731
    qwen, wall = (ns_shapes_of((m.rows, m.cols) for m in load_workload(w).muon_matrices)
                  for w in ("qwen2.5-7b", "wall-oss"))
    shapes = sorted(qwen, key=by_size) + sorted((s for s in wall if s not in qwen), key=by_size)
    numels = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
common = dict(device=device, repeats=repeats, device_name=name)
rows = [r for d in dict.fromkeys(dtypes + ("fp32",)) for r in profile_peaks(dtype=d, **common)]
rows += profile_elementwise(numels, dtype="fp32", **common)
write_profile(path, rows)
for n, m in shapes:  # Qwen2.5-7B first (the paper's main workload), then Wall-OSS
    rows += profile_ns([(n, m)], methods=methods, dtypes=dtypes, max_batch=max_batch,
                       progress=lambda s: print(s, flush=True), **common)
    write_profile(path, rows)
    print(f"[{time.perf_counter() - t0:.0f} s] ({n}, {m}) done: {len(rows)} rows in {path}", flush=True)
print(f"wrote {len(rows)} rows to {path} in {time.perf_counter() - t0:.1f} s")
EOF

cp "$CACHE_DIR/autotune.json" "$RESULTS/${PREFIX}_autotune.json" 2>/dev/null || say "no autotune cache written"
rm -rf "$CACHE_DIR"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    for f in "$RESULTS/${PREFIX}_kernels.csv" "$RESULTS/${PREFIX}_kernels_fp16.csv" \
             "$RESULTS/${PREFIX}_autotune.json" "$PROFILE"; do
        [ -f "$f" ] && cp "$f" "$OUT/"
    done
fi
if [ ${#FAILED[@]} -gt 0 ]; then
    say "FAILED: ${FAILED[*]}"
    [ -n "${OUT:-}" ] && cp "$LOG" "$OUT/"
    exit 1
fi
say "all steps passed"
[ -n "${OUT:-}" ] && cp "$LOG" "$OUT/"
exit 0
