"""Autotuning of the symmetric kernels: the config search, the on-disk cache, and the 'auto' choice.

The search (`search`) runs each candidate config once (compiling it), checks its output against a
reference, times the survivors with an injected timer (CUDA events on a GPU: `cuda_event_timer`)
and returns the fastest verified one. Winners are cached per shape class (`configs.cache_key`) in
a JSON file: $DMUON_CACHE_DIR/autotune.json, default ~/.cache/dmuon/autotune.json. Each entry
keeps the torch time of the same op measured side by side, which is what `prefers_triton` reads
to decide kernels="auto": the exact shape class when measured, else the smallest n above which
Triton won in every measured n bucket, else the published default (cuBLAS wins for n <= 1024;
fp32 stays on torch until measured).
The file is written atomically (temp file + os.replace) after merging with what is on disk; a
corrupt file is ignored with a warning and rebuilt. No triton import here.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..io import cache_dir
from ..plan.flops import DEFAULT_AUTO_MIN_N, default_auto_min_n
from .configs import TileConfig, parse_key

CACHE_FORMAT = "dmuon-autotune/1"
ENV_AUTOTUNE = "DMUON_AUTOTUNE"


def cache_path() -> Path:
    """Where the autotune cache lives: $DMUON_CACHE_DIR/autotune.json or ~/.cache/dmuon/autotune.json."""
    return cache_dir() / "autotune.json"


def autotune_enabled() -> bool:
    """False when DMUON_AUTOTUNE is 0/false/no/off: the GPU then uses `configs.default_config`."""
    return os.environ.get(ENV_AUTOTUNE, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Entry:
    """One tuned shape class: the winning config, its time and the torch time beside it."""

    config: TileConfig
    time_s: float
    torch_time_s: float | None
    rel_err: float
    shape: tuple[int, ...]  # the (batch, n, K) the search ran on

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "time_s": self.time_s, "torch_time_s": self.torch_time_s,
                "rel_err": self.rel_err, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> Entry:
        if not isinstance(d, dict):
            raise ValueError(f"entry must be an object, got {type(d).__name__}")
        try:
            time_s, tt = float(d["time_s"]), d.get("torch_time_s")
            tt = None if tt is None else float(tt)
            e = cls(TileConfig.from_dict(d["config"]), time_s, tt, float(d["rel_err"]),
                    tuple(int(v) for v in d["shape"]))
        except KeyError as k:
            raise ValueError(f"entry is missing {k.args[0]!r}") from None
        except TypeError as err:
            raise ValueError(f"bad entry {d!r}: {err}") from None
        if not (e.time_s > 0 and math.isfinite(e.time_s)) or (tt is not None and not tt > 0):
            raise ValueError(f"entry times must be positive, got {d!r}")
        return e


def read_cache_file(path: Path) -> dict[str, Entry]:
    """The entries stored at `path` ({} if absent). A corrupt file or entry is skipped with a warning."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        warnings.warn(f"cannot read autotune cache {path}: {e}; using an empty cache", stacklevel=2)
        return {}
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or not isinstance(
                doc.get("entries"), dict):
            raise ValueError(f"expected an object with format {CACHE_FORMAT!r} and an 'entries' object")
    except ValueError as e:
        warnings.warn(f"ignoring corrupt autotune cache {path} ({e}); it will be rebuilt", stacklevel=2)
        return {}
    entries = {}
    for key, raw in doc["entries"].items():
        try:
            parse_key(key)
            entries[key] = Entry.from_dict(raw)
        except ValueError as e:
            warnings.warn(f"ignoring bad autotune cache entry {key!r} in {path}: {e}", stacklevel=2)
    return entries


def write_cache_file(path: Path, entries: dict[str, Entry]) -> None:
    """Write all `entries` to `path` atomically: a temp file in the same folder, then os.replace."""
    from ..io import atomic_path

    doc = {"format": CACHE_FORMAT, "entries": {k: entries[k].to_dict() for k in sorted(entries)}}
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


