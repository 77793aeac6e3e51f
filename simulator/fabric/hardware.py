"""Hardware profiles: what one GPU (or CPU process) computes and how fast the fabric moves bytes.

A profile is a TOML file in simulator/profiles/ (or a path). Every number carries its provenance:

    fwd_tflops = { value = 191.6, source = "fit: reported.csv a800_8gpu_llm ..." }

Sources say one of: datasheet, derived from reported.csv (which table, which rows), measured here,
assumption. Files use human units with the unit in the key (ms, us, GB/s, Gb/s); `Profile` holds SI.

Layout of a profile file:
    name, description, gpu, cost_profile (the dmuon CostTable that prices NS and elementwise passes: a
    name or a list of names, the first that loads is used; a name ending in .csv is a profile CSV in
    simulator/profiles/), dtype (bf16 | fp16 | fp32: what runs on it compute and communicate in),
    symmetric_kernels (default true; false where only torch kernels run, e.g. the CPU),
    gpus_per_node, cpu_cores (0 = not a CPU profile: no core contention)
    [threads]  CPU profiles only, optional: compute_speedup, ns_speedup, elementwise_speedup = the measured
               speedup of one rank running `cpu_cores` torch threads over one thread, for layer compute,
               NS and elementwise (AdamW / momentum) passes (+ source); absent: linear (an ASSUMPTION);
               compute_corun_slowdown, ns_corun_slowdown, elementwise_corun_slowdown = how much slower
               one single-threaded process runs that work while `cpu_cores` processes run it at once
               (shared memory bandwidth and caches); absent: 1 (an ASSUMPTION)
    [compute]  peak_bf16_tflops, hbm_GBps, fwd_tflops, fwd_layer_overhead_ms, bwd_tflops,
               bwd_layer_overhead_ms, optimizer_overhead_ms, elementwise_scale, overlap_slowdown,
               optional comm_overlap_slowdown (default 0; CPU hosts: collectives run 1 + this slower
               while a participant computes, their copies sharing its cores), optional
               grad_prep_passes (default 0): passes of the cost table's grad_prep (sum -> mean,
               non-finite check) charged with every gradient pass, 1 where the profile times this
               project's runtime (the cpu profile); 0 where the AdamW times were fitted to a published
               system whose own gradient handling they already contain
               Megatron-style layers (issue 29 validation; defaults keep every other profile as fitted):
               optional attention_causal_fraction (default 0.5: a flash-style kernel skips the masked
               half; 1.0: kernels that multiply the whole s x s score matrix and mask it),
               optional activation_rw_passes (default 0: not modelled, the fitted rates and per-layer
               overhead already hold the non-GEMM passes): times each activation byte Korthikanti et
               al. 2022 count per transformer layer is moved by the forward's memory-bound passes at
               hbm_GBps (simulator.models.compute.activation_memory_s)
    [network]  nvlink_GBps, base_latency_us, intra_alpha_us, inter_alpha_us, nic_gbps_per_node,
               inter_efficiency, and either
               optional (NCCL / multi-node, each with its source): tree_intra_alpha_us,
               tree_inter_alpha_us, tree_bw_factor (NCCL's tree all-reduce; defaults: NCCL tuner constants
               4 us, 14 us, 0.92), nccl_channels (thread blocks, one SM each, an NCCL collective holds
               while it runs; with [compute] sm_count the SM share it takes from concurrent compute,
               simulator.engine.engine; absent: no SM contention), nccl_channels_net (the same for a
               communicator with one GPU per node, e.g. HSDP's replicate group: NCCL sizes its channels
               by the NIC there; absent: nccl_channels)
               [network.protocols.<name>] (LL, LL128; optional): ring_base_us, ring_intra_us, ring_inter_us,
               tree_base_us, tree_intra_us, tree_inter_us, bw_factor, source: NCCL's other protocols,
               tried beside Simple across nodes (simulator.fabric.collectives)
    [uncertainty] optional: the ranges of the uncertain inputs, input = { low = ..., high = ..., source } or
               { rel = ..., source } (simulator.calibration.bands: error bands and sensitivity)
               [[network.points]] kind (all_gather | broadcast | all_reduce), ranks, size_bytes, time_ms
               (+ source, optional collectives = how many collectives of that kind the time covers, issued one
               after another, e.g. 5 owner broadcasts: their latencies are subtracted that many times):
               measured collective times from which the busbw curves are derived,
               busbw = f (n-1)/n S / (t - latency(n)), f = 2 for all-reduce, else 1 (median per size;
               on a CPU host t is first divided by the core contention of its n ranks), or
               curve_from = "<profile>" + curve_scale: another profile's curve scaled.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import tomllib

from dmuon.errors import InputError, choice_error

from .collectives import BandwidthCurve, Network, Protocol

PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"
_CURVE_KINDS = ("all_gather", "broadcast", "all_reduce")
DTYPES = ("bf16", "fp16", "fp32")
_COMPUTE_KEYS = ("peak_bf16_tflops", "hbm_GBps", "fwd_tflops", "fwd_layer_overhead_ms", "bwd_tflops",
                 "bwd_layer_overhead_ms", "optimizer_overhead_ms", "elementwise_scale", "overlap_slowdown")
_NETWORK_KEYS = ("nvlink_GBps", "base_latency_us", "intra_alpha_us", "inter_alpha_us", "nic_gbps_per_node",
                 "inter_efficiency")
_TOP_KEYS = ("name", "description", "gpu", "cost_profile", "dtype", "symmetric_kernels", "gpus_per_node",
             "cpu_cores", "compute", "network", "threads", "uncertainty")
THREAD_KINDS = ("compute", "ns", "elementwise")
_NETWORK_OPTIONAL = ("tree_intra_alpha_us", "tree_inter_alpha_us", "tree_bw_factor", "nccl_channels",
                     "nccl_channels_net")
_NETWORK_TABLE_KEYS = (*_NETWORK_KEYS, *_NETWORK_OPTIONAL, "points", "curve_from", "curve_scale", "protocols")
_PROTOCOL_KEYS = ("ring_base_us", "ring_intra_us", "ring_inter_us", "tree_base_us", "tree_intra_us",
                  "tree_inter_us", "bw_factor")
_POINT_KEYS = ("kind", "ranks", "size_bytes", "time_ms", "source", "collectives")


def _check_keys(table: dict, accepted: tuple[str, ...], where: str) -> None:
    unknown = [k for k in table if k not in accepted]
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(accepted)}")


def _as_table(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise InputError(f"{where} must be a table ([section] with key = value lines), got {v!r}")
    return v


@dataclass(frozen=True)
class Profile:
    """One device type and its fabric, SI units. `provenance` maps each key to its source line."""

    name: str
    description: str
    gpu: str
    cost_profiles: tuple[str, ...]  # dmuon CostTable names (or CSV paths), first that loads wins
    dtype: str  # compute / communication dtype runs on this device use by default
    symmetric_kernels: bool  # the device has the symmetric (Triton) NS kernels (False: CPU, torch only)
    gpus_per_node: int
    cpu_cores: int
    peak_bf16_flops: float
    hbm_Bps: float
    fwd_flops: float  # achieved FLOP/s of forward matmul work
    fwd_layer_overhead_s: float  # fixed seconds per layer per forward (launches, hooks, norms)
    bwd_flops: float
    bwd_layer_overhead_s: float
    optimizer_overhead_s: float  # fixed seconds per optimizer step
    elementwise_scale: float  # multiplies the cost table's elementwise (AdamW / momentum) pass times
    grad_prep_passes: float  # grad_prep passes charged per gradient pass (see the module docstring)
    overlap_slowdown: float  # compute runs (1 + this) slower while communication overlaps it
    nvlink_Bps: float
    network: Network
    comm_overlap_slowdown: float = 0.0  # CPU hosts: a collective runs (1 + this) slower beside compute
    sm_count: int = 0  # streaming multiprocessors per GPU (0: not modelled)
    memory_gib: float = 0.0  # memory per device (CPU: the host's RAM); 0 = not stated (simulator.models.memory)
    nccl_channels: int = 0  # SMs an NCCL collective holds while it runs (0: not modelled)
    nccl_channels_net: int = 0  # the same over one GPU per node (HSDP's replicate group); 0: nccl_channels
    attention_causal_fraction: float = 0.5  # share of the s x s scores the attention kernel computes
    activation_rw_passes: float = 0.0  # memory-bound activation passes (0: not modelled), simulator.models.compute
    thread_speedup: dict[str, float] = field(default_factory=dict)  # kind -> speedup at cpu_cores threads
    corun_slowdown: dict[str, float] = field(default_factory=dict)  # kind -> x with all cores busy
    uncertainty: dict[str, dict] = field(default_factory=dict)  # input -> {low, high | rel, source}
    provenance: dict[str, str] = field(default_factory=dict, compare=False)

    def with_nic_gbps(self, gbps: float) -> Profile:
        """The same profile with another inter-node NIC bandwidth per node (Gbit/s per direction)."""
        if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not gbps > 0 or math.isinf(gbps):
            raise InputError(f"NIC bandwidth must be a positive number of Gbit/s per node, got {gbps!r}")
        prov = dict(self.provenance)
        prov["nic_gbps_per_node"] = f"given on the command line / config: {gbps:g} Gb/s per node"
        net = replace(self.network, nic_Bps_per_node=gbps * 1e9 / 8)
        return replace(self, network=net, provenance=prov)

    @property
    def sm_share(self) -> float:
        """Share of a GPU's SMs one running collective takes from its compute (0: not modelled)."""
        if self.sm_count <= 0 or self.nccl_channels <= 0:
            return 0.0
        return min(1.0, self.nccl_channels / self.sm_count)

    @property
    def sm_share_net(self) -> float:
        """The same for a collective whose communicator has one GPU per node (network-only rings: NCCL
        sizes their channels by the NIC, not by NVLink; `nccl_channels_net`, else `nccl_channels`)."""
        if self.sm_count <= 0 or self.nccl_channels <= 0:
            return 0.0
        return min(1.0, (self.nccl_channels_net or self.nccl_channels) / self.sm_count)

    def with_overlap_slowdown(self, slowdown: float) -> Profile:
        if not slowdown >= 0:
            raise InputError(f"overlap slowdown must be >= 0 (0 = none), got {slowdown!r}")
        prov = dict(self.provenance)
        prov["overlap_slowdown"] = f"given in the config: {slowdown:g}"
        return replace(self, overlap_slowdown=slowdown, provenance=prov)

    def contention(self, ranks_per_node: int, threads: int = 1, kind: str = "compute",
                   threads_measured: bool = False) -> float:
        """CPU profiles (rates measured on one thread): time multiplier of work of `kind` (compute | ns |
        elementwise) for `ranks_per_node` ranks of `threads` threads each sharing `cpu_cores` cores:
        ranks x threads / cores when oversubscribed, divided by the speedup of `threads` threads, which is
        interpolated linearly between 1 (one thread) and the measured [threads] speedup at cpu_cores
        threads (not measured: linear scaling, an ASSUMPTION), times the co-run slowdown of `ranks` busy
        processes, interpolated likewise between 1 (one process) and the measured slowdown with every
        core busy (not measured: 1). threads_measured: the times were measured at `threads` threads
        already (a cost table profiled so): no speedup is applied. GPUs: 1."""
        if self.cpu_cores <= 0:
            return 1.0
        if self.cpu_cores == 1:
            return float(ranks_per_node * threads)

        def between(full: float, k: int) -> float:  # 1 at k = 1, `full` at k = cpu_cores
            return 1.0 + (full - 1.0) * (min(k, self.cpu_cores) - 1) / (self.cpu_cores - 1)

        speedup = 1.0 if threads_measured else between(self.thread_speedup.get(kind, float(self.cpu_cores)),
                                                       threads)
        corun = between(self.corun_slowdown.get(kind, 1.0), ranks_per_node)
        return max(1.0, ranks_per_node * threads / self.cpu_cores) * corun / speedup

    def network_for(self, ranks_per_node: int, speed_scale: float = 1.0) -> Network:
        """The fabric as `ranks_per_node` ranks see it: on a CPU host, collectives (CPU-bound copies and
        loopback transfers) stretch by the core contention of the ranks (and by `speed_scale`, the
        host's speed now vs when profiled); GPUs: unchanged."""
        f = self.contention(ranks_per_node) * speed_scale
        if f == 1.0:
            return self.network
        n = self.network
        return replace(n, curves={k: c.scaled(1 / f) for k, c in n.curves.items()},
                       base_latency_s=n.base_latency_s * f, intra_alpha_s=n.intra_alpha_s * f,
                       inter_alpha_s=n.inter_alpha_s * f)


