"""`harness bench kernels`: symmetric kernels vs torch, standard vs Gram NS, batched vs loop, measured here.

Per shape (n, m) = (min, max) and dtype, timed side by side in one run (repeats interleaved, median
after warm-up; CUDA events on a GPU, perf_counter on the CPU):
  matmul_s X @ X^T (torch)        syrk_s    the Triton syrk           syrk_speedup = matmul / syrk
  standard_ns_s  standard NS, torch ops   gram_ns_torch_s  Gram NS, torch ops
  gram_ns_sym_s  Gram NS, Triton symmetric kernels; *_speedup = standard_ns_s / that time
and one batching row per kernel set: 28 x (512, 3584) as one batched call vs a loop of 28 calls.
Shapes: the distinct Muon matrix shapes of qwen2.5-7b / wall-oss (experiments/workloads.csv) and
squares n in {1024, 2048, 4096, 8192}; default all of them on CUDA. Without CUDA the default set is
qwen, the Triton columns are n/a and every shape is divided by `--scale` (default 8; rows say so).
Also runnable without typer/rich: `python -m harness.cmd_bench_kernels --json` (gpu_check.sh does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SHAPE_SETS = ("qwen", "wall-oss", "squares", "all")
DTYPES = ("bf16", "fp16", "fp32")
_WORKLOADS = {"qwen": "qwen2.5-7b", "wall-oss": "wall-oss"}
SQUARES = (1024, 2048, 4096, 8192)
BATCH_CASE = (28, 512, 3584)  # Qwen2.5-7B k_proj/v_proj: 28 matrices per layer kind
CPU_SCALE = 8


def bench_shapes(shapes: str, scale: int = 1) -> list[tuple[str, int, int]]:
    """(label, n, m) per distinct (min, max) shape of the set, each dim divided by `scale` (>= 16)."""
    from dmuon.errors import choice_error

    if shapes not in SHAPE_SETS:
        raise choice_error("shape set", shapes, SHAPE_SETS)
    found: dict[tuple[int, int], list[str]] = {}
    if shapes in ("qwen", "wall-oss", "all"):
        from simulator.models.workload import load_workload

        for key in (("qwen", "wall-oss") if shapes == "all" else (shapes,)):
            for p in load_workload(_WORKLOADS[key]).params:
                label = f"{key}:{p.matrix}" if key == "qwen" else f"{key}:{p.component}.{p.matrix}"
                labels = found.setdefault((min(p.rows, p.cols), max(p.rows, p.cols)), [])
                if p.optimizer == "muon" and label not in labels:
                    labels.append(label)
    if shapes in ("squares", "all"):
        for n in SQUARES:
            found.setdefault((n, n), []).insert(0, f"square{n}")
    return [(_label(labels), _scaled(n, scale), _scaled(m, scale))
            for (n, m), labels in sorted(found.items()) if labels]


def _label(labels: list[str]) -> str:
    """The first two names of a shape, '+k' for the rest (one shape is often several matrices)."""
    return "/".join(labels[:2]) + (f" +{len(labels) - 2}" if len(labels) > 2 else "")


def _scaled(x: int, scale: int) -> int:
    return x if scale == 1 else max(16, round(x / scale))


def time_side_by_side(fns: dict, *, repeats: int, warmup: int = 1, cuda: bool = False) -> dict[str, float]:
    """Median seconds of each callable; the repeats are interleaved so all see the same conditions."""
    import torch

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if cuda:
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e-3)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _ratio(num, den):
    return None if num is None or den is None else num / den


def run_bench(shapes: str | None = None, dtype: str | None = None, repeats: int = 5, scale: int | None = None,
              device: str | None = None, batch_case: bool = True) -> list[dict]:
    """All benchmark rows (dicts) for one shape set and dtype on `device` (default: cuda if available)."""
    import torch

    from dmuon import orthogonalize
    from dmuon.errors import InputError, choice_error
    from dmuon.kernels import get_ops, triton_available

    if device not in (None, "cpu", "cuda"):
        raise choice_error("device", device, ("cpu", "cuda"))
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' requested but torch sees no CUDA GPU here; accepted: cpu")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dtype = dtype or ("bf16" if cuda else "fp32")
    shapes = shapes or ("all" if cuda else "qwen")
    if dtype not in DTYPES:
        raise choice_error("dtype", dtype, DTYPES)
    if not cuda and dtype == "fp16":
        raise InputError("fp16 matmuls on the CPU are extremely slow; use --dtype fp32 or bf16 without a GPU")
    if not isinstance(repeats, int) or repeats < 1:
        raise InputError(f"repeats must be a positive integer, got {repeats!r}")
    scale = scale if scale is not None else (1 if cuda else CPU_SCALE)
    if not isinstance(scale, int) or scale < 1:
        raise InputError(f"scale must be a positive integer, got {scale!r}")
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    use_triton = cuda and triton_available()
    where = torch.cuda.get_device_name(dev) if cuda else "cpu"
    common = {"device": where, "dtype": dtype, "scale": scale}
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for label, n, m in bench_shapes(shapes, scale):
        x = torch.randn((n, m), generator=gen, device=dev).to(tdtype)
        x = x / x.float().norm().to(tdtype)
        fns = {
            "matmul_s": lambda x=x: x @ x.mT,
            "standard_ns_s": lambda x=x: orthogonalize(x, method="standard", kernels="torch", dtype=tdtype),
            "gram_ns_torch_s": lambda x=x: orthogonalize(x, method="gram", kernels="torch", dtype=tdtype),
        }
        if use_triton:
            sops = get_ops(x, "triton")
            fns["syrk_s"] = lambda x=x, sops=sops: sops.syrk(x)
            fns["gram_ns_sym_s"] = lambda x=x: orthogonalize(x, method="gram", kernels="triton", dtype=tdtype)
        t = time_side_by_side(fns, repeats=repeats, cuda=cuda)
        syrk_s, sym_s = t.get("syrk_s"), t.get("gram_ns_sym_s")
        rows.append({"kind": "shape", "label": label, "n": n, "m": m, "batch": 1, **common,
                     "matmul_s": t["matmul_s"], "syrk_s": syrk_s,
                     "syrk_speedup": _ratio(t["matmul_s"], syrk_s),
                     "standard_ns_s": t["standard_ns_s"], "gram_ns_torch_s": t["gram_ns_torch_s"],
                     "gram_ns_sym_s": sym_s,
                     "gram_torch_speedup": _ratio(t["standard_ns_s"], t["gram_ns_torch_s"]),
                     "gram_sym_speedup": _ratio(t["standard_ns_s"], sym_s)})
    if batch_case:
        bsz, n, m = BATCH_CASE[0], _scaled(BATCH_CASE[1], scale), _scaled(BATCH_CASE[2], scale)
        stack = torch.randn((bsz, n, m), generator=gen, device=dev).to(tdtype)
        mats = list(stack.unbind(0))
        for kernels in ("torch", "triton") if use_triton else ("torch",):
            fns = {"loop_s": lambda k=kernels: [orthogonalize(a, kernels=k, dtype=tdtype) for a in mats],
                   "batched_s": lambda k=kernels: orthogonalize(stack, kernels=k, dtype=tdtype)}
            t = time_side_by_side(fns, repeats=repeats, cuda=cuda)
            rows.append({"kind": "batch", "label": f"{bsz}x({n},{m}) {kernels}", "n": n, "m": m, "batch": bsz,
                         **common, "kernels": kernels, "loop_s": t["loop_s"], "batched_s": t["batched_s"],
                         "batch_speedup": _ratio(t["loop_s"], t["batched_s"])})
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    """All rows (union of columns) to `path`, atomically (temp file + os.replace)."""
    import csv
    import io

    from dmuon.io import atomic_write_text

    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows([{k: ("" if r.get(k) is None else r.get(k)) for k in cols} for r in rows])
    atomic_write_text(path, buf.getvalue())


def _fmt_ms(v) -> str:
    return "n/a" if v is None else f"{v * 1e3:.3f}"


def _fmt_x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def print_tables(rows: list[dict]) -> None:
    """The rows as two rich tables (per shape; batched vs loop)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped / captured: do not squeeze the table into 80 columns
        console = Console(width=160)
    if not rows:
        return
    r0 = rows[0]
    scaled = f", shapes scaled 1/{r0['scale']}" if r0["scale"] != 1 else ""
    title = f"kernels on {r0['device']} ({r0['dtype']}{scaled}; median times in ms)"
    table = Table(title=title)
    for col in ("shape", "n", "m", "matmul", "syrk", "syrk x", "std NS", "Gram NS torch", "Gram NS sym",
                "Gram torch x", "Gram sym x"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for r in (r for r in rows if r["kind"] == "shape"):
        table.add_row(r["label"], str(r["n"]), str(r["m"]), _fmt_ms(r["matmul_s"]), _fmt_ms(r["syrk_s"]),
                      _fmt_x(r["syrk_speedup"]), _fmt_ms(r["standard_ns_s"]), _fmt_ms(r["gram_ns_torch_s"]),
                      _fmt_ms(r["gram_ns_sym_s"]), _fmt_x(r["gram_torch_speedup"]),
                      _fmt_x(r["gram_sym_speedup"]))
    console.print(table)
    batch_rows = [r for r in rows if r["kind"] == "batch"]
    if batch_rows:
        bt = Table(title=f"batched vs per-matrix loop ({r0['dtype']}{scaled}; ms)")
        for col in ("case", "loop", "batched", "speedup"):
            bt.add_column(col, justify="left" if col == "case" else "right")
        for r in batch_rows:
            bt.add_row(r["label"], _fmt_ms(r["loop_s"]), _fmt_ms(r["batched_s"]), _fmt_x(r["batch_speedup"]))
        console.print(bt)
    console.print("x = ratio of medians measured side by side in this run (> 1: the second is faster)")


def register(app, bench) -> None:
    import typer

    @bench.command("kernels")
    def kernels_cmd(
        json_out: bool = typer.Option(False, "--json", help="Print the rows as JSON instead of tables."),
        shapes: str = typer.Option(None, help="qwen | wall-oss | squares | all (default: all on CUDA, "
                                   "qwen on the CPU)."),
        dtype: str = typer.Option(None, help="bf16 | fp16 | fp32 (default: bf16 on CUDA, fp32 on the CPU)."),
        repeats: int = typer.Option(5, help="Timed repeats per variant (median reported), after a warm-up."),
        scale: int = typer.Option(None, help="Divide every shape by this (default: 8 on CPU, 1 on CUDA)."),
        csv: str = typer.Option(None, help="Also write the rows to this CSV file."),
        device: str = typer.Option(None, help="cpu | cuda (default: cuda where available)."),
    ):
        """Symmetric kernels vs torch matmul, standard vs Gram NS, batched vs loop (measured here)."""
        rows = run_bench(shapes, dtype, repeats, scale, device)
        if csv:
            write_csv(rows, csv)
        if json_out:
            print(json.dumps(rows, indent=1))
        else:
            print_tables(rows)


def main(argv: list[str] | None = None) -> int:
    """Plain entry point (no typer/rich needed): python -m harness.cmd_bench_kernels [--json] ..."""
    from dmuon.errors import InputError

    p = argparse.ArgumentParser(prog="python -m harness.cmd_bench_kernels",
                                description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--shapes", default=None,
                   help="qwen | wall-oss | squares | all (default: all on CUDA, qwen on the CPU)")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scale", type=int, default=None)
    p.add_argument("--csv", default=None, help="write the rows to this CSV file")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda where available)")
    a = p.parse_args(argv)
    try:
        rows = run_bench(a.shapes, a.dtype, a.repeats, a.scale, a.device)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.csv:
        write_csv(rows, a.csv)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
