"""DMuon's two schedules side by side at one configuration: ours and the public implementation's
(`system="published"`, simulator.programs.step_published), beside AdamW, and what each published mechanism
costs there: the published step less the published step with that one mechanism off (positive: the public
code pays it, so our schedule's change saves it). Used by `harness simulate --system ours,published` and
scripts/published_vs_ours.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .api import SimConfig, SimResult, simulate
from .programs.step_published import MECHANISMS, OPT_IN, published_mechanisms


@dataclass(frozen=True)
class SystemComparison:
    adamw: SimResult
    ours: SimResult
    published: SimResult
    mechanism_s: dict  # mechanism -> seconds of the published step it costs (published less it off)

    def overhead_pct(self, system: str) -> float:
        """DMuon's step over AdamW's, in percent, under `system`."""
        return (getattr(self, system).step_s / self.adamw.step_s - 1) * 100

    def points(self) -> dict:
        """Each mechanism's cost in points of the AdamW step."""
        return {m: s / self.adamw.step_s * 100 for m, s in self.mechanism_s.items()}


def compare_systems(cfg: SimConfig, adamw: SimResult | None = None) -> SystemComparison:
    """Simulate `cfg` as AdamW, as DMuon with our schedule and as DMuon with the published one (with
    `cfg.published_off` / `published_on` applied to the latter), then once per mechanism the published run
    uses with that mechanism off (an opt-in mode: without it). `adamw`: AdamW's result at the same settings
    where the caller has it already."""
    published_mechanisms("published", cfg.published_off, cfg.published_on)  # bad switch names: InputError
    base = replace(cfg, strategy="dmuon", system="ours", published_off=(), published_on=())
    pub_cfg = replace(base, system="published", published_off=tuple(cfg.published_off),
                      published_on=tuple(cfg.published_on))
    if adamw is None:
        adamw = simulate(replace(base, strategy="adamw"))
    ours, published = simulate(base), simulate(pub_cfg)
    costs = {}
    for m in MECHANISMS:
        if m not in pub_cfg.published_off:
            off = simulate(replace(pub_cfg, published_off=(*pub_cfg.published_off, m)))
            costs[m] = published.step_s - off.step_s
    for m in OPT_IN:
        if m in pub_cfg.published_on:
            off = simulate(replace(pub_cfg, published_on=tuple(x for x in pub_cfg.published_on if x != m)))
            costs[m] = published.step_s - off.step_s
    return SystemComparison(adamw, ours, published, costs)