def profile_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.toml")))


def _names(v, where: str) -> tuple[str, ...]:
    names = [v] if isinstance(v, str) else v
    if not isinstance(names, list) or not names or not all(isinstance(x, str) and x for x in names):
        raise InputError(f"{where}: cost_profile must be a name or a non-empty list of names, got {v!r}")
    return tuple(names)


def _value(entry, key: str, where: str) -> tuple[float, str]:
    if isinstance(entry, dict):
        if "value" not in entry or "source" not in entry:
            raise InputError(f"{where}: {key} needs value and source")
        v, src = entry["value"], str(entry["source"])
    else:
        raise InputError(f"{where}: {key} must be {{ value = ..., source = \"...\" }} "
                         "(provenance is required)")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
        raise InputError(f"{where}: {key} must be a non-negative number, got {v!r}")
    return float(v), src


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: malformed TOML: {e}") from None


def _curves_from_points(points: list, net_base: dict, where: str, prov: dict,
                        cores: int = 0) -> dict[str, BandwidthCurve]:
    base_s, alpha_s = net_base["base_latency_s"], net_base["intra_alpha_s"]
    per: dict[str, dict[float, list[float]]] = {k: {} for k in _CURVE_KINDS}
    if not isinstance(points, list):
        raise InputError(f"{where}: network.points must be an array of tables ([[network.points]])")
    for i, p in enumerate(points):
        w = f"{where}: network.points[{i}]"
        _check_keys(_as_table(p, w), _POINT_KEYS, w)
        kind = p.get("kind")
        if kind not in _CURVE_KINDS:
            raise choice_error(f"point kind in {w}", kind, _CURVE_KINDS)
        n = p.get("ranks")
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise InputError(f"{w}: ranks must be an integer >= 2, got {n!r}")
        count = p.get("collectives", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InputError(f"{w}: collectives must be an integer >= 1, got {count!r}")
        size, t_ms = p.get("size_bytes", 0), p.get("time_ms", 0)
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf
               for v in (size, t_ms)):
            raise InputError(f"{w}: size_bytes and time_ms must be positive numbers, got {size!r} and "
                             f"{t_ms!r}")
        size, t_ms = float(size), float(t_ms)
        if cores > 0:  # CPU host: normalize to an uncontended host (see Profile.network_for)
            t_ms /= max(1.0, n / cores)
        factor = 2 if kind == "all_reduce" else 1  # ring steps and bus bytes, as collectives.py
        busy = t_ms * 1e-3 - count * (base_s + factor * (n - 1) * alpha_s)
        if busy <= 0:
            raise InputError(f"{w}: time {t_ms} ms is below the latency model's floor for {n} ranks")
        per[kind].setdefault(size, []).append(factor * (n - 1) / n * size / busy)
        prov[f"network.points[{i}]"] = str(p.get("source", "no source given"))
    curves = {}
    for kind, by_size in per.items():
        if not by_size:
            if kind in ("all_gather", "broadcast"):
                raise InputError(f"{where}: no network.points of kind {kind!r}")
            continue
        sizes = tuple(sorted(by_size))
        curves[kind] = BandwidthCurve(sizes, tuple(statistics.median(by_size[s]) for s in sizes))
    return curves


