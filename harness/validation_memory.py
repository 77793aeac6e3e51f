"""`harness validate`'s memory section: simulator.models.memory against measurement and public tables.

checks (column `check`):
  memory_formulas  the per-tensor activation count (simulator.models.memory_activations) against Korthikanti et
                   al. 2022's printed formulas for a GPT-3 175B block (s 2048, b 1, h 12288, a 96, eager
                   attention, dropout): no TP (eq. 1), TP 8 without / with sequence parallelism (eqs. 2-3),
                   selective (eq. 6) and full recompute. Checked: exact (1e-9).
  memory_public    published per-configuration peak memory (experiments/reference/memory_public.csv, a
                   source URL per row: torchtitan's Llama 3.1 8B / 70B on H100s) against memory_of on the
                   row's layout. Checked: 15%, rows without torch.compile / Float8 / async TP (those change
                   what is saved and how weights are gathered; shown only). torchtitan reports
                   max_reserved (the caching allocator's segments), the model counts allocated tensors.
                   The DMuon paper's 8 x A800 peak-memory rows (reported.csv) are shown only: the paper
                   does not state its mixed-precision policy nor its activation checkpointing.
  memory_cpu       `harness bench step` on this CPU (results/validation/memory_cpu.csv, measured here by
                   `measure_cpu_rows`): every layout x strategy of the bench model and a Hugging Face
                   Llama built from its config class; the ranks' peak resident set (--exact-memory)
                   against memory_of of the same run. Checked: 10%.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from .validation import _row

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_CSV = ROOT / "experiments" / "reference" / "memory_public.csv"
CPU_CSV = ROOT / "results" / "validation" / "memory_cpu.csv"
PUBLIC_BOUND = 0.15
CPU_BOUND = 0.10
FORMULA_BOUND = 1e-9
GIB = 1 << 30
# harness bench step (layout, memory) -> the simulator's layout and whether parameters are freed after forward
BENCH_LAYOUTS = {("ddp", "keep"): ("ddp", False), ("fsdp2-owner", "keep"): ("fsdp-keep", False),
                 ("fsdp2-owner", "free"): ("fsdp-free", True), ("fsdp2-sharded", "keep"): ("sharded", False),
                 ("fsdp2-sharded", "free"): ("sharded", True)}
# the CPU validation runs: (bench step options, label); every strategy in each
CPU_RUNS = tuple(
    [(["--layout", lay, "--memory", mem], f"bench model, {lay} {mem}") for lay, mem in BENCH_LAYOUTS]
    + [(["--model", "experiments/models/llama-3.1-70b/config.json", "--layers", "2", "--hidden", "512",
         "--vocab", "8192", "--layout", lay, "--memory", mem], f"HF Llama (transformers), {lay} {mem}")
       for lay, mem in (("ddp", "keep"), ("fsdp2-owner", "keep"), ("fsdp2-sharded", "keep"))])
CPU_COMMON = ["--ranks", "2", "--strategy", "adamw,naive,dmuon", "--width-scale", "0.25", "--layers", "2",
              "--seq-len", "128", "--micro-batch", "2", "--steps", "1", "--warmup", "1", "--rounds", "1",
              "--exact-memory", "--no-phase-barrier"]


# ---- the formulas ------------------------------------------------------------------------------------
def _gpt_block(h: int, layer: int = 1):
    from simulator.models.workload_spec import ParamSpec

    mats = [("ln_1", 1, h), ("c_attn", 3 * h, h), ("attn.c_proj", h, h), ("ln_2", 1, h), ("c_fc", 4 * h, h),
            ("mlp.c_proj", h, 4 * h)]
    return [ParamSpec(f"b.{n}", "lm", n, r, c, layer, "muon", block=0,
                      matmuls_per_token=0.0 if r == 1 else 1.0, attn_width=h if n == "c_attn" else 0.0)
            for n, r, c in mats]


def formula_checks() -> list[dict]:
    from simulator.models.memory_activations import attention_s2_bytes, block_bytes_per_token, korthikanti_layer_bytes

    s, b, h, a, t = 2048, 1, 12288, 96, 8
    block = _gpt_block(h)
    out = []
    for label, tp, sp, rc in (("eq. 1: no TP", 1, False, "none"), ("eq. 2: TP 8", t, False, "none"),
                              ("eq. 3: TP 8 + SP", t, True, "none"), ("eq. 6: selective, TP 8 + SP", t, True,
                                                                       "selective"),
                              ("full recompute, TP 8 + SP", t, True, "full")):
        paper = korthikanti_layer_bytes(s, b, h, a, tp=tp, sp=sp, recompute=rc)
        counted = block_bytes_per_token(block, 2, tp=tp, sp=sp, recompute=rc, dropout=True) * s * b
        if rc == "none":
            counted += attention_s2_bytes(s, b, a, tp)
        out.append(_row("memory_formulas", f"GPT-3 175B layer, {label}", "gpt3-175b", "-", "activations",
                        "bytes", paper, "Korthikanti et al. 2022 (arXiv:2205.05198) formula", counted,
                        FORMULA_BOUND, True, "the per-tensor count of simulator.models.memory_activations"))
    return out


# ---- public tables -----------------------------------------------------------------------------------
def _public_config(r: dict):
    """(SimConfig with the row's tp / pp / sp, memory_of keyword arguments) of a memory_public.csv row."""
    from simulator.api import SimConfig

    wl = r["workload"]
    model = wl if (ROOT / "experiments" / "models" / wl).is_dir() else None
    cfg = SimConfig(workload=wl if model is None else "qwen2.5-7b", model=model, gpus=int(r["gpus"]),
                    gpu=r["gpu"], strategy="adamw", layout=r["layout"], seq_len=int(r["seq_len"]),
                    micro_batch=int(r["micro_batch"]), param_dtype=r["param_dtype"],
                    grad_comm_dtype=r["grad_comm_dtype"], tp=int(r["tp"]), pp=int(r["pp"]),
                    sp=int(r["tp"]) > 1)  # torchtitan's TP runs with sequence parallelism
    return cfg, {"recompute": r["recompute"], "loss_fp32": r["loss_fp32"] == "yes"}


def public_checks(path: Path = PUBLIC_CSV) -> list[dict]:
    from simulator.api import memory_of

    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            cfg, kw = _public_config(r)
            m = memory_of(cfg, **kw)
            note = (f"{r['note']}; modelled {m.peak_phase}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in m.gib().items() if k != "peak") + " GiB")
            out.append(_row("memory_public", f"{r['series']}: {r['label']}", r["workload"], "adamw",
                            "peak_memory", "GiB", float(r["value_gib"]), f"published ({r['metric']}): "
                            f"{r['source']}", m.peak_gib, PUBLIC_BOUND, r["checked"] == "yes", note, r["gpu"]))
    out += paper_rows()
    return out


PAPER_METHODS = {"FSDP2+AdamW": ("adamw", "fsdp-keep"), "FSDP2+Muon": ("naive", "fsdp-keep"),
                 "DMuon": ("dmuon", "fsdp-keep"), "DDP+Muon": ("naive", "ddp")}


def paper_rows() -> list[dict]:
    """reported.csv's a800_8gpu_llm peak_memory rows (GB) vs memory_of (bf16 parameters, as the project's
    runtime trains on CUDA: harness bench step builds the model in bf16). Shown only."""
    from simulator.api import SimConfig
    from simulator.api import memory_of
    from simulator.validation.reference import reported_rows

    out = []
    for r in reported_rows():
        if r.get("table") != "a800_8gpu_llm" or r.get("metric") != "peak_memory":
            continue
        strategy, layout = PAPER_METHODS[r["method"]]
        m = memory_of(SimConfig(workload=r["workload"], gpus=int(r["gpus"]), strategy=strategy, layout=layout,
                                param_dtype="bf16"))
        out.append(_row("memory_public", f"DMuon paper 8 x A800: {r['workload']} {r['method']}", r["workload"],
                        strategy, "peak_memory", "GiB", float(r["value"]) * 1e9 / GIB,
                        "published: reported.csv a800_8gpu_llm (GB)", m.peak_gib, PUBLIC_BOUND, False,
                        "shown only: the paper states neither its mixed precision nor its recomputation "
                        f"(modelled: bf16 parameters, no recompute, {m.peak_phase} peak)", "a800"))
    return out


# ---- this CPU ------------------------------------------------------------------------------------------
def modelled_peak(row: dict, model_raw: dict | None = None, workload=None) -> dict:
    """memory_of of one `harness bench step` row (its model, ranks, layout, strategy, tokens): columns
    model_peak_mem_bytes and model_peak_mem_error (modelled / measured - 1). The bench model's workload
    (`workload`) or the HF config (`model_raw`) gives the matrices."""
    from simulator.api import SimConfig
    from simulator.api import memory_of

    key = (row["layout"], row["memory"])
    if key not in BENCH_LAYOUTS or row.get("device") != "cpu":
        return {}
    layout, free = BENCH_LAYOUTS[key]
    if model_raw is not None:
        from simulator.models.hf_config import workload_from_config

        workload = workload_from_config(model_raw, name=str(row.get("workload", "model")))
    if workload is None:
        return {}
    cfg = SimConfig(workload=workload, gpus=int(row["ranks"]), gpu="cpu", strategy=row["strategy"],
                    layout=layout, seq_len=int(row["seq_len"]), micro_batch=int(row["micro_batch"]),
                    grad_comm_dtype=row.get("comm_dtype") or None, max_split=int(row.get("max_split", 1)),
                    naive_batching=True)  # dmuon.NaiveMuon: one NS call per shape
    m = memory_of(cfg, free=free)
    measured = float(row["peak_mem_bytes"])
    return {"model_peak_mem_bytes": m.peak_bytes,
            "model_peak_mem_error": m.peak_bytes / measured - 1 if measured > 0 else math.nan}


def measure_cpu_rows(progress=None) -> list[dict]:
    """Run every CPU_RUNS configuration with `harness bench step` (2 ranks, --exact-memory) and return its
    rows (modelled beside measured, as bench step records them) with a `run` label."""
    import json
    import os
    import subprocess
    import sys

    rows = []
    for opts, label in CPU_RUNS:
        if progress:
            progress(f"memory: {label}")
        cmd = [sys.executable, "-m", "harness.cli", "bench", "step", *CPU_COMMON, *opts, "--json"]
        if "--model" in opts:  # the HF model's own size: no bench-model width
            i = cmd.index("--width-scale")
            del cmd[i:i + 2]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ), check=False)
        if res.returncode:
            raise RuntimeError(f"bench step {' '.join(opts)} failed: {res.stderr[-2000:]}")
        data = json.loads(res.stdout[res.stdout.index("{"):])
        for r in data.get("rows", [data]):
            rows.append({"run": label, **{k: r.get(k) for k in CPU_COLUMNS}})
    return rows


