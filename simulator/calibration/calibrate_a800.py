"""Fit the A800 profile's achieved forward / backward rates to the published 8 x A800 AdamW rows.

Model (simulator.models.compute): forward time of layer l = F_l / R_fwd + c_fwd, backward = 2 F_l / R_bwd + c_bwd.
Two unknowns per pass, fitted on FIT_MODELS (the smallest and the largest LLM) and checked on
HOLDOUT_MODELS: no per-model constants. The simulator is in the loop: what it adds on top of compute
(the exposed first all-gather in forward; the reduce-scatter tail that FSDP2's backward() waits for) is
subtracted from the published time before solving the 2 x 2 system, and the fit repeats until the rates
settle. Published convention (see simulator.validation.reference): backward includes the gradient-reduction tail.

The fitted values are written into simulator/profiles/a800.toml (and the H100 / H200 profiles get the
same achieved fraction of their datasheet peak and the same per-layer overheads), atomically, each with
its source line. Run:  python -m simulator.calibration.calibrate_a800  [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from simulator.models.compute import layer_flops
from simulator.fabric.hardware import PROFILE_DIR, load_profile
from simulator.validation.reference import LLM_GPUS, LLM_MICRO_BATCH, LLM_SEQ_LEN, llm_rows
from simulator.models.workload import load_workload

FIT_MODELS = ("qwen2.5-1.5b", "llama3.1-8b")
HOLDOUT_MODELS = ("llama3.2-3b", "qwen2.5-7b")
ITERATIONS = 6


def _solve2(a, b, y):
    """Solve [a0 b0; a1 b1] [x c]^T = y."""
    det = a[0] * b[1] - a[1] * b[0]
    x = (y[0] * b[1] - y[1] * b[0]) / det
    c = (a[0] * y[1] - a[1] * y[0]) / det
    return x, c


def _sim(profile, workload: str):
    from simulator.api import SimConfig, simulate

    return simulate(SimConfig(workload=workload, gpus=LLM_GPUS, gpu=profile, strategy="adamw",
                              layout="fsdp-keep", seq_len=LLM_SEQ_LEN, micro_batch=LLM_MICRO_BATCH))


def fit(verbose: bool = False) -> dict:
    base = load_profile("a800")
    rows = {r.workload: r for r in llm_rows() if r.method == "FSDP2+AdamW"}
    flops = {}
    for w in FIT_MODELS + HOLDOUT_MODELS:
        lf = layer_flops(load_workload(w), LLM_SEQ_LEN, LLM_MICRO_BATCH)
        flops[w] = (sum(x.fwd_flops for x in lf), sum(x.bwd_flops for x in lf), len(lf))
    prof = base
    for it in range(ITERATIONS):
        extra_f, extra_b = [], []
        for w in FIT_MODELS:
            f_fwd, f_bwd, n_l = flops[w]
            r = _sim(prof, w)
            compute_f = f_fwd / prof.fwd_flops + n_l * prof.fwd_layer_overhead_s
            compute_b = f_bwd / prof.bwd_flops + n_l * prof.bwd_layer_overhead_s
            extra_f.append(r.forward_s - compute_f)
            extra_b.append(r.backward_s + r.grad_sync_tail_s - compute_b)
        a_f = [flops[w][0] for w in FIT_MODELS]
        a_b = [flops[w][1] for w in FIT_MODELS]
        n = [flops[w][2] for w in FIT_MODELS]
        xf, cf = _solve2(a_f, n, [rows[w].forward_s - e for w, e in zip(FIT_MODELS, extra_f, strict=True)])
        xb, cb = _solve2(a_b, n, [rows[w].backward_s - e for w, e in zip(FIT_MODELS, extra_b, strict=True)])
        if xf <= 0 or xb <= 0 or cf < 0 or cb < 0:
            raise RuntimeError(f"fit left the physical range: 1/R_fwd {xf}, c_fwd {cf}, "
                               f"1/R_bwd {xb}, c_bwd {cb}")
        prof = dataclasses.replace(prof, fwd_flops=1 / xf, fwd_layer_overhead_s=cf, bwd_flops=1 / xb,
                                   bwd_layer_overhead_s=cb)
        if verbose:
            print(f"iteration {it}: fwd {1 / xf / 1e12:.2f} TFLOP/s + {cf * 1e3:.3f} ms/layer, "
                  f"bwd {1 / xb / 1e12:.2f} TFLOP/s + {cb * 1e3:.3f} ms/layer")
    errors = {}
    for w in FIT_MODELS + HOLDOUT_MODELS:
        r = _sim(prof, w)
        errors[w] = (r.forward_s / rows[w].forward_s - 1,
                     (r.backward_s + r.grad_sync_tail_s) / rows[w].backward_s - 1)
    return {"profile": prof, "errors": errors}


def _replace_entry(text: str, key: str, value: float, source: str) -> str:
    line = f'{key} = {{ value = {value:.6g}, source = "{source}" }}'
    new, k = re.subn(rf"^{re.escape(key)} = \{{.*\}}$", line, text, flags=re.M)
    if k != 1:
        raise RuntimeError(f"expected one {key} entry, found {k}")
    return new


def _write_atomic(path: Path, text: str) -> None:
    from dmuon.io import atomic_write_text

    atomic_write_text(path, text)


def write(result: dict) -> None:
    prof, errors = result["profile"], result["errors"]

    def err(i: int) -> str:
        return ", ".join(f"{w} {errors[w][i]:+.1%}" for w in HOLDOUT_MODELS)

    rows = "reported.csv a800_8gpu_llm FSDP2+AdamW {} rows of " + " and ".join(FIT_MODELS)
    how = ("(8 x A800, bf16, seq 2048, micro-batch 2; simulator in the loop, "
           "python -m simulator.calibration.calibrate_a800)")
    fwd_src = f"fit: {rows.format('forward')} {how}; held out: {err(0)}"
    bwd_src = f"fit: {rows.format('backward')} incl. the reduce-scatter tail {how}; held out: {err(1)}"
    path = PROFILE_DIR / "a800.toml"
    text = path.read_text()
    text = _replace_entry(text, "fwd_tflops", prof.fwd_flops / 1e12, fwd_src)
    text = _replace_entry(text, "fwd_layer_overhead_ms", prof.fwd_layer_overhead_s * 1e3, fwd_src)
    text = _replace_entry(text, "bwd_tflops", prof.bwd_flops / 1e12, bwd_src)
    text = _replace_entry(text, "bwd_layer_overhead_ms", prof.bwd_layer_overhead_s * 1e3, bwd_src)
    _write_atomic(path, text)
    eff_f, eff_b = prof.fwd_flops / prof.peak_bf16_flops, prof.bwd_flops / prof.peak_bf16_flops
    for name in ("h100", "h200"):
        p = PROFILE_DIR / f"{name}.toml"
        other = load_profile(p)
        src = (f"derived: A800 fit ({eff_f:.3f} fwd / {eff_b:.3f} bwd of the 312 TFLOP/s peak) x this GPU's "
               f"datasheet peak; ASSUMPTION: same achieved fraction (python -m simulator.calibration.calibrate_a800)")
        osrc = ("derived: A800 fitted per-layer overhead; "
                "ASSUMPTION: host-side overheads do not scale with the GPU")
        t = p.read_text()
        t = _replace_entry(t, "fwd_tflops", eff_f * other.peak_bf16_flops / 1e12, src)
        t = _replace_entry(t, "bwd_tflops", eff_b * other.peak_bf16_flops / 1e12, src)
        t = _replace_entry(t, "fwd_layer_overhead_ms", prof.fwd_layer_overhead_s * 1e3, osrc)
        t = _replace_entry(t, "bwd_layer_overhead_ms", prof.bwd_layer_overhead_s * 1e3, osrc)
        _write_atomic(p, t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="fit and print, write nothing")
    args = ap.parse_args(argv)
    result = fit(verbose=True)
    prof = result["profile"]
    print(f"forward  {prof.fwd_flops / 1e12:.2f} TFLOP/s + {prof.fwd_layer_overhead_s * 1e3:.3f} ms/layer")
    print(f"backward {prof.bwd_flops / 1e12:.2f} TFLOP/s + {prof.bwd_layer_overhead_s * 1e3:.3f} ms/layer")
    for w, (ef, eb) in result["errors"].items():
        tag = "fit" if w in FIT_MODELS else "held out"
        print(f"  {w:14s} ({tag:8s}) forward {ef:+.2%}  backward {eb:+.2%}")
    if not args.dry_run:
        write(result)
        print(f"written: {PROFILE_DIR / 'a800.toml'}, h100.toml, h200.toml")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
