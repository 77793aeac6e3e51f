"""Multi-node validation: public nccl-tests numbers on A100 / H100 InfiniBand clusters vs the simulator's
collective model (experiments/reference/multinode_public.csv, one source URL per row).

Each row names its cluster: GPUs per node, NICs per node and their line rate, and the node's single-node
bus bandwidth (from the same source where it gave one, else the shared reference's figure for that GPU:
column intra_source). The prediction is `simulator.fabric.collectives.collective_time_s(..., nccl=True)` on a
Network with that single-node busbw as a flat curve, the row's NICs, and everything else from the a800
profile: NCCL's tuner latencies (Simple, LL, LL128; ring and tree), tree bandwidth factor and the
inter-node efficiency (an ASSUMPTION there, 0.9). busbw follows nccl-tests: algbw x 2 (n-1)/n for
all-reduce, x (n-1)/n for all-gather / reduce-scatter. What this checks: the inter-node terms (NIC
bandwidth, rings vs trees, protocol latencies growing with nodes), not the intra-node curve.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

from simulator.fabric.collectives import BandwidthCurve, Group, collective_time_s
from simulator.fabric.hardware import load_profile

MULTINODE_PATH = Path(__file__).resolve().parents[2] / "experiments" / "reference" / "multinode_public.csv"
BOUND = 0.20  # issue 15: new multi-node public rows within 20% each, or explained in docs/simulator.md
_BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n}


def public_rows(path: Path = MULTINODE_PATH) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def predict(row: dict, profile: str = "a800") -> float:
    """The row's metric as the simulator's collective model gives it (busbw in GB/s, or time in us)."""
    base = load_profile(profile).network
    intra = float(row["intra_busbw_GBps"]) * 1e9
    flat = BandwidthCurve((1.0, 1e12), (intra, intra))
    net = replace(base, curves={"all_gather": flat, "broadcast": flat},
                  nic_Bps_per_node=int(row["nics_per_node"]) * float(row["nic_gbps"]) * 1e9 / 8)
    nodes, per_node = int(row["nodes"]), int(row["gpus_per_node"])
    size = float(row["size_bytes"])
    t = collective_time_s(row["collective"], size, Group(nodes, per_node), net, nccl=True)
    if row["metric"] == "time":
        return t * 1e6
    n = nodes * per_node
    return _BUS[row["collective"]](n) * size / t / 1e9


def multinode_rows(profile: str = "a800") -> list[dict]:
    out = []
    for r in public_rows():
        sim = predict(r, profile)
        ref = float(r["value"])
        out.append({"id": r["id"], "collective": r["collective"], "gpu": r["gpu"], "nodes": int(r["nodes"]),
                    "gpus_per_node": int(r["gpus_per_node"]), "size_bytes": float(r["size_bytes"]),
                    "metric": r["metric"], "unit": r["unit"], "published": ref, "simulated": sim,
                    "error": sim / ref - 1, "within_20pct": abs(sim / ref - 1) <= BOUND,
                    "source": r["source"], "note": r["note"]})
    return out


# --- public multi-node FSDP step throughput (experiments/reference/multinode_steps_public.csv) ---
# Each series is one model and one set of settings at several GPU counts, as published (tokens/s/GPU). What
# is compared is the scaling efficiency: tokens/s/GPU at N GPUs over the series' smallest GPU count, published
# vs simulated on the row's cluster. The compute rates a profile cannot know for another GPU and software
# stack (A100 40GB with Composer / H100 at 500 W with torchtitan) cancel in that ratio; what remains is what
# grows with the node count: collective bandwidth and latency, exposed communication, NCCL's SM share.
STEPS_PATH = MULTINODE_PATH.parent / "multinode_steps_public.csv"
_ROOT = MULTINODE_PATH.parent.parent.parent


def step_rows_public(path: Path = STEPS_PATH) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _workload(row: dict):
    """The row's model: a catalog workload, or (workload "mpt") an MPT decoder as a llama-family config of
    the same width, depth, heads and vocabulary with the MLP's parameters and FLOPs kept: MPT's GELU MLP
    (d x 4d, 4d x d = 8 d^2) as a gated MLP of intermediate 8d/3 (3 x d x 8d/3 = 8 d^2); embeddings tied
    as in MPT. MPT's learned position embedding (seq x d, no matmul) is left out."""
    if row["workload"] != "mpt":
        return row["workload"]
    from simulator.models.hf_config import workload_from_config

    d, heads = int(row["d_model"]), int(row["n_heads"])
    config = {"model_type": "llama", "hidden_size": d, "num_hidden_layers": int(row["n_layers"]),
              "num_attention_heads": heads, "num_key_value_heads": heads,
              "intermediate_size": round(8 * d / 3),
              "vocab_size": int(row["vocab"]), "tie_word_embeddings": True}
    return workload_from_config(config, name=row["series"], source=row["source"])


def simulate_step_row(row: dict, workload=None) -> dict:
    """One published row simulated as published: AdamW, the row's layout, sequence length, micro-batch and
    gradient-reduction dtype, on the row's cluster file."""
    from simulator.api import SimConfig, simulate

    w = workload if workload is not None else _workload(row)
    r = simulate(SimConfig(workload=w, gpus=int(row["gpus"]),
                           cluster=str(_ROOT / row["cluster"]), strategy="adamw", layout=row["layout"],
                           seq_len=int(row["seq_len"]), micro_batch=int(row["micro_batch"]),
                           grad_comm_dtype=row["grad_comm_dtype"] or None))
    return {"step_s": r.step_s, "tokens_per_s_per_gpu": r.tokens_per_s / int(row["gpus"])}


def step_scaling_rows(path: Path = STEPS_PATH) -> list[dict]:
    """One row per checked published row above its series' smallest checked GPU count: the published and
    simulated scaling efficiency (tokens/s/GPU at N / at the baseline) and the step time's growth."""
    series: dict[str, list[dict]] = {}
    for r in step_rows_public(path):
        if r["checked"] == "yes":
            series.setdefault(r["series"], []).append(r)
    out = []
    for name, rows in series.items():
        rows = sorted(rows, key=lambda r: int(r["gpus"]))
        w = _workload(rows[0])
        sims = [simulate_step_row(r, w) for r in rows]
        base, sbase = rows[0], sims[0]
        for r, s in zip(rows[1:], sims[1:], strict=True):
            pub = float(r["value"]) / float(base["value"])
            sim = s["tokens_per_s_per_gpu"] / sbase["tokens_per_s_per_gpu"]
            out.append({"series": name, "gpus": int(r["gpus"]), "base_gpus": int(base["gpus"]),
                        "gpu": r["gpu"], "cluster": Path(r["cluster"]).stem,
                        "published": pub, "simulated": sim, "error": sim / pub - 1,
                        "within_20pct": abs(sim / pub - 1) <= BOUND,
                        # step time at N over the baseline's, minus 1 (the same tokens per GPU per step)
                        "published_growth": 1 / pub - 1, "simulated_growth": 1 / sim - 1,
                        "simulated_step_s": s["step_s"], "simulated_base_step_s": sbase["step_s"],
                        "source": r["source"], "note": r["note"]})
    return out
