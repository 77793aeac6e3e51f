"""Tall matrices as they are vs transposed, side by side in one process: `orthogonalize` of a stack of
tall matrices, with torch ops, iterated as it is (R = X^T X for Gram NS, A = X^T X for standard NS; what
runs now) and transposed into the wide orientation at normalization and back at the end (what ran
before, and what the Triton kernels still need). Calls alternate, paired, one thread, CPU time.

    PYTHONPATH=. .venv/bin/python scripts/tall_ab.py [--method gram] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="gram", choices=("gram", "standard"))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--shapes", default="8x1184x224,4x1184x224,1x1184x224")
    args = ap.parse_args()
    import torch

    import dmuon.newton_schulz as ns

    torch.set_num_threads(1)
    as_is = ns._call_setup

    def transposed(*a, **kw):  # the same call, with the tall-as-is answer turned off
        return (*as_is(*a, **kw)[:4], False)

    def timed(g, dtype, setup) -> float:
        ns._call_setup = setup
        try:
            start = time.process_time()
            ns.orthogonalize(g, method=args.method, dtype=dtype)
            return time.process_time() - start
        finally:
            ns._call_setup = as_is

    torch.manual_seed(0)
    for spec in args.shapes.split(","):
        g = torch.randn(*(int(v) for v in spec.split("x")))
        assert g.shape[-2] > g.shape[-1], f"{spec}: not tall"
        for dtype in ("fp32", "bf16"):
            old, new = [], []
            for i in range(args.rounds):
                pair = [(old, transposed), (new, as_is)]
                for out, setup in (pair if i % 2 else pair[::-1]):
                    out.append(timed(g, dtype, setup))
            ratios = sorted(a / b for a, b in zip(old[2:], new[2:], strict=True))  # first two: warm-up
            print(f"{spec} {args.method} {dtype}: transposed {statistics.median(old) * 1e3:.2f} ms, as it is "
                  f"{statistics.median(new) * 1e3:.2f} ms; paired transposed / as-is median "
                  f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