UNCERTAIN_INPUTS = ("nic_gbps_per_node", "inter_efficiency", "curve_scale", "nccl_channels",
                    "overlap_slowdown", "fwd_tflops", "bwd_tflops")  # what simulator.calibration.bands can vary


def _uncertainty(table: dict, where: str) -> dict[str, dict]:
    INPUTS = UNCERTAIN_INPUTS
    out = {}
    for name, e in table.items():
        w = f"{where}: [uncertainty] {name}"
        if name not in INPUTS:
            raise choice_error(f"uncertain input in {where}", name, INPUTS)
        _check_keys(_as_table(e, w), ("low", "high", "rel", "source"), w)
        if not str(e.get("source", "")).strip():
            raise InputError(f"{w}: needs a source")
        nums = {k: e[k] for k in ("low", "high", "rel") if k in e}
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
               for v in nums.values()):
            raise InputError(f"{w}: low, high and rel must be finite numbers >= 0, got {nums}")
        if not ("rel" in nums) ^ ("low" in nums and "high" in nums) or ("rel" in nums and len(nums) > 1):
            raise InputError(f"{w}: give low and high, or rel (not both)")
        if "low" in nums and nums["low"] > nums["high"]:
            raise InputError(f"{w}: low {nums['low']} is above high {nums['high']}")
        out[name] = {**{k: float(v) for k, v in nums.items()}, "source": str(e["source"])}
    return out