class AutotuneCache:
    """The cache of one file, loaded once; `put` merges with the file's current content and rewrites it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._entries: dict[str, Entry] | None = None

    @property
    def entries(self) -> dict[str, Entry]:
        if self._entries is None:
            self._entries = read_cache_file(self.path)
        return self._entries

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def put(self, key: str, entry: Entry) -> None:
        parse_key(key)
        self.entries[key] = entry
        merged = read_cache_file(self.path)  # other processes may have added entries meanwhile
        merged.update(self.entries)
        self._entries = merged
        try:
            write_cache_file(self.path, merged)
        except OSError as e:
            warnings.warn(f"cannot write autotune cache {self.path}: {e}; keeping it in memory", stacklevel=2)


_caches: dict[Path, AutotuneCache] = {}


def get_cache() -> AutotuneCache:
    """The process-wide cache of the current `cache_path()`."""
    path = cache_path()
    if path not in _caches:
        _caches[path] = AutotuneCache(path)
    return _caches[path]


def rel_err(out, ref) -> float:
    """Relative Frobenius error of `out` against `ref` (computed in float64)."""
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def cuda_event_timer(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 10) -> float:
    """Median seconds of `fn()` on the current CUDA stream, timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def search(candidates: Sequence[TileConfig], run: Callable[[TileConfig], object], reference,
           timer: Callable[[Callable[[], object]], float], tol: float) -> tuple[TileConfig, float, float]:
    """The fastest config whose output matches `reference` within `tol`: (config, time_s, rel_err).

    A config that fails to compile or launch (e.g. too much shared memory) or gives wrong numbers is
    skipped; if none is left, RuntimeError lists why each was rejected.
    """
    best, rejected = None, []
    for cfg in candidates:
        try:
            err = rel_err(run(cfg), reference)
            if not err <= tol:
                rejected.append(f"{cfg.label()}: rel err {err:.2e} > {tol:.1e}")
                continue
            t = timer(lambda cfg=cfg: run(cfg))
        except Exception as e:  # compile/launch failures of one config must not stop the search
            rejected.append(f"{cfg.label()}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        if best is None or t < best[1]:
            best = (cfg, t, err)
    if best is None:
        raise RuntimeError("no Triton config passed verification: " + "; ".join(rejected))
    return best


def auto_min_n(entries: dict[str, Entry], gpu: str, dtype: str, triton_version: str) -> float:
    """Smallest n for which kernels='auto' picks Triton, from measured syrk entries of this GPU/dtype.

    Per n bucket the summed Triton and torch times decide; the threshold is just above the largest
    bucket where torch won (inf if torch won the largest one); if Triton won everywhere it is the
    smaller of the default and the lowest measured bucket. No measurements: DEFAULT_AUTO_MIN_N for
    bf16/fp16, inf (torch) for fp32.
    """
    per_bucket: dict[int, list[float]] = {}
    for key, e in entries.items():
        k = parse_key(key)
        if (k["gpu"], k["op"], k["dtype"], k["triton"]) != (gpu, "syrk", dtype, triton_version):
            continue
        if e.torch_time_s is None:
            continue
        acc = per_bucket.setdefault(k["n_bucket"], [0.0, 0.0])
        acc[0] += e.time_s
        acc[1] += e.torch_time_s
    if not per_bucket:  # fp32: Triton's exact-fp32 dot has no tensor cores; cuBLAS until measured
        return default_auto_min_n(dtype)
    buckets = sorted(per_bucket)
    if per_bucket[buckets[-1]][0] >= per_bucket[buckets[-1]][1]:
        return math.inf
    threshold = min(DEFAULT_AUTO_MIN_N, buckets[0] // 2 + 1)  # below the measured range: the default
    for b in buckets:
        if per_bucket[b][0] >= per_bucket[b][1]:
            threshold = b + 1
    return threshold


def prefers_triton(entries: dict[str, Entry], key: str, n: int, gpu: str, dtype: str,
                   triton_version: str) -> bool:
    """kernels='auto': Triton for this shape class? The exact measurement if any, else the threshold."""
    e = entries.get(key)
    if e is not None and e.torch_time_s is not None:
        return e.time_s < e.torch_time_s
    return n >= auto_min_n(entries, gpu, dtype, triton_version)
