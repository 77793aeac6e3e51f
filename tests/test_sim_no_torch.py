"""The simulator prices a step without torch: `harness simulate` must not pay torch's import (seconds on
this CPU) and must run where torch is absent. The owner exchange's cost model lives in
dmuon.plan.exchange_cost for that reason; dmuon.runtime.exchange re-exports it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_simulate_imports_no_torch():
    code = """
import sys
from simulator.api import SimConfig, simulate
for layout in ("fsdp-keep", "hsdp-free", "sharded"):
    r = simulate(SimConfig(workload="qwen2.5-7b", gpus=16, strategy="dmuon", layout=layout))
    assert r.step_s > 0
# a Hugging Face config.json, routed by dmuon.params.decide (torch imported only where tensors are cut)
assert simulate(SimConfig(model="qwen3-30b-a3b", gpus=16, ep=8)).step_s > 0
print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"simulate imported torch modules: {out.stdout.strip()}"


def test_runtime_reexports_the_one_cost_model():
    import dmuon.plan.exchange_cost as cost
    import dmuon.runtime.exchange as ex

    for name in ("choose_mode", "exchange_costs_s", "LinkEstimate", "LINKS", "EXCHANGE_MODES",
                 "EXCHANGE_CHOICES", "links_from_model"):
        assert getattr(ex, name) is getattr(cost, name), name