_LOADED: dict[tuple, Profile] = {}


def load_profile(name_or_path: str | Path, _seen: tuple[str, ...] = ()) -> Profile:
    """A profile by name (simulator/profiles/<name>.toml) or from a .toml path. The built-in profiles are
    parsed once per process while no file of simulator/profiles changes (a search loads one per layout);
    a Profile is frozen and shared."""
    text = str(name_or_path)
    if not (PROFILE_DIR / f"{text}.toml").is_file():
        return _load_profile(name_or_path, _seen)
    key = (text, _seen, tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size)
                              for f in sorted(PROFILE_DIR.glob("*.toml"))))
    if key not in _LOADED:
        _LOADED[key] = _load_profile(name_or_path, _seen)
    return _LOADED[key]


def _load_profile(name_or_path: str | Path, _seen: tuple[str, ...] = ()) -> Profile:
    text = str(name_or_path)
    path = PROFILE_DIR / f"{text}.toml"
    if not path.is_file():
        path = Path(text)
        if path.suffix.lower() == ".toml" and not path.is_file():
            raise InputError(f"gpu profile file {text!r} does not exist; accepted: a profile .toml path or "
                             f"one of {', '.join(profile_names())}")
        if path.suffix.lower() != ".toml":
            raise choice_error("gpu profile", text, list(profile_names()) + ["<path>.toml"])
    if str(path) in _seen:
        raise InputError(f"{path}: curve_from cycle through {_seen}")
    data = _read(path)
    where = str(path)
    prov: dict[str, str] = {}
    _check_keys(data, _TOP_KEYS, where)
    comp = _as_table(data.get("compute", {}), f"{where}: [compute]")
    net = _as_table(data.get("network", {}), f"{where}: [network]")
    _check_keys(comp, (*_COMPUTE_KEYS, "grad_prep_passes", "comm_overlap_slowdown", "sm_count", "memory_gib",
                       "attention_causal_fraction", "activation_rw_passes"),
                f"{where}: [compute]")
    _check_keys(net, _NETWORK_TABLE_KEYS, f"{where}: [network]")
    c: dict[str, float] = {}
    for key in _COMPUTE_KEYS:
        if key not in comp:
            raise InputError(f"{where}: [compute] misses {key}; required: {', '.join(_COMPUTE_KEYS)}")
        c[key], prov[key] = _value(comp[key], key, where)
    nv: dict[str, float] = {}
    for key in _NETWORK_KEYS:
        if key not in net:
            raise InputError(f"{where}: [network] misses {key}; required: {', '.join(_NETWORK_KEYS)}")
        nv[key], prov[key] = _value(net[key], key, where)
    base = {"base_latency_s": nv["base_latency_us"] * 1e-6, "intra_alpha_s": nv["intra_alpha_us"] * 1e-6}
    gpn = data.get("gpus_per_node", 8)
    cores = data.get("cpu_cores", 0)
    for key, v in (("gpus_per_node", gpn), ("cpu_cores", cores)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "gpus_per_node" else 0):
            raise InputError(f"{where}: {key} must be an integer (>= 1 for gpus_per_node), got {v!r}")
    if "points" in net:
        curves = _curves_from_points(net["points"], base, where, prov, cores)
    elif "curve_from" in net:
        other = load_profile(str(net["curve_from"]), _seen + (str(path),))
        scale, prov["curve_scale"] = _value(net.get("curve_scale"), "curve_scale", where)
        curves = {k: v.scaled(scale) for k, v in other.network.curves.items()}
        prov["curve_from"] = f"busbw curve of profile {other.name!r} x {scale:g}"
    else:
        raise InputError(f"{where}: [network] needs [[network.points]] or curve_from")
    grad_prep = 0.0
    if "grad_prep_passes" in comp:
        grad_prep, prov["grad_prep_passes"] = _value(comp["grad_prep_passes"], "grad_prep_passes", where)
    comm_slow = 0.0
    if "comm_overlap_slowdown" in comp:
        key = "comm_overlap_slowdown"
        comm_slow, prov[key] = _value(comp[key], key, where)
    for key, v in (("overlap_slowdown", c["overlap_slowdown"]), ("comm_overlap_slowdown", comm_slow)):
        if math.isinf(v):
            raise InputError(f"{where}: [compute] {key} must be finite, got {v!r}")
    thr = _as_table(data.get("threads", {}), f"{where}: [threads]")
    _check_keys(thr, tuple(f"{k}_{what}" for what in ("speedup", "corun_slowdown") for k in THREAD_KINDS),
                f"{where}: [threads]")
    speedups, coruns = {}, {}
    for kind in THREAD_KINDS:
        for what, into in (("speedup", speedups), ("corun_slowdown", coruns)):
            key = f"{kind}_{what}"
            if key in thr:
                v, prov[key] = _value(thr[key], key, where)
                if not (math.isfinite(v) and v > 0):
                    raise InputError(f"{where}: [threads] {key} must be a finite number > 0, got {v!r}")
                into[kind] = v
    if (speedups or coruns) and cores <= 0:
        raise InputError(f"{where}: [threads] is for CPU profiles (cpu_cores > 0)")
    for key in ("fwd_tflops", "bwd_tflops", "peak_bf16_tflops", "hbm_GBps", "elementwise_scale"):
        if not c[key] > 0:
            raise InputError(f"{where}: {key} must be > 0")
    sym = data.get("symmetric_kernels", True)
    if not isinstance(sym, bool):
        raise InputError(f"{where}: symmetric_kernels must be true or false, got {sym!r}")
    dtype = data.get("dtype", "bf16")
    if dtype not in DTYPES:
        raise choice_error(f"dtype in {where}", dtype, DTYPES)
    opt: dict[str, float] = {}
    for key in _NETWORK_OPTIONAL:
        if key in net:
            opt[key], prov[key] = _value(net[key], key, where)
    protocols = []
    for pname, ptab in _as_table(net.get("protocols", {}), f"{where}: [network.protocols]").items():
        w = f"{where}: [network.protocols.{pname}]"
        _check_keys(_as_table(ptab, w), (*_PROTOCOL_KEYS, "source"), w)
        missing = [k for k in (*_PROTOCOL_KEYS, "source") if k not in ptab]
        if missing:
            raise InputError(f"{w}: misses {missing[0]}; required: {', '.join((*_PROTOCOL_KEYS, 'source'))}")
        vals = {}
        for k in _PROTOCOL_KEYS:
            v = ptab[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InputError(f"{w}: {k} must be a finite number >= 0, got {v!r}")
            vals[k] = float(v)
        lats = (vals[k] * 1e-6 for k in _PROTOCOL_KEYS[:-1])
        protocols.append(Protocol(str(pname), *lats, vals["bw_factor"]))
        prov[f"protocol {pname}"] = str(ptab["source"])
    uncertainty = _uncertainty(_as_table(data.get("uncertainty", {}), f"{where}: [uncertainty]"), where)
    megatron = {"attention_causal_fraction": 0.5, "activation_rw_passes": 0.0}  # issue 29 (module docstring)
    for key in megatron:
        if key in comp:
            megatron[key], prov[key] = _value(comp[key], key, where)
    if not 0 < megatron["attention_causal_fraction"] <= 1 or megatron["activation_rw_passes"] < 0:
        raise InputError(f"{where}: [compute] attention_causal_fraction must be in (0, 1] and "
                         f"activation_rw_passes >= 0, got {megatron}")
    memory_gib = 0.0
    if "memory_gib" in comp:
        memory_gib, prov["memory_gib"] = _value(comp["memory_gib"], "memory_gib", where)
    sm_count = 0
    if "sm_count" in comp:
        v, prov["sm_count"] = _value(comp["sm_count"], "sm_count", where)
        sm_count = int(v)
    if not 0 < opt.get("tree_bw_factor", 0.92) <= 1:
        raise InputError(f"{where}: [network] tree_bw_factor must be in (0, 1], got {opt['tree_bw_factor']}")
    tree = {k: opt[f"{k}_us"] * 1e-6 for k in ("tree_intra_alpha", "tree_inter_alpha") if f"{k}_us" in opt}
    tree = {f"{k}_s": v for k, v in tree.items()}
    if "tree_bw_factor" in opt:
        tree["tree_bw_factor"] = opt["tree_bw_factor"]
    network = Network(
        **tree,
        protocols=tuple(protocols),
        curves=curves,
        base_latency_s=base["base_latency_s"],
        intra_alpha_s=base["intra_alpha_s"],
        inter_alpha_s=nv["inter_alpha_us"] * 1e-6,
        nic_Bps_per_node=nv["nic_gbps_per_node"] * 1e9 / 8,
        inter_efficiency=nv["inter_efficiency"],
        backend="gloo" if cores else "nccl",  # a CPU profile's ranks are gloo processes
    )
    return Profile(
        name=str(data.get("name", path.stem)),
        description=str(data.get("description", "")),
        gpu=str(data.get("gpu", "")),
        cost_profiles=tuple(str((PROFILE_DIR / n).resolve()) if n.endswith(".csv") else n
                            for n in _names(data.get("cost_profile", path.stem), where)),
        dtype=dtype,
        symmetric_kernels=sym,
        gpus_per_node=gpn,
        cpu_cores=cores,
        peak_bf16_flops=c["peak_bf16_tflops"] * 1e12,
        hbm_Bps=c["hbm_GBps"] * 1e9,
        fwd_flops=c["fwd_tflops"] * 1e12,
        fwd_layer_overhead_s=c["fwd_layer_overhead_ms"] * 1e-3,
        bwd_flops=c["bwd_tflops"] * 1e12,
        bwd_layer_overhead_s=c["bwd_layer_overhead_ms"] * 1e-3,
        optimizer_overhead_s=c["optimizer_overhead_ms"] * 1e-3,
        elementwise_scale=c["elementwise_scale"],
        grad_prep_passes=grad_prep,
        overlap_slowdown=c["overlap_slowdown"],
        comm_overlap_slowdown=comm_slow,
        nvlink_Bps=nv["nvlink_GBps"] * 1e9,
        network=network,
        sm_count=sm_count,
        memory_gib=memory_gib,
        attention_causal_fraction=megatron["attention_causal_fraction"],
        activation_rw_passes=megatron["activation_rw_passes"],
        uncertainty=uncertainty,
        nccl_channels=int(opt.get("nccl_channels", 0)),
        nccl_channels_net=int(opt.get("nccl_channels_net", 0)),
        thread_speedup=speedups,
        corun_slowdown=coruns,
        provenance=prov,
    )
