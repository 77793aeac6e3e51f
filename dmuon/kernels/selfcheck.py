"""Numerical self-check of the Triton ops against float64 torch, runnable without pytest.

    python -m dmuon.kernels.selfcheck            # CUDA cases on a GPU; tiny interpreter cases on a CPU

Each case builds fresh random inputs, runs one Triton op (or Gram NS through it) and checks: shape and
dtype, exact symmetry of the output (torch.equal(out, out^T)) and the relative Frobenius error against
float64 torch on the same (rounded) inputs. tests/test_kernels_cuda.py runs the same cases under
pytest; this module is for GPU machines where pytest is missing (scripts/gpu_check.sh).
On a CPU without CUDA, `main` sets TRITON_INTERPRET=1 before the kernels are imported.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class Case:
    """op: syrk | sym_poly | sym_mul_add | gram_ns; layout: contiguous | transposed (a .mT view)."""

    op: str
    batch: int  # 0: a plain 2-D input
    n: int
    m: int  # reduction length for syrk / gram_ns (ignored by the square ops)
    dtype: str
    layout: str = "contiguous"

    @property
    def name(self) -> str:
        b = f"{self.batch}x" if self.batch else ""
        return f"{self.op}[{b}{self.n}x{self.m},{self.dtype},{self.layout}]"


CUDA_CASES = (
    Case("syrk", 0, 1024, 4096, "bf16"),
    Case("syrk", 3, 333, 1000, "fp16"),
    Case("syrk", 4, 512, 3584, "bf16", "transposed"),
    Case("syrk", 0, 4096, 4096, "bf16"),
    Case("syrk", 2, 257, 129, "fp32"),
    Case("sym_poly", 0, 1024, 1024, "bf16"),
    Case("sym_poly", 2, 777, 777, "fp16"),
    Case("sym_poly", 0, 2048, 2048, "fp32"),
    Case("sym_mul_add", 0, 1024, 1024, "bf16"),
    Case("sym_mul_add", 3, 300, 300, "fp16", "transposed"),
    Case("gram_ns", 0, 1024, 5120, "fp16"),
    Case("gram_ns", 4, 512, 3584, "bf16"),
    Case("gram_ns", 0, 384, 2000, "fp32"),
)
CPU_CASES = (
    Case("syrk", 0, 5, 7, "fp32"),
    Case("syrk", 3, 33, 45, "fp32", "transposed"),
    Case("sym_poly", 2, 17, 17, "fp32"),
    Case("sym_mul_add", 0, 33, 33, "fp32"),
    Case("gram_ns", 2, 24, 40, "fp32"),
)


def tolerance(case: Case, device_type: str) -> float:
    """Max relative error vs float64: 1e-2 for half types; fp32 1e-5 (interpreter / ieee), 5e-3 under tf32."""
    import torch

    if case.dtype != "fp32":
        return 1e-2
    if device_type == "cpu" or torch.get_float32_matmul_precision() == "highest":
        return 1e-4 if case.op == "gram_ns" else 1e-5
    return 5e-3


def _rand(shape, layout, dtype, gen, device):
    import torch

    if layout == "transposed":  # same values, stored transposed: a non-contiguous view
        return torch.randn(shape[:-2] + shape[-2:][::-1], generator=gen, device=device).mT.to(dtype)
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def check_case(case: Case, device: str = "cuda", seed: int = 0) -> tuple[bool, str]:
    """Run one case; (passed, one-line report)."""
    import torch

    from dmuon.kernels import get_ops

    dtype = getattr(torch, _DTYPES[case.dtype])
    gen = torch.Generator(device=device).manual_seed(seed)
    lead = (case.batch,) if case.batch else ()
    n, m = case.n, case.m
    if case.op == "gram_ns":
        from dmuon.newton_schulz import orthogonalize

        g = _rand(lead + (n, m), case.layout, torch.float32, gen, device)
        out = orthogonalize(g, method="gram", kernels="triton", dtype=dtype)
        ref_t = orthogonalize(g, method="gram", kernels="torch", dtype=dtype)
        ref = orthogonalize(g.double(), method="gram", kernels="torch", dtype=torch.float64)
        err, err_torch = _rel(out, ref), _rel(ref_t, ref)
        bound = max(tolerance(case, torch.device(device).type), 1.5 * err_torch)
        ok = out.shape == g.shape and err <= bound
        return ok, (f"{case.name}: rel err {err:.2e} vs float64 (torch ops: {err_torch:.2e}; bound "
                    f"{bound:.1e})")
    ops = get_ops(torch.empty(0, device=device, dtype=dtype), "triton")
    if case.op == "syrk":
        x = _rand(lead + (n, m), case.layout, dtype, gen, device) / m ** 0.5
        out, ref = ops.syrk(x), x.double() @ x.double().mT
    else:
        g = torch.randn(lead + (n, n), generator=gen, device=device) / n ** 0.5
        r = (g + g.mT).to(dtype)  # exactly symmetric after rounding
        if case.op == "sym_poly":
            r = r.mT if case.layout == "transposed" else r
            b, c = -4.7750, 2.0315
            out, ref = ops.sym_poly(r, b, c), b * r.double() + c * (r.double() @ r.double())
        elif case.op == "sym_mul_add":
            z = (r.double() @ r.double() - 0.5 * r.double()).to(dtype)  # a polynomial in r: commutes
            z = torch.tril(z) + torch.tril(z, -1).mT
            if case.layout == "transposed":  # same values (symmetric), non-contiguous views
                r, z = r.mT, z.mT
            out, ref = ops.sym_mul_add(r, z, 3.4445), r.double() @ z.double() + 3.4445 * r.double()
        else:
            raise ValueError(f"unknown op {case.op!r}; accepted: syrk, sym_poly, sym_mul_add, gram_ns")
    err = _rel(out, ref)
    sym = bool(torch.equal(out, out.mT))
    ok = err <= tolerance(case, torch.device(device).type) and sym and out.dtype == dtype and tuple(
        out.shape) == lead + (n, n)
    return ok, f"{case.name}: rel err {err:.2e}, exactly symmetric {sym}, dtype {out.dtype}"


def _rel(out, ref) -> float:
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


def run_cases(cases, device: str) -> int:
    """Run and print every case; the number of failures."""
    failures = 0
    for case in cases:
        try:
            ok, line = check_case(case, device)
        except Exception as e:  # report and go on: one broken case must not hide the others
            ok, line = False, f"{case.name}: {type(e).__name__}: {e}"
        failures += not ok
        print(("PASS " if ok else "FAIL ") + line, flush=True)
    return failures


def main() -> int:
    if os.environ.get("DMUON_SELFCHECK_DEVICE") == "cpu" or not _cuda():
        os.environ["TRITON_INTERPRET"] = "1"  # before dmuon.kernels.triton_ops is imported
        device, cases = "cpu", CPU_CASES
    else:
        device, cases = "cuda", CUDA_CASES
    failures = run_cases(cases, device)
    print(f"selfcheck on {device}: {len(cases) - failures}/{len(cases)} passed", flush=True)
    return 1 if failures else 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
