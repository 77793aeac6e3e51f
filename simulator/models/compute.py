"""Forward / backward compute of a workload, per layer: FLOPs and the profile's time for them.

Per layer l with weight matrices W (rows x cols), per GPU and micro-step, T = micro_batch x seq_len:

    matmul FLOPs   2 x sum(rows x cols x uses) x T   over the matrices that are multiplied: every matrix
                   except embedding lookups (a matrix whose name contains "embed" costs nothing), where
                   uses = ParamSpec.matmuls_per_token (1 for catalog rows; top_k / experts for a routed
                   expert of a config.json model, 0 for its norm and bias vectors), plus one
                   output-head matmul for an embedding tied to the head (its note says "tied") when the
                   workload has no separate head matrix, charged to the last layer (where it runs)
    attention      4 x micro_batch x seq_len^2 x d_q x causal, causal = 0.5 (a flash-style kernel skips
                   the masked half), once per query projection in the layer; d_q = the matrix's
                   `attn_width` where set (config.json models: heads x head_dim, or for MLA heads x
                   (qk + v head dims) / 2), else rows of a q-like
                   matrix (q_proj, q, query), model width (cols) of a fused qkv matrix, rows of the first
                   of each group of four "..._qkvo" matrices (q, k, v, o stored as four)
    forward FLOPs  matmul + attention;  backward FLOPs = 2 x forward
    time           forward FLOPs / fwd_flops + fwd_layer_overhead_s (and the same for backward), the
                   profile's fitted achieved rates; CPU profiles stretch it by core contention.
    profile's causal  the attention term's causal is the profile's attention_causal_fraction (0.5 unless
                   the profile says otherwise; the a100 profile: 1.0, Megatron-LM 2021-22's kernels)
    memory-bound   only where the profile sets activation_rw_passes > 0 (the a100 profile; every fitted
                   profile's rates already hold these passes): per transformer layer (a layer with a query
                   projection), the activation bytes Korthikanti et al. 2022 (Sec. 4.1) count for one
                   micro-batch, s b h (10 + 24 / t) + 5 a s^2 b / t (with sequence parallelism s b h 34 / t
                   + 5 a s^2 b / t), moved activation_rw_passes times forward and 2 x that backward, at
                   hbm_GBps (`activation_memory_s`; a = attention heads, t = tensor-parallel degree)

ASSUMPTION (stated wherever results are shown): every token goes through every component (for the VLA /
world-model workloads the token counts per component are not public).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from simulator.fabric.hardware import Profile
from .workload_spec import ParamSpec, Workload

CAUSAL_FRACTION = 0.5
_Q_NAMES = re.compile(r"^(q_proj|q|query|wq)$")
_QKV_NAMES = re.compile(r"^(qkv|qkv_proj|wqkv|c_attn|query_key_value)$")


def _query_width(p: ParamSpec) -> int:
    """d_q of one attention if `p` is its query (or fused qkv) projection, else 0."""
    m = p.matrix.lower()
    if _Q_NAMES.match(m):
        return p.rows
    if _QKV_NAMES.match(m):
        return p.cols
    if m.endswith("qkvo") and p.name.endswith(".0"):
        return p.rows
    return 0


def _is_lookup(p: ParamSpec) -> bool:
    return "embed" in p.matrix.lower()


@dataclass(frozen=True)
class LayerCompute:
    layer: int
    matmul_flops: float
    attention_flops: float

    @property
    def fwd_flops(self) -> float:
        return self.matmul_flops + self.attention_flops

    @property
    def bwd_flops(self) -> float:
        return 2.0 * self.fwd_flops


def layer_flops(workload: Workload, seq_len: int, micro_batch: int,
                causal_fraction: float = CAUSAL_FRACTION) -> list[LayerCompute]:
    """Forward FLOPs per layer on one GPU for one micro-batch (see the module docstring). causal_fraction:
    the share of the s x s score matrix the attention kernel computes (1.0 for kernels that multiply the
    whole matrix and mask it, as Megatron-LM's 2021-2022 attention did: simulator.validation.validate_megatron)."""
    tokens = seq_len * micro_batch
    has_head = any("head" in p.matrix.lower() for p in workload.params)
    out = []
    tied_head = 0.0
    kinds: dict[str, tuple[bool, bool]] = {}  # matrix kind -> (a lookup, may be a query): one name test each
    for layer, params in enumerate(workload.layer_params()):
        mm = 0.0
        attn = 0.0
        for p in params:
            kind = kinds.get(p.matrix)
            if kind is None:
                m = p.matrix.lower()
                kind = kinds[p.matrix] = ("embed" in m, bool(_Q_NAMES.match(m) or _QKV_NAMES.match(m)
                                                              or m.endswith("qkvo")))
            if kind[0]:
                if not has_head and "tied" in p.note.lower():
                    tied_head += 2.0 * p.numel * tokens
                continue
            mm += 2.0 * p.numel * tokens * p.matmuls_per_token
            d_q = p.attn_width or (kind[1] and _query_width(p))
            if d_q:
                attn += 4.0 * micro_batch * seq_len * seq_len * d_q * causal_fraction
        out.append(LayerCompute(layer, mm, attn))
    if tied_head:  # the tied head runs at the end of the forward pass: charge it to the last layer
        last = out[-1]
        out[-1] = LayerCompute(last.layer, last.matmul_flops + tied_head, last.attention_flops)
    return out


def is_attention_layer(workload: Workload) -> list[bool]:
    """Per layer: does it hold a query projection (a transformer layer, as `layer_flops` counts it)."""
    return [any(not _is_lookup(p) and (p.attn_width or _query_width(p)) for p in ps)
            for ps in workload.layer_params()]


def activation_memory_s(profile: Profile, seq_len: int, micro_batch: int, hidden: int, heads: int | None,
                        tp: int = 1, sp: bool = False) -> tuple[float, float, float]:
    """(forward, backward, attention-core share of the forward) seconds of one transformer layer's
    memory-bound passes on one GPU for one micro-batch (module docstring); zeros where the profile does
    not model them (activation_rw_passes 0)."""
    if not profile.activation_rw_passes:
        return 0.0, 0.0, 0.0
    if not heads:
        from dmuon.errors import InputError

        raise InputError(f"profile {profile.name} prices memory-bound passes from the attention heads; "
                         "accepted: a config.json model (--model) whose file gives them")
    sbh = seq_len * micro_batch * hidden
    scores = 5.0 * heads * seq_len * seq_len * micro_batch / tp
    act = (sbh * 34 / tp if sp else sbh * (10 + 24 / tp)) + scores
    fwd = profile.activation_rw_passes * act / profile.hbm_Bps
    return fwd, 2.0 * fwd, profile.activation_rw_passes * scores / profile.hbm_Bps


def layer_times(workload: Workload, profile: Profile, seq_len: int, micro_batch: int,
                ranks_per_node: int, threads: int = 1, tp: int = 1, sp: bool = False,
                heads: int | None = None, hidden: int = 0) -> list[tuple[float, float]]:
    """(forward seconds, backward seconds) per layer on one device of `profile`; tp, sp, heads, hidden:
    the memory-bound passes' settings (only used where the profile models them)."""
    stretch = profile.contention(ranks_per_node, threads)
    mf, mb, _ = activation_memory_s(profile, seq_len, micro_batch, hidden, heads, tp, sp)
    attn = is_attention_layer(workload) if mf else None
    out = []
    for i, lc in enumerate(layer_flops(workload, seq_len, micro_batch, profile.attention_causal_fraction)):
        f = lc.fwd_flops / profile.fwd_flops + profile.fwd_layer_overhead_s
        b = lc.bwd_flops / profile.bwd_flops + profile.bwd_layer_overhead_s
        if mf and attn[i]:
            f, b = f + mf, b + mb
        out.append((stretch * f, stretch * b))
    return out
