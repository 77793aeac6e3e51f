"""SimPy cost simulator of distributed Muon / AdamW training steps.

    from simulator import SimConfig, simulate
    r = simulate(SimConfig(workload="qwen2.5-7b", gpus=64, strategy="dmuon", layout="fsdp-keep"))
    r.step_s, r.optimizer_s, r.provenance

Modules: workload (model shapes), hardware + profiles/ (devices and fabrics, with provenance),
collectives (closed-form costs), compute (layer FLOPs), engine (SimPy streams and collectives),
step (per-rank programs per strategy / layout), setup + costs + api (config -> result), metrics, trace
(Chrome trace), validate (against published numbers), calibrate_a800 / calibrate_cpu (profile fits).
Nothing here imports simpy (or torch) until a simulation runs: the names below load lazily.
"""

from __future__ import annotations

_LAZY = {"SimConfig": "api", "SimResult": "api", "simulate": "api", "load_workload": "workload",
         "load_profile": "hardware", "write_trace": "trace"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'simulator' has no attribute {name!r}")
