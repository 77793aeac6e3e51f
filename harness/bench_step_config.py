"""What one `harness bench step` run is: its configuration (`StepConfig`), the checks that run before
any process starts (`check_config`: every InputError the run could raise) and the device and thread
count each rank uses. See harness/cmd_bench_step.py for what the run measures.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from fractions import Fraction

from dmuon.errors import InputError, choice_error

STRATEGIES = ("dmuon", "naive", "adamw")
LAYOUTS = ("ddp", "fsdp2-owner", "fsdp2-sharded")
MEMORY = ("keep", "free")
OVERLAP = ("on", "off", "both")
NS_DTYPES = ("default", "bf16", "fp16", "fp32")
METRICS = ("step_s", "forward_s", "backward_s", "optimizer_s", "exposed_comm_s", "optimizer_cpu_s")


@dataclass
class StepConfig:
    ranks: int = 2
    strategies: tuple[str, ...] = ("dmuon",)
    overlap: str = "on"
    workload: str = "qwen2.5-7b"
    width_scale: float = 1 / 16
    layers: int | None = 4
    seq_len: int = 128
    micro_batch: int = 2
    steps: int = 8
    warmup: int = 2
    rounds: int = 2
    phase_barrier: bool = True
    rank_sessions: bool = False  # spawned ranks: each in a session of its own (scheduler autogroup)
    balancer: str = "lpt"
    exchanges: tuple[str, ...] = ("auto",)
    node_size: int | None = None
    profile: str | None = None
    device: str = "auto"
    threads: int = 0  # 0: cores // ranks (at least 1)
    seed: int = 0
    timeout_s: float = 1800.0
    profile_trace: str | None = None
    layout: str = "ddp"
    memory: str = "keep"
    exact_memory: bool = False
    speed_probe: bool = False
    ns_methods: tuple[str, ...] = ("auto",)  # NSConfig.method of the Muon strategies, one variant each
    ns_dtypes: tuple[str, ...] = ("default",)  # NSConfig.dtype ('default': None, the device's default)
    comm_dtype: str | None = None  # DMuon / NaiveMuon comm_dtype
    max_splits: tuple[int, ...] = (1,)  # DMuon max_split, one variant each
    wide: tuple[int, int] | None = None  # (rows, cols) of the bench model's extra matrix (WideMix)
    model: str | None = None  # a Hugging Face config.json (harness.hf_model) instead of the bench model
    hidden: int | None = None  # --model: hidden size (harness.hf_model.shrink)
    vocab: int | None = None  # --model: vocabulary size
    model_raw: dict | None = None  # --model: the shrunk config dict every rank builds (set by check_config)
    model_path: str = ""  # --model: the config.json it names (set by check_config)
    model_name: str = ""  # --model: its folder's name (set by check_config)
    notes: list[str] = field(default_factory=list)

    def variants(self) -> list[tuple[str, bool, str, str, str, int]]:
        """(strategy, overlap, exchange, ns method, ns dtype, max_split) of every block; the exchange mode
        and max_split vary for dmuon only, the NS settings for the Muon strategies only (adamw runs no
        NS)."""
        overlaps = {"on": (True,), "off": (False,), "both": (True, False)}[self.overlap]
        return [(s, ov, ex, m, d, k) for s in self.strategies for ov in overlaps
                for ex in (self.exchanges if s == "dmuon" else self.exchanges[:1])
                for m in (self.ns_methods if s != "adamw" else self.ns_methods[:1])
                for d in (self.ns_dtypes if s != "adamw" else self.ns_dtypes[:1])
                for k in (self.max_splits if s == "dmuon" else (1,))]

    def ns_config(self, method: str, dtype: str):
        from dmuon import NSConfig

        return NSConfig(method=method, dtype=None if dtype == "default" else dtype)


def parse_scale(text) -> float:
    try:
        value = float(Fraction(str(text)))
    except (ValueError, ZeroDivisionError):
        raise InputError(f"width_scale {text!r} is not a number; accepted: e.g. 0.0625 or 1/16") from None
    if not value > 0:
        raise InputError(f"width_scale must be > 0, got {text!r}")
    return value


def check_config(cfg: StepConfig) -> None:
    """Every InputError the run could raise, before any process starts."""
    from simulator.models.benchmodel import decoder_spec
    from simulator.models.workload import load_workload

    for name, v, lo in (("ranks", cfg.ranks, 1), ("seq_len", cfg.seq_len, 1),
                        ("micro_batch", cfg.micro_batch, 1), ("steps", cfg.steps, 1),
                        ("warmup", cfg.warmup, 0), ("threads", cfg.threads, 0), ("rounds", cfg.rounds, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InputError(f"{name} must be an integer >= {lo}, got {v!r}")
    if not cfg.strategies:
        raise InputError(f"no strategy given; accepted: {', '.join(STRATEGIES)} (comma-separated)")
    for s in cfg.strategies:
        if s not in STRATEGIES:
            raise choice_error("strategy", s, STRATEGIES)
    from dmuon.newton_schulz import METHODS as NS_METHODS
    from dmuon.runtime.base import COMM_DTYPES

    for m in cfg.ns_methods or ("",):
        if m not in NS_METHODS:
            raise choice_error("ns method", m, NS_METHODS)
    for d in cfg.ns_dtypes or ("",):
        if d not in NS_DTYPES:
            raise choice_error("ns dtype", d, NS_DTYPES)
    if cfg.comm_dtype is not None and cfg.comm_dtype not in COMM_DTYPES:
        raise choice_error("comm dtype", cfg.comm_dtype, tuple(COMM_DTYPES))
    if cfg.overlap not in OVERLAP:
        raise choice_error("overlap", cfg.overlap, OVERLAP)
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise choice_error("device", cfg.device, ("auto", "cpu", "cuda"))
    from dmuon.distributed import BALANCERS
    from dmuon.runtime.exchange import EXCHANGE_CHOICES
    from dmuon.runtime.groups import check_node_size

    if cfg.balancer not in BALANCERS:
        raise choice_error("balancer", cfg.balancer, BALANCERS)
    if not cfg.exchanges:
        raise InputError(f"no exchange mode given; accepted: {', '.join(EXCHANGE_CHOICES)} (comma-separated)")
    for ex in cfg.exchanges:
        if ex not in EXCHANGE_CHOICES:
            raise choice_error("exchange", ex, EXCHANGE_CHOICES)
    check_node_size(cfg.node_size, cfg.ranks)
    if not cfg.max_splits:
        raise InputError(f"no max split given; accepted: integers from 1 to --ranks ({cfg.ranks}), "
                         "comma-separated")
    for k in cfg.max_splits:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cfg.ranks:
            raise InputError(f"max split must be an integer from 1 (no splitting) to --ranks ({cfg.ranks}), "
                             f"got {k!r}")
    from simulator.models.benchmodel import check_wide

    check_wide(cfg.wide)
    if cfg.layout not in LAYOUTS:
        raise choice_error("layout", cfg.layout, LAYOUTS)
    if cfg.memory not in MEMORY:
        raise choice_error("memory", cfg.memory, MEMORY)
    if cfg.layout == "ddp" and cfg.memory != "keep":
        raise InputError("--memory free needs an FSDP2 layout; accepted with --layout ddp: keep")
    if cfg.layout != "ddp" and cfg.node_size is not None:
        raise InputError("--node-size is for --layout ddp (FSDP2 layouts use a 1-D mesh here)")
    if cfg.model is not None:
        check_model(cfg)
    else:
        for name, v in (("hidden", cfg.hidden), ("vocab", cfg.vocab)):
            if v is not None:
                raise InputError(f"{name} is for a Hugging Face model (--model path/to/config.json); the "
                                 "bench model's size is set by --workload, --width-scale and --layers")
        decoder_spec(load_workload(cfg.workload).scaled(cfg.width_scale, blocks=cfg.layers))
    if isinstance(cfg.timeout_s, bool) or not isinstance(cfg.timeout_s, (int, float)) \
            or not math.isfinite(cfg.timeout_s) or cfg.timeout_s <= 0:
        raise InputError(f"timeout_s must be a finite number of seconds > 0, got {cfg.timeout_s!r}")
    if cfg.profile is not None:  # a missing or malformed profile fails here, not inside every rank
        from dmuon.plan.cost import CostTable

        CostTable.load(cfg.profile)
    if cfg.profile_trace:
        try:
            os.makedirs(cfg.profile_trace, exist_ok=True)
        except OSError as e:
            raise InputError(f"--profile-trace {cfg.profile_trace!r}: cannot create this folder "
                             f"({e.strerror or type(e).__name__}); give a writable folder") from None
        if not os.access(cfg.profile_trace, os.W_OK):
            raise InputError(f"--profile-trace {cfg.profile_trace!r} is not writable; give a writable folder")


def check_model(cfg: StepConfig) -> None:
    """--model: read and shrink the config.json and let transformers check it (no weights allocated);
    the shrunk dict goes to every rank in cfg.model_raw."""
    from .hf_model import model_name, shrunk_config

    if cfg.wide is not None:
        raise InputError("--wide-matrix adds a matrix to the bench model; it cannot be used with --model")
    if cfg.speed_probe:
        raise InputError("--speed-probe prices the bench model's workload; it cannot be used with --model")
    path, cfg.model_raw = shrunk_config(cfg.model, layers=cfg.layers, hidden=cfg.hidden, vocab=cfg.vocab)
    cfg.model_path = str(path)
    cfg.model_name = model_name(path)


def use_cuda(cfg: StepConfig) -> bool:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda but no CUDA device is visible; accepted here: cpu, auto")
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def threads_for(cfg: StepConfig, local_world: int) -> int:
    return cfg.threads or max(1, (os.cpu_count() or 1) // local_world)


__all__ = ["LAYOUTS", "MEMORY", "METRICS", "NS_DTYPES", "OVERLAP", "STRATEGIES", "StepConfig", "check_config",
           "check_model", "parse_scale", "threads_for", "use_cuda"]
