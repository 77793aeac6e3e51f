"""What a model read from a config.json amounts to (`simulator.models.hf_config` re-exports these): parameters used
per token, the matrix table (one row per matrix kind and shape, fused parameters counted by the matrices
they hold), forward FLOPs per token and parameter counts."""

from __future__ import annotations

from dmuon.errors import InputError

from .workload_spec import Workload


def active_params(workload: Workload) -> float:
    """Parameters one token uses in the main model (routed experts x top_k / experts; embedding and head
    included; MTP modules left out)."""
    head_layer = max((p.layer for p in workload.params if p.matrix == "norm"), default=workload.n_layers)
    return sum(p.numel * min(1.0, p.matmuls_per_token or (1.0 if "embed" in p.matrix else 0.0))
               for p in workload.params if p.layer <= head_layer)


def matrix_table(workload: Workload) -> list[dict]:
    """One row per (matrix kind, shape, optimizer) with its count, in first-seen order (what `count` means
    in the catalog: a config's E experts of one shape are one row with count E x layers)."""
    rows: dict[tuple, dict] = {}
    for p in workload.params:
        for kind in p.matrix_kinds():
            key = (kind, p.rows, p.cols, p.optimizer)
            r = rows.get(key)
            if r is None:
                rows[key] = {"matrix": kind, "rows": p.rows, "cols": p.cols, "count": 1,
                             "optimizer": p.optimizer, "matmuls_per_token": p.matmuls_per_token}
            else:
                r["count"] += 1
    return list(rows.values())


def flops_per_token(workload: Workload, seq_len: int) -> float:
    """Forward FLOPs per token at `seq_len` as the compute model charges them (simulator.models.compute)."""
    from .compute import layer_flops

    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise InputError(f"seq_len must be a positive integer, got {seq_len!r}")
    return sum(lc.fwd_flops for lc in layer_flops(workload, seq_len, 1)) / seq_len


def n_params(workload: Workload, *, mtp: bool = True) -> int:
    """Total parameters; mtp=False leaves out DeepSeek-style MTP modules (the layers after the head)."""
    head_layer = max((p.layer for p in workload.params if p.matrix == "norm"), default=workload.n_layers)
    return sum(p.numel for p in workload.params if mtp or p.layer <= head_layer)
