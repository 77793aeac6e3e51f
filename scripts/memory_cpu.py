"""Measure the memory model on this CPU: every harness.validation_memory.CPU_RUNS configuration with
`harness bench step --exact-memory` (2 ranks, adamw / naive / dmuon in each), modelled beside measured,
written to results/validation/memory_cpu.csv (what `harness validate`'s memory_cpu rows read).

    python scripts/memory_cpu.py                      # run them all (one after another)
    python scripts/memory_cpu.py --from-json a.json:LABEL ...   # rows of bench step --json outputs
                                                      # (LABEL: the CPU_RUNS label of that run)
The modelled columns are recomputed with the current simulator.models.memory either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.validation_memory import CPU_COLUMNS, CPU_CSV, CPU_RUNS, measure_cpu_rows, remodel  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-json", nargs="*", default=None, help="PATH:LABEL of bench step --json outputs")
    ap.add_argument("--out", default=str(CPU_CSV))
    a = ap.parse_args(argv)
    labels = {label: opts for opts, label in CPU_RUNS}
    if a.from_json is None:
        rows = measure_cpu_rows(progress=lambda s: print(s, file=sys.stderr, flush=True))
    else:
        rows = []
        for item in a.from_json:
            path, label = item.split(":", 1)
            if label not in labels:
                raise SystemExit(f"unknown run label {label!r}; accepted: {', '.join(labels)}")
            text = Path(path).read_text()
            data = json.loads(text[text.index("{"):])
            rows += [{"run": label, **{k: r.get(k) for k in CPU_COLUMNS}} for r in data.get("rows", [data])]
    rows = [remodel(r, labels[r["run"]]) for r in rows]
    import pandas as pd

    from dmuon.io import atomic_path

    with atomic_path(a.out) as tmp:
        pd.DataFrame(rows, columns=["run", *CPU_COLUMNS]).to_csv(tmp, index=False)
    print(f"written: {a.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
