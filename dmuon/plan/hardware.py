"""Datasheet figures of the GPUs the project knows (profiles/hardware.csv) and the built-in cost profiles
(profiles/*.csv): what `CostTable.load` accepts by name."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .profile_io import DTYPES

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
HARDWARE_CSV = PROFILES_DIR / "hardware.csv"
ROOFLINE_SUFFIX = "-roofline"


@dataclass(frozen=True)
class Hardware:
    device: str
    peaks_flops: dict[str, float]
    hbm_bytes_per_s: float
    profile: str  # profile CSV file name expected in PROFILES_DIR ("" = none planned: datasheet roofline)
    source: str


@lru_cache(maxsize=1)
def hardware() -> dict[str, Hardware]:
    """Datasheet figures of the GPUs the project knows (profiles/hardware.csv)."""
    out = {}
    with open(HARDWARE_CSV, newline="") as f:
        for r in csv.DictReader(f):
            peaks = {d: float(r[f"{d}_flops"]) for d in DTYPES}
            out[r["device"]] = Hardware(
                r["device"], peaks, float(r["hbm_bytes_per_s"]), r["profile"], r["source"]
            )
    return out


def _profile_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PROFILES_DIR.glob("*.csv")) if p.name != HARDWARE_CSV.name}


def available_profiles() -> list[str]:
    """Names `CostTable.load` accepts right now (besides a path to a profile CSV)."""
    names = set(_profile_files())
    for dev, hw in hardware().items():
        if not hw.profile:
            names.add(dev)
        names.add(dev + ROOFLINE_SUFFIX)
    return sorted(names)
