"""The cost table: seconds for one NS call of a (batch, rows, cols) stack and for elementwise passes.

One cost model feeds the balancer and the simulator (DESIGN.md, principle 2). A table is built from a
profile CSV (`profile_io`) plus datasheet figures (`profiles/hardware.csv`):

- Measured points are returned exactly (measured=True). A point of another dtype with the same width
  and the same peak (fp16 <-> bf16 on every GPU here) is used as is, but says so (measured=False).
- NS calls of a measured (n, m, method, dtype) family at another batch size: log-log interpolation
  between the measured batches, and outside them the nearest measured point scaled along the fitted
  curve (never flat).
- Everything else: the roofline  t = FLOPs / (peak(dtype) x efficiency(FLOPs)) + per-call overhead,
  with the efficiency curve of `fit.Curve` fitted to the device's measured NS points: per method when
  it has >= 4 points, else per kernel family (dense: standard, gram; symmetric: standard_sym, gram_sym),
  else one curve shared by all points. FLOPs are those of the whole call (`flops.ns_flops`, batch
  included), so batching small matrices raises efficiency and saves overhead while large ones gain
  ~nothing.
  A `model_scale` row multiplies the modelled time of one method (a calibration; see its source). A
  symmetric method is priced as what kernels='auto' runs (`flops.dispatched_method`).
- A GPU without measured points (h100, or any "<gpu>-roofline") borrows the efficiency curve of the
  nearest measured GPU profile (closest bf16 peak) and says so in `detail`.
- Memory-bound ops: bytes / (bandwidth x efficiency(bytes)) + overhead, the same curve form fitted to the
  device's elementwise points (bytes = numel x accesses x element size; accesses per element of an ideal
  fused pass: muon_momentum 7 = read g, buf, U, W + write buf, NS input, W; adamw 7 = read g, m, v, W +
  write m, v, W), or borrowed like the NS curve.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..errors import InputError, choice_error
from .fit import MIN_FIT_POINTS, Curve, anchor_time, fit_curve
from .flops import METHODS, dispatched_method, ns_flops
from .hardware import HARDWARE_CSV, PROFILES_DIR, ROOFLINE_SUFFIX, Hardware, available_profiles, hardware
from .hardware import _profile_files as _profile_files
from .profile_io import DTYPE_BYTES, DTYPES, ELEMENTWISE_OPS, NS_OP, ProfileRow, read_profile

__all__ = ["HARDWARE_CSV", "PROFILES_DIR", "ROOFLINE_SUFFIX", "CostAnswer", "CostTable", "Hardware",
           "available_profiles", "hardware"]

KERNEL_FAMILY = {"standard": "dense", "gram": "dense", "standard_sym": "sym", "gram_sym": "sym"}
ELEMENTWISE_ACCESSES = {"muon_momentum": 7, "adamw": 7, "grad_prep": 3}  # reads + writes per element


@dataclass(frozen=True)
class CostAnswer:
    """One priced operation."""

    time_s: float
    measured: bool  # True: a profile point returned as measured; False: modelled
    detail: str  # e.g. "a800 profile: measured", "a800 roofline fit (eff 0.61)"


def _dtype_class(dtype: str, peaks: dict[str, float]) -> tuple:
    return (DTYPE_BYTES[dtype], peaks.get(dtype))


@dataclass
class _Fits:
    """Fitted curves of one table, keyed by (group, rate); built lazily."""

    ns: dict[tuple[str, float], Curve] = field(default_factory=dict)
    mem: dict[str, Curve] = field(default_factory=dict)


class CostTable:
    """Seconds per NS call and per elementwise pass on one device; see the module docstring."""

    def __init__(
        self,
        name: str,
        device: str,
        rows: list[ProfileRow],
        *,
        peaks_flops: dict[str, float],
        hbm_bytes_per_s: float | None,
        borrow: CostTable | None = None,
        source: str = "",
    ):
        self.name = name
        self.device = device
        self.source = source
        self._peaks = dict(peaks_flops)
        self._hbm = hbm_bytes_per_s
        self._borrow = borrow
        self._ns_points: dict[tuple, ProfileRow] = {}
        self._mem_points: dict[tuple, ProfileRow] = {}
        self._split_points: dict[tuple, list[ProfileRow]] = {}
        self._scale: dict[str, ProfileRow] = {}
        for r in rows:
            if r.op == NS_OP:
                n, m = r.shape_key
                self._ns_points[(n, m, r.batch, r.method, r.dtype)] = r
            elif r.op in ELEMENTWISE_OPS and r.batch == 1:
                self._mem_points[(r.op, r.numel, r.dtype)] = r
            elif r.op in ELEMENTWISE_OPS:  # the same pass split over `batch` tensors
                self._split_points.setdefault((r.op, r.dtype), []).append(r)
            elif r.op == "model_scale":
                self._scale[r.method] = r
        self._assumed: dict[str, tuple[float, str]] = {}  # dtype -> (peak, how): modelled, not measured
        self._fits = self._fit_all()
        self._cache: dict[tuple, CostAnswer | float] = {}

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def load(cls, name_or_path: str) -> CostTable:
        """A built-in profile name (see `available_profiles()`) or the path of a profile CSV."""
        text = str(name_or_path)
        files = _profile_files()
        hw = hardware()
        if text.lower().endswith(".csv") or "/" in text or "\\" in text:
            path = Path(text)
            if not path.is_file():
                raise InputError(
                    f"profile file {text!r} does not exist; accepted: a profile CSV path or one of "
                    f"{', '.join(available_profiles())}"
                )
            return cls.from_rows(path.stem, read_profile(path), source=str(path))
        if text in files:
            return cls.from_rows(text, read_profile(files[text]), source=str(files[text]))
        base = text[: -len(ROOFLINE_SUFFIX)] if text.endswith(ROOFLINE_SUFFIX) else None
        if base in hw or (text in hw and not hw[text].profile):
            return cls.roofline(base or text)
        if text in hw:
            raise InputError(
                f"profile {text!r} is not measured yet: {PROFILES_DIR / hw[text].profile} does not exist "
                f"(scripts/gpu_check.sh writes it on a {text.upper()}); accepted now: "
                f"{', '.join(available_profiles())} "
                f"(e.g. {text + ROOFLINE_SUFFIX!r} for its datasheet roofline)"
            )
        raise choice_error("profile", text, available_profiles() + ["<path>.csv"])

    @classmethod
    def from_rows(
        cls, name: str, rows: list[ProfileRow], *, source: str = "", allow_borrow: bool = True
    ) -> CostTable:
        """A table from profile rows; the device (rows' `device` column) gives the datasheet figures, or,
        for a device without a datasheet (cpu), its measured rows do: peak = the highest FLOP rate of its
        `matmul` and `ns` rows per dtype, bandwidth = the highest `copy` rate (read + write)."""
        devices = sorted({r.device for r in rows if r.device})
        if len(devices) > 1:
            raise InputError(f"profile {name!r} mixes devices {devices}; one profile describes one device")
        device = devices[0] if devices else name
        hw = hardware().get(device)
        if hw is not None:
            peaks, hbm = dict(hw.peaks_flops), hw.hbm_bytes_per_s
        else:
            peaks, hbm = {}, None
            for r in rows:  # the fastest rate measured on the device: its matmul rows, or an NS call
                if r.op == "matmul":
                    peaks[r.dtype] = max(peaks.get(r.dtype, 0.0), 2.0 * r.rows**3 / r.time_s)
                elif r.op == NS_OP:
                    rate = ns_flops(r.rows, r.cols, r.method, batch=r.batch) / r.time_s
                    peaks[r.dtype] = max(peaks.get(r.dtype, 0.0), rate)
                elif r.op == "copy":
                    hbm = max(hbm or 0.0, 2.0 * r.numel * DTYPE_BYTES[r.dtype] / r.time_s)
        borrow = None
        n_ns = len({(r.shape_key, r.batch, r.method) for r in rows if r.op == NS_OP})
        n_mem = sum(r.op in ELEMENTWISE_OPS for r in rows)
        if allow_borrow and hw is not None and (n_ns < MIN_FIT_POINTS or n_mem < MIN_FIT_POINTS):
            borrow = _nearest_gpu_profile(device, exclude=name)
        return cls(name, device, rows, peaks_flops=peaks, hbm_bytes_per_s=hbm, borrow=borrow, source=source)

    @classmethod
    def roofline(cls, gpu: str) -> CostTable:
        """Datasheet roofline of a known GPU, efficiency curves borrowed from the nearest measured GPU."""
        hw = hardware().get(gpu)
        if hw is None:
            raise choice_error("gpu", gpu, sorted(hardware()))
        borrow = _nearest_gpu_profile(gpu, exclude=None)
        return cls(
            f"{gpu} datasheet roofline",
            gpu,
            [],
            peaks_flops=hw.peaks_flops,
            hbm_bytes_per_s=hw.hbm_bytes_per_s,
            borrow=borrow,
            source=hw.source,
        )

    # ---- datasheet / measured peaks ------------------------------------------------------------
    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(d for d in DTYPES if d in self._peaks)

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s the roofline uses for `dtype`: datasheet, or measured matmul rate on cpu; for a
        dtype the profile lacks, the peak `assume_peak` set, else the widest measured dtype's peak (a
        conservative roofline: priced no faster than that dtype; warned once per table and dtype)."""
        if dtype not in DTYPES:
            raise choice_error("dtype", dtype, DTYPES)
        if dtype in self._peaks:
            return self._peaks[dtype]
        if dtype not in self._assumed:
            if not self._peaks:
                raise InputError(f"profile {self.name!r} has no peak for any dtype (no matmul or NS rows, no "
                                 "datasheet); accepted: a profile CSV with measured rows or a known GPU")
            base = self.widest_dtype
            how = (f"no {dtype} measurements in profile {self.name!r}: {dtype} priced at the measured {base} "
                   f"peak (modelled; `harness profile --dtype {dtype}` measures it)")
            self._assumed[dtype] = (self._peaks[base], how)
            _warn_once((self.name, dtype), how)
        return self._assumed[dtype][0]

    @property
    def widest_dtype(self) -> str:
        """The measured (or datasheet) dtype with the widest elements: what a missing dtype is priced from."""
        return max(self._peaks, key=lambda d: (DTYPE_BYTES[d], d))

    def assume_peak(self, dtype: str, flops: float, how: str) -> None:
        """Price `dtype`, which this profile did not measure, with the roofline at `flops` peak FLOP/s
        (e.g. the fp32 peak times a matmul speed ratio measured on the device: `runtime.planning`).
        Every answer for that dtype is modelled and its detail says `how`; warned once."""
        if dtype not in DTYPES:
            raise choice_error("dtype", dtype, DTYPES)
        if dtype in self._peaks:
            raise InputError(f"profile {self.name!r} measured {dtype}; assume_peak is for dtypes it lacks")
        if not (isinstance(flops, (int, float)) and math.isfinite(flops) and flops > 0):
            raise InputError(f"assumed peak must be a positive finite FLOP/s, got {flops!r}")
        self._assumed[dtype] = (float(flops), how)
        self._cache.clear()
        _warn_once((self.name, dtype), f"profile {self.name!r}: {how}", stacklevel=4)

    def assumed_dtypes(self) -> dict[str, str]:
        """{dtype: how it is priced} for the dtypes this table models without measurements."""
        return {d: how for d, (_, how) in self._assumed.items()}

    @property
    def hbm_bytes_per_s(self) -> float:
        """Memory bandwidth the memory roofline uses (datasheet, or measured copy rate on cpu)."""
        if self._hbm is None:
            raise InputError(f"profile {self.name!r} has no memory bandwidth (no copy rows, no datasheet)")
        return self._hbm

    @property
    def runnable_methods(self) -> tuple[str, ...]:
        """Methods the device can run: every method on a GPU with a datasheet (the symmetric ones via
        Triton), else only the measured ones (the CPU has no symmetric kernels)."""
        if self.device in hardware():
            return METHODS
        measured = {k[3] for k in self._ns_points}
        return tuple(m for m in METHODS if m in measured)

    @property
    def ns_point_count(self) -> int:
        return len(self._ns_points)

    # ---- fits ----------------------------------------------------------------------------------
    def _fit_all(self) -> _Fits:
        fits = _Fits()
        groups: dict[tuple[str, float], list[tuple[float, float]]] = {}
        for (n, m, b, method, dtype), r in self._ns_points.items():
            peak = self._peaks.get(dtype)
            if peak is None:
                continue
            w = ns_flops(n, m, method, batch=b)
            for g in (method, KERNEL_FAMILY[method], "all"):
                groups.setdefault((g, peak), []).append((w, r.time_s))
        for key, pts in groups.items():
            if len({w for w, _ in pts}) >= MIN_FIT_POINTS:
                fits.ns[key] = fit_curve([w for w, _ in pts], [t for _, t in pts], key[1])
        if self._hbm is not None:
            mem: dict[str, list[tuple[float, float]]] = {}
            for (op, numel, dtype), r in self._mem_points.items():
                w = float(numel * ELEMENTWISE_ACCESSES[op] * DTYPE_BYTES[dtype])
                for g in (op, "all"):
                    mem.setdefault(g, []).append((w, r.time_s))
            for g, pts in mem.items():
                if len({w for w, _ in pts}) >= MIN_FIT_POINTS:
                    fits.mem[g] = fit_curve([w for w, _ in pts], [t for _, t in pts], self._hbm)
        return fits

    def ns_curve(self, method: str, dtype: str) -> tuple[Curve, str]:
        """The roofline curve that prices `method` in `dtype` here, and where it comes from."""
        family, peak = KERNEL_FAMILY[method], self.peak_flops(dtype)
        fits = self._fits.ns
        if (method, peak) in fits:
            return fits[(method, peak)], f"fit to {fits[(method, peak)].n_points} {method} points"
        if (family, peak) in fits:
            return fits[(family, peak)], f"fit to {fits[(family, peak)].n_points} {family}-kernel points"
        if ("all", peak) in fits:
            return fits[
                ("all", peak)
            ], f"shared fit to {fits[('all', peak)].n_points} points (no {family}-kernel fit)"
        for g in (method, family, "all"):
            other = sorted(k for k in fits if k[0] == g)
            if other:
                return fits[other[-1]].with_rate(
                    peak
                ), f"{g} fit at another dtype's peak, rescaled to {dtype}"
        if self._borrow is not None:
            curve, how = self._borrow.ns_curve(method, dtype if dtype in self._borrow.dtypes else "bf16")
            return curve.with_rate(
                peak
            ), f"efficiency curve borrowed from the {self._borrow.name} profile ({how})"
        raise InputError(
            f"profile {self.name!r} cannot price NS: fewer than {MIN_FIT_POINTS} NS points and no "
            "measured GPU profile to borrow an efficiency curve from"
        )

    def mem_curve(self, op: str) -> tuple[Curve, str]:
        fits = self._fits.mem
        if op in fits:
            return fits[op], f"fit to {fits[op].n_points} {op} points"
        if "all" in fits:
            return fits["all"], f"shared fit to {fits['all'].n_points} elementwise points"
        if self._borrow is not None and self._hbm is not None:
            curve, how = self._borrow.mem_curve(op)
            return curve.with_rate(
                self._hbm
            ), f"bandwidth curve borrowed from the {self._borrow.name} profile ({how})"
        raise InputError(
            f"profile {self.name!r} cannot price elementwise ops: fewer than {MIN_FIT_POINTS} "
            "elementwise points, or no bandwidth, and no GPU profile to borrow from"
        )

    # ---- queries -------------------------------------------------------------------------------
    def ns_time(
        self, rows: int, cols: int, batch: int = 1, method: str = "gram_sym", dtype: str = "bf16"
    ) -> CostAnswer:
        """One orthogonalization call of a (batch, rows, cols) stack (5 steps, restart at 2)."""
        key = ("ns", rows, cols, batch, method, dtype)
        if key not in self._cache:
            run = dispatched_method(method, rows, cols, dtype) if isinstance(rows, int) and isinstance(
                cols, int) else method
            a = self._ns_time(rows, cols, batch, run, dtype)
            self._cache[key] = a if run == method else CostAnswer(
                a.time_s, a.measured, f"{a.detail}; {method} runs as {run} (kernels='auto' keeps torch here)")
        return self._cache[key]

    def _ns_time(self, rows: int, cols: int, batch: int, method: str, dtype: str) -> CostAnswer:
        for what, v in (("rows", rows), ("cols", cols), ("batch", batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InputError(f"{what} must be a positive integer, got {v!r}")
        if method not in METHODS:
            raise choice_error("method", method, METHODS)
        if dtype not in DTYPES:
            raise choice_error("dtype", dtype, DTYPES)
        n, m = min(rows, cols), max(rows, cols)
        peak = self.peak_flops(dtype)
        exact = self._ns_points.get((n, m, batch, method, dtype))
        if exact is not None:
            return CostAnswer(exact.time_s, True, f"{self.name} profile: measured ({exact.source})")
        curve, how = self.ns_curve(method, dtype)
        scale_row = self._scale.get(method)
        scale = scale_row.time_s if scale_row else 1.0

        def model(b: int) -> float:
            return curve.time_s(ns_flops(n, m, method, batch=b)) * scale

        cls_ = _dtype_class(dtype, self._peaks)
        family: dict[int, ProfileRow] = {}
        for (pn, pm, pb, pmeth, pd), r in self._ns_points.items():
            if (pn, pm, pmeth) == (n, m, method) and _dtype_class(pd, self._peaks) == cls_:
                if pb not in family or pd == dtype:
                    family[pb] = r
        flops = ns_flops(n, m, method, batch=batch)
        if dtype in self._assumed:
            how = f"{how}; {self._assumed[dtype][1]}"
        if family:
            t, detail = anchor_time(family, batch, model, f"{self.name} profile")
        else:
            t = model(batch)
            detail = f"{self.name} roofline fit (eff {flops / (peak * t):.2f}; {how}"
            if scale_row:
                detail += f"; {method} time x{scale:.3f} calibrated: {scale_row.source}"
            detail += ")"
        return CostAnswer(t, False, detail)

    def elementwise_time(self, numel: int, op: str, dtype: str = "fp32", tensors: int = 1) -> CostAnswer:
        """One pass of `op` (muon_momentum | adamw | grad_prep) over `numel` elements of `dtype` held in
        `tensors` tensors: the one-tensor time plus (tensors - 1) x the measured cost of an extra tensor
        (`per_tensor_time`; 0 where the table has no split rows)."""
        if isinstance(tensors, bool) or not isinstance(tensors, int) or tensors < 1:
            raise InputError(f"tensors must be a positive integer, got {tensors!r}")
        key = ("mem", numel, op, dtype)
        if key not in self._cache:
            self._cache[key] = self._elementwise_time(numel, op, dtype)
        a = self._cache[key]
        extra = self.per_tensor_time(op, dtype) * (tensors - 1)
        if not extra:
            return a
        per = extra / (tensors - 1) * 1e6
        return CostAnswer(a.time_s + extra, False,
                          f"{a.detail} + {tensors - 1} extra tensors x {per:.3g} us (measured split rows)")

    def per_tensor_time(self, op: str, dtype: str = "fp32") -> float:
        """Seconds one more tensor adds to a pass of `op`: the least-squares slope through the origin of
        t_k - t_1 against k - 1 over the table's split rows (the same elements in k tensors), so the
        largest split, where the difference stands clearest above the noise, weighs most; not below 0;
        0 without split rows."""
        key = ("split", op, dtype)
        if key not in self._cache:
            pts = [(r.batch - 1, r.time_s - self._elementwise_time(r.numel, op, dtype).time_s)
                   for r in self._split_points.get((op, dtype), ())]
            slope = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts) if pts else 0.0
            self._cache[key] = max(slope, 0.0)
        return self._cache[key]

    def _elementwise_time(self, numel: int, op: str, dtype: str) -> CostAnswer:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise InputError(f"numel must be a positive integer, got {numel!r}")
        if op not in ELEMENTWISE_OPS:
            raise choice_error("elementwise op", op, ELEMENTWISE_OPS)
        if dtype not in DTYPES:
            raise choice_error("dtype", dtype, DTYPES)
        exact = self._mem_points.get((op, numel, dtype))
        if exact is not None:
            return CostAnswer(exact.time_s, True, f"{self.name} profile: measured ({exact.source})")
        curve, how = self.mem_curve(op)
        per_elem = ELEMENTWISE_ACCESSES[op] * DTYPE_BYTES[dtype]

        def model(x: int) -> float:
            return curve.time_s(float(x * per_elem))

        family = {nm: r for (pop, nm, pd), r in self._mem_points.items() if pop == op and pd == dtype}
        if family:
            t, detail = anchor_time(family, numel, model, f"{self.name} profile")
        else:
            t = model(numel)
            detail = (
                f"{self.name} memory roofline ({curve.efficiency(numel * per_elem):.2f} of "
                f"{curve.rate / 1e9:.0f} GB/s; {how})"
            )
        return CostAnswer(t, False, detail)

    def describe(self) -> list[str]:
        """Human-readable lines: what the table is made of."""
        lines = [
            f"profile {self.name} (device {self.device}; {self.source or 'no file'})",
            "peaks: "
            + ", ".join(f"{d} {p / 1e12:.3g} TFLOP/s" for d, p in self._peaks.items())
            + (f"; bandwidth {self._hbm / 1e9:.0f} GB/s" if self._hbm else ""),
        ]
        lines.append(f"measured points: {len(self._ns_points)} ns, {len(self._mem_points)} elementwise, "
                     f"{sum(map(len, self._split_points.values()))} elementwise split over several tensors")
        for op, dtype in sorted(self._split_points):
            lines.append(f"{op} {dtype}: {self.per_tensor_time(op, dtype) * 1e6:.3g} us per extra tensor")
        for (g, peak), c in sorted(self._fits.ns.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            lines.append(
                f"ns fit {g} @ {peak / 1e12:.3g} TFLOP/s: {c.n_points} points, rms error "
                f"{c.rms_rel_error:.1%}, overhead {c.t0_s * 1e6:.1f} us, k {c.k}"
            )
        for g, c in sorted(self._fits.mem.items()):
            lines.append(f"memory fit {g}: {c.n_points} points, rms error {c.rms_rel_error:.1%}")
        for method, r in sorted(self._scale.items()):
            lines.append(f"calibration: modelled {method} time x{r.time_s:.3f} ({r.source})")
        if self._borrow is not None:
            lines.append(f"curves missing here are borrowed from the {self._borrow.name} profile")
        for dtype, how in sorted(self.assumed_dtypes().items()):
            lines.append(f"{dtype}: modelled, not measured: {how}")
        return lines


_WARNED: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], text: str, stacklevel: int = 3) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(text, RuntimeWarning, stacklevel=stacklevel)


@lru_cache(maxsize=8)
def _load_unborrowed(stem: str) -> CostTable:
    """A built-in profile that borrows nothing (so borrowing never recurses)."""
    path = _profile_files()[stem]
    return CostTable.from_rows(stem, read_profile(path), source=str(path), allow_borrow=False)


def _nearest_gpu_profile(device: str, exclude: str | None) -> CostTable | None:
    """The measured GPU profile whose device has the closest bf16 peak (ties: name order)."""
    hw = hardware()
    target = hw[device].peaks_flops["bf16"]
    cands = []
    for stem in _profile_files():
        if stem == exclude or stem not in hw:
            continue
        cands.append((abs(math.log(hw[stem].peaks_flops["bf16"] / target)), stem))
    for _, stem in sorted(cands):
        table = _load_unborrowed(stem)
        if table.ns_point_count >= MIN_FIT_POINTS:
            return table
    return None
