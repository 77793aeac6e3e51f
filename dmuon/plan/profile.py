"""The profiler: time NS calls and optimizer passes on this machine and return profile CSV rows.

Importable without torch (torch is imported inside the functions), so `scripts/gpu_check.sh` can call
it on a GPU machine that has only torch + triton:

    from dmuon.plan.profile import profile_device, ns_shapes_of
    rows = profile_device(shapes=[(512, 3584), (3584, 18944)], device="cuda",
                          methods=("standard", "gram", "gram_sym"), dtypes=("bf16",), max_batch=8)
    write_profile("dmuon/plan/profiles/h200.csv", rows)     # dmuon.plan.profile_io

What is timed: `dmuon.orthogonalize` on a (batch, n, m) stack of random matrices (5 steps, Jordan
coefficients, restart at step 2 for Gram NS); methods map to (method, kernels): standard -> (standard,
torch), standard_sym -> (standard, triton), gram -> (gram, torch), gram_sym -> (gram, triton). The
elementwise ops are the optimizer's own functions: `muon_momentum` = dmuon.optim.muon_momentum_ +
muon_apply_ on one tensor, `adamw` = dmuon.optim.adamw_step_ on one tensor, `grad_prep` = what the
distributed optimizers do to each received gradient before using it (scale the sum to a mean in place,
then a one-pass non-finite check: `DMuon._absorb`). `matmul` (n^3 product) and
`copy` rows give the device's achieved peak FLOP/s and bandwidth (the CPU has no datasheet here), per
profiled dtype. On a CPU, bf16 / fp16 are profiled where it multiplies them natively (`cpu_dtypes`).
Each number is the median of `repeats` timed calls after `warmup` untimed ones (CUDA: CUDA events
around each call after a synchronize; CPU: perf_counter); NS calls are timed in `repeats` interleaved
rounds over all of them (see `profile_ns`).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

from ..errors import InputError, choice_error
from .flops import METHODS
from .profile_io import DTYPES, ELEMENTWISE_OPS, ProfileRow

DEVICES = ("cpu", "cuda")
METHOD_CALL = {
    "standard": ("standard", "torch"),
    "standard_sym": ("standard", "triton"),
    "gram": ("gram", "torch"),
    "gram_sym": ("gram", "triton"),
}
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _torch_dtype(name: str):
    import torch

    return getattr(torch, TORCH_DTYPE_NAMES[name])


def median_time_s(fn: Callable[[], object], *, device: str, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of fn() over `repeats` calls, after `warmup` calls (CUDA events on cuda)."""
    import torch

    if repeats < 1 or warmup < 0:
        raise InputError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def device_label(device: str) -> str:
    """A short description of the machine for the `source` column."""
    import torch

    if device == "cuda":
        what = torch.cuda.get_device_name()
    else:
        what = platform.processor() or platform.machine()
        what = f"{what}, {torch.get_num_threads()} threads"
    return f"{what}, torch {torch.__version__}"


def default_device_name(device: str) -> str:
    """The `device` column for this machine: a known GPU key (a800, a100, h100, h200) from the CUDA
    device name, else 'cuda'; 'cpu' on the CPU."""
    if device != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name().lower()
    for key in ("a800", "a100", "h100", "h200"):
        if key in name:
            return key
    return "cuda"


