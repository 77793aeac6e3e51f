"""Static check of the symmetric kernel for a GPU target, on any machine (no GPU needed).

    python -m dmuon.kernels.compile_check [--arch 90] [--all]

Compiles `_sym_product_kernel` ahead of time with `triton.compile` for the given CUDA architecture
(default sm_90, Hopper), for the candidate tile configs, and reports per variant: compile time,
tensor-core instructions in the PTX (`wgmma.mma_async` on Hopper, `mma.sync` before), shared memory,
and the registers / spills that Triton's bundled ptxas reports. The variants use the argument
specialization the JIT gives aligned, contiguous tensors (unit inner strides, 16-divisible sizes),
with and without masks (sizes that are / are not multiples of the tile).
Needs TRITON_INTERPRET unset (the interpreter has nothing to compile); uses Triton internals
(`triton.compiler.ASTSource`, `GPUTarget`) that may move between Triton versions.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from .configs import TileConfig, candidates

_PTR_ARGS = ("p_ptr", "q_ptr", "d_ptr", "c_ptr")
_CONSTEXPR_ARGS = ("HAS_D", "EVEN", "UPCAST", "PRECISION", "BLOCK", "BLOCK_K")
_DIV16_INTS = ("N", "K", "sp_b", "sp_n", "sq_b", "sq_k", "sq_n", "sd_b", "sd_r", "sc_b", "sc_r")


@dataclass(frozen=True)
class CompileReport:
    op: str  # syrk | symm
    dtype: str
    even: bool
    config: TileConfig
    compile_s: float
    wgmma: int  # wgmma.mma_async instructions in the PTX
    mma_sync: int  # mma.sync instructions in the PTX
    shared_bytes: int
    ptxas: str  # registers / spill line(s) of ptxas -v ("" if ptxas is not found)

    @property
    def spills(self) -> bool:
        return bool(re.search(r"[1-9]\d* bytes spill", self.ptxas))

    def line(self) -> str:
        return (f"{self.op} {self.dtype} even={self.even} {self.config.label()}: {self.compile_s:.1f} s, "
                f"wgmma {self.wgmma}, mma.sync {self.mma_sync}, smem {self.shared_bytes} B, {self.ptxas}")


def compile_variant(op: str, dtype: str, config: TileConfig, *, even: bool = True, aligned: bool = True,
                    arch: int = 90, precision: str = "tf32") -> CompileReport:
    """Compile one kernel variant for sm_<arch> and inspect the result.

    even: n and K are multiples of the tile (no masks); aligned: sizes and strides are multiples of 16
    elements (what the JIT sees for every Muon shape of the workload catalog, e.g. K = 4304: not even,
    aligned). Unaligned variants (n = 777) compile to a slower, spilling path: correct, not fast.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .triton_kernels import INTERPRETED, _sym_product_kernel

    if INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET is set: unset it to compile the kernel for a GPU target")
    if op not in ("syrk", "symm"):
        raise ValueError(f"unknown op {op!r}; accepted: syrk, symm")
    ttype = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[dtype]
    names = list(_sym_product_kernel.arg_names)
    units = ("sp_k", "sd_c", "sc_c", "sq_k" if op == "syrk" else "sq_n")  # unit strides (syrk: Q = X^T)
    sig, constexprs = {}, {"HAS_D": op == "symm", "EVEN": even, "UPCAST": False, "PRECISION": precision,
                           "BLOCK": config.block, "BLOCK_K": config.block_k}
    for a in names:
        if a in _PTR_ARGS:
            sig[a] = "*" + ttype
        elif a == "tiles_ptr":
            sig[a] = "*i32"
        elif a in ("alpha", "beta"):
            sig[a] = "fp32"
        elif a in _CONSTEXPR_ARGS or a in units:
            sig[a] = "constexpr"
            constexprs.setdefault(a, 1)
        else:
            sig[a] = "i32"
    div16 = [a for a in names if sig[a].startswith("*") or (aligned and a in _DIV16_INTS and sig[a] == "i32")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div16}
    t0 = time.perf_counter()
    kernel = triton.compile(ASTSource(_sym_product_kernel, sig, constexprs, attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    compile_s = time.perf_counter() - t0
    ptx = kernel.asm["ptx"]
    return CompileReport(op, dtype, even, config, compile_s, len(re.findall(r"wgmma\.mma_async", ptx)),
                         len(re.findall(r"\bmma\.sync", ptx)), int(kernel.metadata.shared),
                         _ptxas_info(ptx, arch, triton.__file__))


def _ptxas_info(ptx: str, arch: int, triton_file: str) -> str:
    ptxas = os.path.join(os.path.dirname(triton_file), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return ""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        gpu = f"sm_{arch}{'a' if arch == 90 else ''}"
        res = subprocess.run([ptxas, "-v", "--gpu-name", gpu, src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, timeout=120)
    keep = [ln.split(":", 1)[-1].strip() for ln in res.stderr.splitlines()
            if "registers" in ln or "spill" in ln]
    return "; ".join(keep) if res.returncode == 0 else f"ptxas failed: {res.stderr.strip()[:300]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dmuon.kernels.compile_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90 = Hopper)")
    p.add_argument("--all", action="store_true", help="every candidate config, with and without masks")
    a = p.parse_args(argv)
    bad = 0
    for dtype in ("bf16", "fp16", "fp32"):
        cfgs = candidates(dtype) if a.all else candidates(dtype)[:1]
        for cfg in cfgs:
            for op in ("syrk", "symm"):
                for even in ((True, False) if a.all else (True,)):
                    r = compile_variant(op, dtype, cfg, even=even, arch=a.arch)
                    no_tc = a.arch >= 90 and r.wgmma == 0
                    bad += no_tc or r.spills
                    print(("FAIL " if no_tc or r.spills else "ok   ") + r.line(), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
