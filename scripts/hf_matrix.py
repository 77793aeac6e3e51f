"""Every Hugging Face family of tests/test_hf_models.py x {1, 2, 4} gloo ranks x every layout x {DMuon,
NaiveMuon}: 3 training steps each, the worst relative distance from single-process `dmuon.Muon` (fp32).
The test suite runs a subset of this grid (its time budget); this script runs all of it and prints one
line per (family, ranks), for docs/api.md.

    .venv/bin/python scripts/hf_matrix.py [--families qwen3_moe,gpt2] [--ranks 1,2,4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    from dist_utils import run_distributed
    from test_hf_models import ALL, CONFIGS, compared, reference, rel, run_family

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(sorted(CONFIGS)))
    ap.add_argument("--ranks", default="1,2,4")
    args = ap.parse_args()
    worst_all = 0.0
    for family in args.families.split(","):
        for world in (int(r) for r in args.ranks.split(",")):
            t0 = time.perf_counter()
            want = reference(family, world)
            results = run_distributed(run_family, world, args=(family, ALL, None), timeout_s=900)
            errs = {}
            for got in results:
                for case, weights in got.items():
                    e = max(rel(compared(n, weights[n]), compared(n, want[n])) for n in want)
                    errs[case] = max(errs.get(case, 0.0), e)
            worst = max(errs.values())
            worst_all = max(worst_all, worst)
            cells = ", ".join(f"{lay}/{s} {e:.1e}" for (lay, s), e in errs.items())
            print(f"{family:12s} {world} ranks: worst {worst:.1e} ({cells}) "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    print(f"worst over the grid: {worst_all:.1e} ({'within' if worst_all < 1e-5 else 'NOT within'} 1e-5)")


if __name__ == "__main__":
    main()
