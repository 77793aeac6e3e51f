"""Clusters as files: a GPU profile placed in nodes of a given size, with their NVLink, NICs and rails.

A cluster file is TOML (experiments/clusters/<name>.toml, or any path):

    name = "h100-ndr"                 optional (default: the file stem)
    description = "one line"          optional
    source = "datasheet"              required: datasheet | measured (what the numbers below are)
    gpu = "h100"                      required: a simulator profile (simulator/profiles/<name>.toml or a
                                      .toml path): compute rates, cost table, latencies, and the shape of
                                      the intra-node bus-bandwidth curve
    gpus_per_node = { value = 8, source = "..." }    GPUs in one NVLink domain (a node, or an NVL72 rack)
    nvlink_GBps = { value = 450, source = "..." }    NVLink bandwidth per GPU per direction, GB/s
    nics_per_node = { value = 8, source = "..." }    scale-out NICs per node
    nic_gbps = { value = 400, source = "..." }       line rate of one NIC per direction, Gbit/s
    rails = { value = 8, source = "..." }            rail networks the NICs are spread over
    inter_efficiency = { value = 0.9, source = "..." }  optional: achieved / line rate (else the profile's)

Every number may also be given bare (`gpus_per_node = 8`); its provenance then says no source was given.
How the file maps onto the simulator's hardware model (`simulator.fabric.hardware.Profile`,
`simulator.fabric.collectives.Network`):
    gpus_per_node     the profile's node size (the two-level collectives' inner level)
    nvlink_GBps       the GPU profile's measured (or borrowed) intra-node busbw curve scaled by
                      nvlink_GBps / the profile's nvlink_GBps (the curve's shape over message sizes kept)
    nics, nic_gbps    NIC bandwidth per node = nics_per_node x nic_gbps (split among the node's concurrent
                      inter-node groups by the collective model)
    rails             checked (1 <= rails <= nics_per_node, dividing it) and recorded: the two-level model
                      assumes a non-blocking fabric in which each local rank's inter-node phase stays on its
                      rail, so the rail count does not change times (there is no cross-rail term)
Bad input (malformed TOML, an unknown key, an impossible value) is one InputError naming what is
accepted; nothing is written. `SimConfig(cluster=...)`'s gpu / gpus_per_node / nic_gbps /
overlap_slowdown, where given, override the file (simulator.api).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import tomllib

from dmuon.errors import InputError, choice_error

from .hardware import Profile, load_profile

CLUSTERS_DIR = Path(__file__).resolve().parents[2] / "experiments" / "clusters"
SOURCES = ("datasheet", "measured")
_NUMBERS = ("gpus_per_node", "nvlink_GBps", "nics_per_node", "nic_gbps", "rails", "inter_efficiency")
_INTS = ("gpus_per_node", "nics_per_node", "rails")
TOP_KEYS = ("name", "description", "source", "gpu", *_NUMBERS)
MAX_GPUS_PER_NODE = 1 << 12


def cluster_names() -> tuple[str, ...]:
    """The cluster files shipped in experiments/clusters/."""
    return tuple(sorted(p.stem for p in CLUSTERS_DIR.glob("*.toml"))) if CLUSTERS_DIR.is_dir() else ()


def cluster_path(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    if text in cluster_names():
        return CLUSTERS_DIR / f"{text}.toml"
    path = Path(text)
    if path.suffix.lower() != ".toml":
        raise choice_error("cluster", text, list(cluster_names()) + ["<path>.toml"])
    if not path.is_file():
        raise InputError(f"cluster file {text!r} does not exist; accepted: a cluster .toml path or one of "
                         f"{', '.join(cluster_names()) or 'none shipped'}")
    return path


def _number(data: dict, key: str, where: str, prov: dict) -> float | None:
    if key not in data:
        return None
    entry = data[key]
    if isinstance(entry, dict):
        bad = sorted(set(entry) - {"value", "source"})
        if bad or "value" not in entry:
            raise InputError(f"{where}: {key} must be a number or {{ value = ..., source = \"...\" }}, got "
                             f"{entry!r}")
        value, src = entry["value"], str(entry.get("source", "no source given"))
    else:
        value, src = entry, "no source given"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                          and value > 0):
        raise InputError(f"{where}: {key} must be a finite number > 0, got {value!r}")
    if key in _INTS and (not isinstance(value, int) or value > MAX_GPUS_PER_NODE):
        raise InputError(f"{where}: {key} must be an integer in [1, {MAX_GPUS_PER_NODE}], got {value!r}")
    if key == "inter_efficiency" and value > 1:
        raise InputError(f"{where}: inter_efficiency must be in (0, 1] (achieved / line rate), got {value!r}")
    prov[key] = f"{src} (cluster file {Path(where).name})"
    return value


def read_cluster(name_or_path: str | Path) -> dict:
    """The checked contents of a cluster file: name, description, source, gpu, the numbers and their
    provenance (`provenance`: key -> source line). Raises InputError for anything not accepted."""
    path = cluster_path(name_or_path)
    where = str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{where}: malformed TOML: {e}") from None
    unknown = [k for k in data if k not in TOP_KEYS]
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(TOP_KEYS)}")
    for key in ("source", "gpu", *(k for k in _NUMBERS if k != "inter_efficiency")):
        if key not in data:
            raise InputError(f"{where}: missing key {key!r}; required: source, gpu, "
                             + ", ".join(k for k in _NUMBERS if k != "inter_efficiency"))
    if data["source"] not in SOURCES:
        raise choice_error(f"source in {where}", data["source"], SOURCES)
    for key in ("name", "description", "gpu"):
        if key in data and (not isinstance(data[key], str) or not data[key].strip()):
            raise InputError(f"{where}: {key} must be a non-empty string, got {data[key]!r}")
    prov: dict[str, str] = {}
    nums = {k: _number(data, k, where, prov) for k in _NUMBERS}
    nics, rails = nums["nics_per_node"], nums["rails"]
    if rails > nics or nics % rails:
        raise InputError(f"{where}: rails must divide nics_per_node ({nics}) and be at most it, got {rails}; "
                         "accepted: 1 (every NIC on one network) up to nics_per_node (one rail per NIC)")
    return {"name": str(data.get("name", path.stem)), "description": str(data.get("description", "")),
            "source": data["source"], "gpu": data["gpu"], "path": where, "provenance": prov, **nums}


def load_cluster(name_or_path: str | Path, gpu: str | Path | Profile | None = None) -> Profile:
    """The hardware profile a cluster file describes (see the module docstring); `gpu` replaces the file's
    GPU profile (the file's node size, NVLink and NICs still apply)."""
    c = read_cluster(name_or_path)
    base = gpu if isinstance(gpu, Profile) else load_profile(gpu if gpu is not None else c["gpu"])
    where = c["path"]
    if base.cpu_cores > 0 or base.nvlink_Bps <= 0:
        raise InputError(f"{where}: gpu profile {base.name!r} is a CPU profile; a cluster file places GPUs "
                         "in nodes (accepted: a GPU profile such as a800, h100, h200)")
    prov = dict(base.provenance)
    cp = c["provenance"]
    nvlink = c["nvlink_GBps"] * 1e9
    scale = nvlink / base.nvlink_Bps
    net = base.network
    net = replace(net, curves={k: v.scaled(scale) for k, v in net.curves.items()},
                  nic_Bps_per_node=c["nics_per_node"] * c["nic_gbps"] * 1e9 / 8,
                  inter_efficiency=c["inter_efficiency"] or net.inter_efficiency)
    shape = prov.get("curve_from") or "; ".join(v for k, v in sorted(prov.items())
                                                if k.startswith("network.points"))
    prov["curve_from"] = (f"profile {base.name}'s intra-node busbw curve x {scale:.4g} = NVLink "
                          f"{c['nvlink_GBps']:g} / {base.nvlink_Bps / 1e9:g} GB/s per direction "
                          f"({cp['nvlink_GBps']}); curve: {shape[:200]}")
    prov["nvlink_GBps"] = cp["nvlink_GBps"]
    prov["nic_gbps_per_node"] = (f"{c['nics_per_node']} NICs x {c['nic_gbps']:g} Gb/s "
                                 f"({cp['nics_per_node']}; {cp['nic_gbps']})")
    if "inter_efficiency" in cp:
        prov["inter_efficiency"] = cp["inter_efficiency"]
    prov["gpus_per_node"] = cp["gpus_per_node"]
    prov["rails"] = (f"{c['rails']} rails ({cp['rails']}); recorded, no time effect: the collective model "
                     "assumes a non-blocking rail-optimized fabric")
    desc = (f"cluster {c['name']} ({c['source']}): {c['gpus_per_node']} GPUs per node, NVLink "
            f"{c['nvlink_GBps']:g} GB/s, {c['nics_per_node']} x {c['nic_gbps']:g} Gb/s NICs on {c['rails']} "
            f"rail(s); GPU profile {base.name}" + (f" ({base.gpu})" if base.gpu else "")
            + (f"; {c['description']}" if c["description"] else ""))
    return replace(base, name=c["name"], description=desc, gpus_per_node=c["gpus_per_node"],
                   nvlink_Bps=nvlink, network=net, provenance=prov)


__all__ = ["CLUSTERS_DIR", "SOURCES", "cluster_names", "load_cluster", "read_cluster"]