CPU_COLUMNS = ("workload", "model_type", "strategy", "layout", "memory", "ranks", "width_scale", "layers", "hidden",
               "vocab", "seq_len", "micro_batch", "n_params", "exact_memory", "peak_mem_bytes",
               "model_peak_mem_bytes", "model_peak_mem_error", "torch_version", "measured_at")


def remodel(row: dict, opts: list[str]) -> dict:
    """`row` (CPU_COLUMNS of one bench step row) with its modelled columns recomputed now from the run's
    options (CPU_COMMON + `opts`: the bench model's width and blocks, or the HF config and its shrink)."""
    args = CPU_COMMON + opts

    def opt(name, convert=str):
        return convert(args[args.index(name) + 1]) if name in args else None

    model_raw, workload = None, None
    if opt("--model"):
        from .hf_model import read_config, shrink  # no transformers: the run built this config already

        model_raw = shrink(read_config(opt("--model"))[1], layers=opt("--layers", int),
                           hidden=opt("--hidden", int), vocab=opt("--vocab", int))
    else:
        from simulator.models.workload import load_workload

        workload = load_workload(opt("--workload") or "qwen2.5-7b").scaled(opt("--width-scale", float),
                                                                           blocks=opt("--layers", int))
    full = {**row, "device": "cpu", "comm_dtype": None, "max_split": 1}
    return {**row, **modelled_peak(full, model_raw, workload)}


