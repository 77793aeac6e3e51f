"""The published numbers the simulator is calibrated on and validated against (reported.csv).

Reads experiments/reference/reported.csv (a copy of the shared reference facts). Method names of the
8 x A800 LLM table map to our strategies and layouts:
    FSDP2+AdamW -> adamw / fsdp-keep      FSDP2+Muon -> naive / fsdp-keep (the "FSDP2 ZeRO-2-like"
    DMuon       -> dmuon / fsdp-keep      setting = parameters kept after forward)
    DDP+Muon    -> naive / ddp
All published LLM runs: bf16, sequence length 2048, micro-batch 2 per GPU, 8 GPUs in one node.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPORTED_PATH = Path(__file__).resolve().parents[2] / "experiments" / "reference" / "reported.csv"
LLM_TABLE = "a800_8gpu_llm"
METHOD_MAP = {
    "FSDP2+AdamW": ("adamw", "fsdp-keep"),
    "FSDP2+Muon": ("naive", "fsdp-keep"),
    "DMuon": ("dmuon", "fsdp-keep"),
    "DDP+Muon": ("naive", "ddp"),
}
LLM_SEQ_LEN = 2048
LLM_MICRO_BATCH = 2
LLM_GPUS = 8


@dataclass(frozen=True)
class LlmRow:
    workload: str
    method: str  # as published
    strategy: str
    layout: str
    forward_s: float
    backward_s: float
    optimizer_s: float
    step_s: float


@lru_cache(maxsize=1)
def reported_rows() -> tuple[dict, ...]:
    with open(REPORTED_PATH, newline="") as f:
        return tuple(csv.DictReader(f))


def llm_rows() -> tuple[LlmRow, ...]:
    """The 8 x A800 step breakdowns, one row per (workload, method), seconds."""
    acc: dict[tuple[str, str], dict[str, float]] = {}
    for r in reported_rows():
        if r["table"] != LLM_TABLE or r["metric"] not in ("forward", "backward", "optimizer", "step"):
            continue
        if r["unit"] != "ms":
            raise ValueError(f"unexpected unit {r['unit']!r} in {LLM_TABLE}")
        acc.setdefault((r["workload"], r["method"]), {})[r["metric"]] = float(r["value"]) * 1e-3
    out = []
    for (w, m), v in acc.items():
        strategy, layout = METHOD_MAP[m]
        out.append(LlmRow(w, m, strategy, layout, v["forward"], v["backward"], v["optimizer"], v["step"]))
    return tuple(out)


def claims() -> dict[str, float]:
    """The paper's headline numbers (table paper_claims), keyed by metric."""
    return {r["metric"]: float(r["value"]) for r in reported_rows() if r["table"] == "paper_claims"}


def ns_replay_rows() -> tuple[dict, ...]:
    return tuple(r for r in reported_rows() if r["table"] == "a800_8gpu_ns_replay")