def check_request(
    device: str, methods: Sequence[str], dtypes: Sequence[str], max_batch: int, repeats: int
) -> None:
    """InputError for anything the profiler cannot time, before any work starts."""
    if device not in DEVICES:
        raise choice_error("device", device, DEVICES)
    for m in methods:
        if m not in METHODS:
            raise choice_error("method", m, METHODS)
        if device == "cpu" and m.endswith("_sym"):
            raise InputError(
                f"method {m!r} needs the Triton symmetric kernels on a CUDA GPU; on cpu "
                "accepted: standard, gram (the cost table prices *_sym on cpu with its roofline)"
            )
    for d in dtypes:
        if d not in DTYPES:
            raise choice_error("dtype", d, DTYPES)
        if device == "cpu" and d not in cpu_dtypes():
            raise InputError(
                f"dtype {d!r} is not profiled on this cpu (it has no native {d} matmul instructions, "
                f"so {d} matmuls are emulated and far too slow); accepted on this cpu: "
                f"{', '.join(cpu_dtypes())}"
            )
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise InputError(f"max_batch must be a positive integer, got {max_batch!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InputError(f"repeats must be a positive integer, got {repeats!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError("device 'cuda' requested but torch sees no CUDA GPU; accepted here: cpu")


# CPU instruction-set flags (Linux /proc/cpuinfo) that give native half-precision matmuls (oneDNN
# kernels); without them torch emulates bf16 / fp16 matmuls far more slowly than fp32.
CPU_HALF_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags ("flags" lines of /proc/cpuinfo; empty where it does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(w for line in f if line.startswith("flags")
                             for w in line.split(":", 1)[1].split())
    except OSError:
        return frozenset()


def cpu_dtypes(flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """Dtypes the CPU multiplies natively, so the profiler times them: fp32 always, bf16 / fp16 where
    one of `CPU_HALF_FLAGS` is present (AVX512-BF16 here: bf16 matmuls 2.5-2.8x faster than fp32 on one
    thread, 224^3..1024^3)."""
    have = set(cpu_flags() if flags is None else flags)
    return ("fp32",) + tuple(d for d, need in CPU_HALF_FLAGS.items() if have & set(need))


def ns_shapes_of(shapes: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Distinct NS shapes (n, m) = (min, max), sorted: what the cost table is keyed by."""
    return sorted({(min(r, c), max(r, c)) for r, c in shapes})


def profile_ns(
    shapes: Iterable[tuple[int, int]],
    *,
    device: str = "cpu",
    methods=("standard", "gram"),
    dtypes=("fp32",),
    max_batch: int = 8,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    source: str | None = None,
    device_name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[ProfileRow]:
    """`ns` rows: every (n, m) of `shapes` x batch 1..max_batch x method x dtype. The calls are timed in
    `repeats` interleaved rounds (each round times every call once, after `warmup` untimed calls in the
    first) and each row is the median over the rounds: a machine whose speed drifts while the table is
    measured then shifts every row alike instead of tilting the rows measured in a slow minute."""
    import torch

    from ..newton_schulz import orthogonalize

    check_request(device, methods, dtypes, max_batch, repeats)
    source = source or (f"measured here: {device_label(device)}, median of {repeats} interleaved rounds")
    keys = [(n, m, batch) for n, m in ns_shapes_of(shapes) for batch in range(1, max_batch + 1)]
    times: dict[tuple, list[float]] = {}
    for rnd in range(repeats):
        gen = torch.Generator(device="cpu").manual_seed(seed)  # the same stacks every round
        for n, m, batch in keys:
            g = torch.randn(batch, n, m, generator=gen).to(device)
            for dtype in dtypes:
                for method in methods:
                    ns_method, kernels = METHOD_CALL[method]

                    def call(g=g, ns_method=ns_method, kernels=kernels, dtype=dtype):
                        return orthogonalize(g, method=ns_method, dtype=dtype, kernels=kernels)

                    t = median_time_s(call, device=device, repeats=1, warmup=warmup if rnd == 0 else 0)
                    times.setdefault((n, m, batch, method, dtype), []).append(t)
            del g
        if progress:
            calls = len(keys) * len(dtypes) * len(methods)
            progress(f"ns: round {rnd + 1} of {repeats} done ({calls} calls)")
    rows = []
    for (n, m, batch, method, dtype), ts in times.items():
        t = float(statistics.median(ts))
        rows.append(ProfileRow(device_name or device, "ns", n, m, batch, method, dtype, t, source))
        if progress:
            progress(f"ns {method} {dtype} ({batch}, {n}, {m}): {t * 1e3:.3f} ms")
    return rows


SPLIT_NUMEL = 1 << 22  # elementwise passes split over several tensors are timed at this size
TENSOR_COUNTS = (8, 64)


def profile_elementwise(
    numels: Iterable[int],
    *,
    device: str = "cpu",
    dtype: str = "fp32",
    repeats: int = 5,
    warmup: int = 1,
    source: str | None = None,
    device_name: str | None = None,
    progress: Callable[[str], None] | None = None,
    tensor_counts: Sequence[int] = TENSOR_COUNTS,
) -> list[ProfileRow]:
    """`muon_momentum`, `adamw` and `grad_prep` rows: one pass of the optimizer's own functions over numel
    elements (batch 1), and at the largest size <= SPLIT_NUMEL the same elements split into each of
    `tensor_counts` tensors (batch = the count): what a pass costs per extra tensor (dispatch, one
    parallel region per tensor)."""
    check_request(device, (), (dtype,), 1, repeats)
    source = source or f"measured here: {device_label(device)}, median of {repeats}"
    numels = sorted(set(numels))
    split_at = max((n for n in numels if n <= SPLIT_NUMEL), default=None)  # the per-tensor rows' size
    rows = []
    for numel in numels:
        # the splits of one size in interleaved rounds: their differences are what the table uses
        calls = {t: elementwise_calls(numel, device=device, dtype=dtype, tensors=t)
                 for t in (1, *(tensor_counts if numel == split_at else ()))}
        times: dict[tuple[int, str], list[float]] = {}
        for rnd in range(repeats):
            for tensors, fns in calls.items():
                for op in ELEMENTWISE_OPS:
                    t = median_time_s(fns[op], device=device, repeats=1, warmup=warmup if rnd == 0 else 0)
                    times.setdefault((tensors, op), []).append(t)
        for (tensors, op), ts in times.items():
            t = float(statistics.median(ts))
            rows.append(ProfileRow(device_name or device, op, numel, 1, tensors, "", dtype, t, source))
            if progress:
                progress(f"{op} {dtype} numel {numel} in {tensors} tensor(s): {t * 1e6:.1f} us")
        del calls
    return rows


def elementwise_calls(numel: int, *, device: str = "cpu", dtype: str = "fp32",
                      tensors: int = 1) -> dict[str, Callable[[], object]]:
    """{op: fn} for the ELEMENTWISE_OPS over `numel` fresh elements in `tensors` equal tensors, as the
    optimizers run them: momentum + apply per tensor, one (fused, multi-tensor) AdamW step over the list,
    and per tensor the gradient preparation (what the profiler times; `harness bench step --speed-probe`
    times one of them against the table)."""
    import torch

    from ..optim import adamw_step_, muon_apply_, muon_momentum_

    dt = _torch_dtype(dtype)
    sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
    p, g, a, b = ([torch.rand(n, device=device, dtype=dt) for n in sizes] for _ in range(4))

    def momentum():
        for pi, gi, ai in zip(p, g, a, strict=True):
            muon_apply_(pi, muon_momentum_(gi, ai, 0.95, True), 0.02, 0.01, 1.0)

    def adamw():
        adamw_step_(p, g, a, b, [1] * tensors, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def grad_prep():
        return [bool(torch.isfinite(gi.mul_(1.0).sum())) for gi in g]

    return dict(zip(ELEMENTWISE_OPS, (momentum, adamw, grad_prep), strict=True))


PEAK_SIZES = {"cpu": ((256, 512, 1024), (1 << 22, 1 << 24)), "cuda": ((2048, 4096, 8192), (1 << 26, 1 << 28))}


def profile_peaks(
    *,
    device: str = "cpu",
    dtype: str = "fp32",
    matmul_sizes: Sequence[int] | None = None,
    copy_numels: Sequence[int] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    source: str | None = None,
    device_name: str | None = None,
) -> list[ProfileRow]:
    """`matmul` rows (n x n x n products) and `copy` rows: the achieved peak FLOP/s and bandwidth."""
    import torch

    check_request(device, (), (dtype,), 1, repeats)
    matmul_sizes = matmul_sizes or PEAK_SIZES[device][0]
    copy_numels = copy_numels or PEAK_SIZES[device][1]
    source = source or f"measured here: {device_label(device)}, median of {repeats}"
    dt = _torch_dtype(dtype)
    rows = []
    for n in matmul_sizes:
        x, y = torch.rand(n, n, device=device, dtype=dt), torch.rand(n, n, device=device, dtype=dt)
        t = median_time_s(lambda x=x, y=y: x @ y, device=device, repeats=repeats, warmup=warmup)
        rows.append(ProfileRow(device_name or device, "matmul", n, n, 1, "", dtype, t, source))
    for numel in copy_numels:
        src, dst = torch.rand(numel, device=device, dtype=dt), torch.empty(numel, device=device, dtype=dt)
        t = median_time_s(
            lambda src=src, dst=dst: dst.copy_(src), device=device, repeats=repeats, warmup=warmup
        )
        rows.append(ProfileRow(device_name or device, "copy", numel, 1, 1, "", dtype, t, source))
    return rows


def profile_device(
    shapes: Iterable[tuple[int, int]],
    *,
    device: str = "cpu",
    methods=("standard", "gram"),
    dtypes=("fp32",),
    max_batch: int = 8,
    repeats: int = 5,
    warmup: int = 1,
    elementwise_numels: Sequence[int] = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24),
    device_name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[ProfileRow]:
    """Everything a cost table needs for one device: peaks, NS calls, elementwise passes."""
    check_request(device, methods, dtypes, max_batch, repeats)
    name = device_name or device
    source = f"measured here: {device_label(device)}, median of {repeats}"
    rows: list[ProfileRow] = []
    for dtype in dtypes:
        rows += profile_peaks(
            device=device, dtype=dtype, repeats=repeats, warmup=warmup, source=source, device_name=name
        )
    rows += profile_ns(
        shapes,
        device=device,
        methods=methods,
        dtypes=dtypes,
        max_batch=max_batch,
        repeats=repeats,
        warmup=warmup,
        device_name=name,
        progress=progress,
    )
    if elementwise_numels:
        rows += profile_elementwise(
            elementwise_numels,
            device=device,
            dtype="fp32",
            repeats=repeats,
            warmup=warmup,
            source=source,
            device_name=name,
            progress=progress,
        )
    return rows