def cpu_checks(path: Path = CPU_CSV) -> list[dict]:
    """The committed measurements against the current memory model (`remodel`: the file's modelled
    columns are those of the model when it was written)."""
    if not path.is_file():
        return []
    labels = {label: opts for opts, label in CPU_RUNS}
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["run"] not in labels:
                raise ValueError(f"{path}: unknown run {r['run']!r}; accepted: {', '.join(labels)}")
            modelled = remodel(r, labels[r["run"]])["model_peak_mem_bytes"]
            out.append(_row("memory_cpu", f"{r['run']}: {r['strategy']}", r["workload"], r["strategy"],
                            "peak_memory", "GiB", float(r["peak_mem_bytes"]) / GIB,
                            f"measured here: harness bench step --exact-memory ({r['measured_at']})",
                            float(modelled) / GIB, CPU_BOUND, True,
                            f"{r['n_params']} parameters, 2 ranks, seq {r['seq_len']} x {r['micro_batch']}",
                            "cpu"))
    return out


def memory_checks() -> list[dict]:
    """Every memory row of `harness validate` (the CPU rows from the committed measurement)."""
    return formula_checks() + public_checks() + cpu_checks()


__all__ = ["memory_checks", "formula_checks", "public_checks", "cpu_checks", "measure_cpu_rows", "modelled_peak",
           "remodel"]
