"""Error bands and sensitivity: how far a simulated number moves over the uncertain inputs of its profile.

The uncertain inputs and their ranges are the profile's `[uncertainty]` table, one entry per input, each
with its source (simulator.fabric.hardware reads it):

    [uncertainty]
    nic_gbps_per_node = { low = 800, high = 1600, source = "..." }   absolute low / high
    fwd_tflops = { rel = 0.063, source = "..." }                     value x (1 -+ rel)

Inputs (`INPUTS`): nic_gbps_per_node, inter_efficiency (the network), curve_scale (the intra-node busbw
curve: collective efficiency), nccl_channels, overlap_slowdown (overlap penalties), fwd_tflops,
bwd_tflops (the compute fit's residuals). One-at-a-time: the configuration is simulated with each input
at its low and at its high end, the others at the profile's value (`sensitivity`: one row per input,
ranked by swing); the band (`bands`) combines the deviations in quadrature (independent inputs, locally
linear): low = base - sqrt(sum of squared drops), high = base + sqrt(sum of squared rises). 2 x inputs + 1
simulations per configuration.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

from dmuon.errors import InputError, choice_error

from simulator.fabric.hardware import UNCERTAIN_INPUTS as INPUTS


def _apply(profile, name: str, value: float):
    """The profile with one input set to `value` (the input's unit as in the profile file)."""
    net = profile.network
    if name == "nic_gbps_per_node":
        return profile.with_nic_gbps(value)
    if name == "inter_efficiency":
        return replace(profile, network=replace(net, inter_efficiency=min(1.0, value)))
    if name == "curve_scale":  # a factor on the intra-node busbw curves
        curves = {k: c.scaled(value) for k, c in net.curves.items()}
        return replace(profile, network=replace(net, curves=curves))
    if name == "nccl_channels":
        return replace(profile, nccl_channels=max(0, int(round(value))))
    if name == "overlap_slowdown":
        return profile.with_overlap_slowdown(value)
    if name == "fwd_tflops":
        return replace(profile, fwd_flops=value * 1e12)
    if name == "bwd_tflops":
        return replace(profile, bwd_flops=value * 1e12)
    raise choice_error("uncertain input", name, INPUTS)


def _current(profile, name: str) -> float:
    return {"nic_gbps_per_node": profile.network.nic_Bps_per_node * 8 / 1e9,
            "inter_efficiency": profile.network.inter_efficiency, "curve_scale": 1.0,
            "nccl_channels": float(profile.nccl_channels), "overlap_slowdown": profile.overlap_slowdown,
            "fwd_tflops": profile.fwd_flops / 1e12, "bwd_tflops": profile.bwd_flops / 1e12}[name]


def ranges(profile) -> list[tuple[str, float, float, str]]:
    """(input, low, high, source) for every input the profile's [uncertainty] table names."""
    out = []
    for name, entry in profile.uncertainty.items():
        now = _current(profile, name)
        if "rel" in entry:
            lo, hi = now * (1 - entry["rel"]), now * (1 + entry["rel"])
        else:
            lo, hi = entry["low"], entry["high"]
        out.append((name, lo, hi, entry["source"]))
    return out


def _output_of(result, output: str) -> float:
    return float(getattr(result, output))


def check_output(output: str) -> None:
    from simulator.api import SimResult

    numeric = [f.name for f in fields(SimResult) if f.type in ("float", float)]
    if output not in numeric:
        raise choice_error("output", output, numeric)


def sensitivity(cfg, output: str = "step_s") -> tuple[float, list[dict]]:
    """(base value, one row per uncertain input: low / high value of `output` at the input's ends, swing),
    rows ranked by swing (largest first)."""
    from simulator.api import profile_of, simulate

    check_output(output)
    profile = profile_of(cfg)
    rs = ranges(profile)
    if not rs:
        raise InputError(f"profile {profile.name!r} has no [uncertainty] table: nothing to vary; accepted: a "
                         "profile naming ranges for " + ", ".join(INPUTS))
    base_cfg = replace(cfg, gpu=profile, cluster=None, nic_gbps=None, overlap_slowdown=None)
    base = _output_of(simulate(base_cfg), output)
    rows = []
    for name, lo, hi, src in rs:
        at = {end: _output_of(simulate(replace(base_cfg, gpu=_apply(profile, name, v))), output)
              for end, v in (("low", lo), ("high", hi))}
        rows.append({"input": name, "input_low": lo, "input_high": hi, "input_now": _current(profile, name),
                     "output": output, "base": base, "at_low": at["low"], "at_high": at["high"],
                     "swing": abs(at["high"] - at["low"]), "source": src})
    rows.sort(key=lambda r: -r["swing"])
    return base, rows


def bands(cfg, output: str = "step_s") -> dict:
    """{output, base, low, high, inputs}: the band of `output` over the profile's uncertain inputs."""
    base, rows = sensitivity(cfg, output)
    down = math.sqrt(sum(max(0.0, base - min(r["at_low"], r["at_high"])) ** 2 for r in rows))
    up = math.sqrt(sum(max(0.0, max(r["at_low"], r["at_high"]) - base) ** 2 for r in rows))
    return {"output": output, "base": base, "low": base - down, "high": base + up,
            "inputs": [r["input"] for r in rows]}
