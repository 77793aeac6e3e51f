"""Two ways of one `orthogonalize` call, side by side in one process (calls alternate, paired; one thread,
CPU time; the first two pairs are warm-up):

  --what tall: a stack of tall matrices iterated as it is with torch ops (R = X^T X for Gram NS, A = X^T X
      for standard NS; what runs now) vs transposed into the wide orientation at normalization and back at
      the end (what ran before, and what the Triton kernels still need);
  --what normalize: the plain X / (||X|| + eps) on a CPU where the norm is safe (what runs now) vs the
      scaled way, the norm of X / max|X| (what ran before, and what runs on other devices).

    PYTHONPATH=. .venv/bin/python scripts/ns_ab.py --what tall [--method gram] [--rounds 12]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--what", default="tall", choices=("tall", "normalize"))
    ap.add_argument("--method", default="gram", choices=("gram", "standard"))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--shapes", default=None, help="e.g. 8x1184x224,4x1184x224 (default: per --what)")
    args = ap.parse_args()
    import torch

    import dmuon.newton_schulz as ns

    torch.set_num_threads(1)
    shapes = args.shapes or ("8x1184x224,4x1184x224,1x1184x224" if args.what == "tall"
                             else "8x224x1184,4x1184x224,8x224x224,8x32x224")
    as_is, direct_min = ns._call_setup, ns.DIRECT_NORM_MIN

    @contextlib.contextmanager
    def before():
        if args.what == "tall":  # the same call, with the tall-as-is answer turned off
            ns._call_setup = lambda *a, **kw: (*as_is(*a, **kw)[:4], False)
        else:  # no norm passes the check: always the scaled way
            ns.DIRECT_NORM_MIN = float("inf")
        try:
            yield
        finally:
            ns._call_setup, ns.DIRECT_NORM_MIN = as_is, direct_min

    def timed(g, dtype, old: bool) -> float:
        with before() if old else contextlib.nullcontext():
            start = time.process_time()
            ns.orthogonalize(g, method=args.method, dtype=dtype)
            return time.process_time() - start

    torch.manual_seed(0)
    for spec in shapes.split(","):
        g = torch.randn(*(int(v) for v in spec.split("x")))
        if args.what == "tall" and not g.shape[-2] > g.shape[-1]:
            raise SystemExit(f"{spec}: not tall")
        for dtype in ("fp32", "bf16"):
            old, new = [], []
            for i in range(args.rounds):
                for is_old in ((True, False) if i % 2 else (False, True)):
                    (old if is_old else new).append(timed(g, dtype, is_old))
            ratios = sorted(a / b for a, b in zip(old[2:], new[2:], strict=True))
            print(f"{spec} {args.method} {dtype}: before {statistics.median(old) * 1e3:.2f} ms, now "
                  f"{statistics.median(new) * 1e3:.2f} ms; paired before / now median "
                  f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
