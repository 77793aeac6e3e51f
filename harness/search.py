"""`run_search`: the fastest layouts of a search space (harness.search_space), simulated cheapest bound first,
stored like a sweep (harness.store, harness.executors: resumable, local or Ray).

  1. enumerate: every valid layout (harness.search_space; the dropped ones keep the rule that dropped them)
  2. fit: the memory model's peak per GPU (`simulator.api.memory_of`, where this simulator has it) against
     the profile's capacity; a layout over it is dropped ("needs X GiB > Y GiB")
  3. bound: a lower bound of each layout's step time from the simulator's own inputs, without simulating:
     its compute-stream work, which no schedule can shorten: the forward and backward compute of every
     layer (simulator.setup.make_spec's layer times, the ones the step program runs) over tp x pp ranks,
     x the micro-batches per step, and for naive Muon every rank's Newton-Schulz of every matrix (its
     `ns_naive_s`). The step also holds communication, bubbles and the optimizer, so it is never shorter
     (checked on every simulated row: a row below its bound is counted in `bound_violations`).
  4. simulate in bound order; a layout is pruned (not simulated) when its bound is >= the `top`-th best
     step time of its strategy so far (and, with `front`, a simulated layout of that strategy is as fast
     as the bound with no more memory). These tests hold for whatever the layout would have simulated, so
     the ranked table (the `top` best per strategy), and with `front` the step-time / memory Pareto front,
     are those of the brute-force sweep of the whole space (tests/test_search.py checks it on a small
     space).

Output folder: results.csv, config.json, provenance.json (the simulated rows, exactly as `harness run`
writes them: journal while running, resume by run_id and code version), layouts.csv (every layout and
what became of it: simulated / pruned / no-fit / dropped, with its reason, bound and memory), and
pareto.png / pareto.pdf (harness.cmd_search draws them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from .executors import make_executor
from .experiment import Experiment, Grid, run_id
from .provenance import code_version, write_provenance
from .runners import get_runner
from .search_space import LAYOUT_KEYS, Space, enumerate_layouts
from .store import ResultStore, write_text_atomic

LAYOUTS_CSV = "layouts.csv"
SIM_ONLY = ("dp", "global_batch")  # row columns that are not SimConfig fields


@dataclass
class SearchSummary:
    out_dir: Path
    rows: list[dict]  # simulated rows (settings + metrics + bound_s, mem_gib), best first
    layouts: list[dict]  # every enumerated layout with status / reason / bound_s / mem_gib / step_s
    enumerated: int
    dropped: int
    unfit: int
    pruned: int
    simulated: int  # simulated in this run
    reused: int  # taken from results.csv / the journal (resume)
    bound_violations: int
    wall_s: float
    memory_modelled: bool
    front: bool = False  # the Pareto front is exact (pruning kept every layout that may be on it)
    refused: int = 0  # layouts the simulator refused when it ran them (layouts.csv: its message)
    notes: list[str] = field(default_factory=list)

    def best(self, strategy: str) -> dict | None:
        return next((r for r in self.rows if r["strategy"] == strategy), None)


# ---- bounds and memory -----------------------------------------------------------------------------
def _sim_config(row: dict, **changes):
    from simulator.api import SimConfig

    names = {f.name for f in fields(SimConfig)}
    return SimConfig(**{**{k: v for k, v in row.items() if k in names}, **changes})


class Bounds:
    """Lower bounds of step times (module docstring, step 3), from the simulator's own inputs.

    Per pipeline stage s (simulator.programs.parallel.stage_layers; pp = 1: one stage, the whole model) and
    micro-batch: F_s, B_s = the forward / backward compute of its layers at full width / tp (a TP shard's
    time, FLOPs / tp + the per-layer overhead, is never less), plus the TP collectives every block has on
    the critical path (simulator.programs.parallel.tp_layer_comm), plus full recomputation's forward again. Stage s
    cannot start before micro-batch 1 has run the chunks before it (its round-0 chunks 0..s-1, forward)
    and its last backward of its round-0 chunk is followed by those chunks' backward, so the step is at
    least  fill_s + m (F_s + B_s) + drain_s  (+ naive: the stage's NS of its matrices, every rank all of
    them, after its last backward), maximised over the stages. Sends, DP communication, bubbles beyond the
    fill / drain and the optimizer's other work only add to it."""

    def __init__(self):
        self._cache: dict[str, tuple] = {}
        self._chunks: dict = {}  # (id(workload), pp, vpp) -> stage_layers; id(workload) -> its block layers

    def _layers(self, row: dict):
        """(per-layer forward s, backward s, naive NS s (None: not known per layer), workload, profile)."""
        key = json.dumps({k: v for k, v in sorted(row.items()) if k in _COMPUTE_KEYS}, default=str)
        if key not in self._cache:
            from simulator.api import node_shape, profile_of
            from simulator.costs import load_cost, thread_cost_for
            from simulator.setup import make_spec
            from simulator.models.workload import resolve_workload

            plain = {k: v for k, v in (("tp", 1), ("pp", 1), ("vpp", 1), ("sp", False), ("microbatches", None),
                                      ("recompute", "none")) if k in row}
            cfg = _sim_config(row, strategy="naive", layout="ddp", **plain)  # no plan: naive NS per rank
            profile = profile_of(cfg)
            per_node = node_shape(cfg.gpus, cfg.gpus_per_node or profile.gpus_per_node)[1]
            wl = resolve_workload(cfg.workload, cfg.model, cfg.per_head)
            spec, info = make_spec(cfg, wl, profile, load_cost(profile.cost_profiles), per_node,
                                   thread_cost_for(profile, cfg))
            if cfg.ep > 1:  # naive NS of the rank's own experts only: known for the whole model
                ns = None
                total = info["ns_makespan_s"]
            else:
                ns = [sum(spec.ns_naive_s[i] for i in idx) for idx in spec.layer_muon]
                total = sum(ns)
            self._cache[key] = (list(spec.layer_fwd_s), list(spec.layer_bwd_s), ns, total, wl, profile,
                                per_node)
        return self._cache[key]

    def __call__(self, row: dict) -> float:
        fwd, bwd, ns, ns_total, wl, profile, per_node = self._layers(row)
        tp, pp, vpp = int(row.get("tp", 1)), int(row.get("pp", 1)), int(row.get("vpp", 1))
        m = int(row.get("microbatches") or 1)
        naive = row["strategy"] == "naive"
        tp_f = tp_b = 0.0
        if tp > 1:
            from simulator.programs.parallel import Layout, hidden_of, tp_layer_comm
            from simulator.programs.step import DTYPE_BYTES

            lay = Layout(tp, pp, vpp, int(row["dp"]), m, bool(row.get("sp")), row.get("recompute", "none"),
                         per_node)
            net = profile.network_for(per_node, 1.0)
            tokens = int(row["micro_batch"]) * int(row["seq_len"])
            args = (lay, tokens, hidden_of(wl), DTYPE_BYTES[profile.dtype], net)
            tp_f, tp_b = tp_layer_comm(*args, backward=False)[0], tp_layer_comm(*args, backward=True)[0]
        full = row.get("recompute", "none") == "full"
        # per workload (held by self._cache: its id stays its own) and schedule, built once
        chunks = self._chunks.get((id(wl), pp, vpp))
        if chunks is None:
            from simulator.programs.parallel import stage_layers

            chunks = self._chunks[id(wl), pp, vpp] = ([[list(range(len(fwd)))]] if pp == 1
                                                      else stage_layers(wl, pp, vpp))
        blocks = self._chunks.get(id(wl))
        if blocks is None:
            blocks = self._chunks[id(wl)] = {i for i, ps in enumerate(wl.layer_params())
                                             if any(p.block is not None for p in ps)}

        def fb(layers) -> tuple[float, float]:
            f = sum(fwd[i] for i in layers) / tp + tp_f * sum(i in blocks for i in layers)
            b = sum(bwd[i] for i in layers) / tp + tp_b * sum(i in blocks for i in layers)
            return f, b + (sum(fwd[i] for i in layers) / tp if full else 0.0)

        round0 = [fb(chunks[s][0]) for s in range(pp)]
        best = 0.0
        for s in range(pp):
            f, b = map(sum, zip(*(fb(c) for c in chunks[s]), strict=True))
            fill = sum(x[0] + x[1] for x in round0[:s])
            stage_ns = 0.0
            if naive:
                if ns is None:  # ep: only the whole model's total is known (a stage's share: not bounded)
                    stage_ns = ns_total if pp == 1 else 0.0
                else:
                    stage_ns = sum(ns[i] for c in chunks[s] for i in c)
            best = max(best, fill + m * (f + b) + stage_ns)
        return best


_PROFILE_KEYS = ("gpu", "cluster", "nic_gbps", "overlap_slowdown", "gpus_per_node")
_COMPUTE_KEYS = ("workload", "model", "per_head", "gpu", "cluster", "gpus", "gpus_per_node", "seq_len",
                 "micro_batch", "ep", "naive_ns_method", "naive_batching", "ns_dtype", "speed_scale",
                 "ns_speed_scale", "elementwise_speed_scale", "cpu_threads", "symmetric_kernels", "nic_gbps",
                 "overlap_slowdown")


def default_memory() -> Callable[[dict], float] | None:
    """The simulator's memory model as `row -> peak GiB per GPU`, or None where this simulator has none."""
    try:
        from simulator.api import memory_of
    except ImportError:
        return None

    profiles: dict[str, object] = {}  # the profile resolved once per GPU kind (not a TOML read per row)

    def peak(row: dict) -> float:
        from simulator.api import profile_of

        key = json.dumps([row.get(k) for k in _PROFILE_KEYS], default=str)
        if key not in profiles:
            profiles[key] = profile_of(_sim_config(row))
        plain = {k: None for k in _PROFILE_KEYS if k not in ("gpu", "gpus_per_node")}
        return float(memory_of(_sim_config(row, gpu=profiles[key], **plain)).peak_gib)

    return peak


def default_capacity(row: dict) -> float | None:
    """The profile's memory per GPU (GiB), where the profile states one (memory_gib 0: not stated)."""
    from simulator.api import profile_of

    return getattr(profile_of(_sim_config(row)), "memory_gib", 0.0) or None


# ---- the search ------------------------------------------------------------------------------------
def _experiment(space: Space, out_dir: Path, command: str | None) -> Experiment:
    """The search as an Experiment (provenance.json and config.json name it like any sweep)."""
    fixed = {**space.fixed, "gpus": space.gpus, "seq_len": space.seq_len, "global_batch": space.global_batch}
    axes = {k: list(v) for k, v in (("strategy", space.strategies), ("layout", space.layouts),
                                    ("tp", space.tp), ("sp", space.sp), ("pp", space.pp),
                                    ("vpp", space.vpp), ("ep", space.ep), ("micro_batch", space.micro_batch),
                                    ("recompute", space.recompute)) if v}
    return Experiment(name="search", path=out_dir / "config.json", description=command or "harness search",
                      runner="simulate", figures=[], fixed=fixed, grids=[Grid("", {}, axes)], variants={},
                      traces=[])


def _prunable(c: dict, kth: list[float], sims: list[dict], top: int, front: bool) -> str | None:
    """Why layout c cannot enter its strategy's top `top` (and, with `front`, its Pareto front); None: it
    may."""
    b = c["bound_s"]
    if len(kth) < top or b < kth[top - 1]:
        return None
    if not front:
        return f"bound {b * 1e3:.1f} ms >= top-{top} {kth[top - 1] * 1e3:.1f} ms"
    for x in sims:
        if x["strategy"] == c["strategy"] and x["step_s"] <= b and (
                c.get("mem_gib") is None or x.get("mem_gib") is None or x["mem_gib"] <= c["mem_gib"]):
            return (f"bound {b * 1e3:.1f} ms >= top-{top} {kth[top - 1] * 1e3:.1f} ms; dominated by "
                    f"{x['run_id']} ({x['step_s'] * 1e3:.1f} ms)")
    return None


def run_search(space: Space, out_dir: Path, *, top: int = 5, front: bool = False, executor: str = "local",
               address: str | None = None, jobs: int | None = 1, resume: bool = True,
               memory: Callable[[dict], float] | None | str = "model",
               capacity: Callable[[dict], float | None] = default_capacity,
               progress: Callable[[int, int, str], None] | None = None,
               command: str | None = None) -> SearchSummary:
    """Search `space`; write out_dir (module docstring). front: prune only what can enter neither the
    top `top` nor the Pareto front (else: only the top). memory: `row -> GiB` ("model": the simulator's
    memory model where it has one; None: memory not modelled, nothing dropped for it)."""
    from dmuon.errors import InputError

    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InputError(f"top must be an integer >= 1 (layouts per strategy in the table), got {top!r}")
    runner = get_runner("simulate")
    execu = make_executor(executor, address=address, jobs=jobs)  # checked before anything is touched
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    kept, dropped = enumerate_layouts(space)
    notes: list[str] = []
    mem_fn = default_memory() if memory == "model" else memory
    if mem_fn is None:
        notes.append("memory not modelled by this simulator: no layout dropped for memory")
    layouts: list[dict] = [{**p, "status": "dropped", "reason": why} for p, why in dropped]
    bounds = Bounds()
    caps: dict[str, float | None] = {}  # capacity per GPU kind
    cands: list[dict] = []
    for row in kept:
        rid = run_id(row)
        info = {"run_id": rid, "bound_s": bounds(row), "mem_gib": mem_fn(row) if mem_fn else None}
        ck = json.dumps([row.get(k) for k in ("gpu", "cluster", "gpus_per_node")], default=str)
        if mem_fn and ck not in caps:
            caps[ck] = capacity(row)
        cap = caps.get(ck)
        if info["mem_gib"] is not None and cap is not None and info["mem_gib"] > cap:
            layouts.append({**row, **info, "status": "no-fit",
                            "reason": f"needs {info['mem_gib']:.1f} GiB > {cap:g} GiB per GPU"})
            continue
        cands.append({**row, **info})
    cands.sort(key=lambda c: (c["bound_s"], c["run_id"]))

    store = ResultStore(out_dir)
    if not resume:
        for p in (store.journal, store.csv):
            if p.exists():
                p.unlink()
    code = code_version()
    stored = {str(r["run_id"]): r for r in store.read_rows()
              if str(r.get("code")) == code and r.get("run_id") not in (None, "")}
    exp = _experiment(space, out_dir, command)
    columns = [*dict.fromkeys(k for c in kept for k in c), "run_id"]
    execu.prepare([[c] for c in cands if c["run_id"] not in stored])
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "config.json", json.dumps(
        {**exp.to_dict(), "rows": len(cands), "columns": columns, "top": top}, indent=1, default=str) + "\n")

    sims: list[dict] = []
    best: dict[str, list[float]] = {}
    state = {"ran": 0, "reused": 0, "pruned": 0}
    extra = {c["run_id"]: {"bound_s": c["bound_s"], "mem_gib": c["mem_gib"]} for c in cands}

    def take(r: dict) -> None:
        r = {**r, **extra[str(r["run_id"])]}
        sims.append(r)
        best.setdefault(r["strategy"], []).append(float(r["step_s"]))
        best[r["strategy"]].sort()

    def record(rows: list[dict]) -> None:
        rows = [{**r, "code": code} for r in rows]
        store.append(rows)
        for r in rows:
            take(r)
        state["ran"] += len(rows)
        if progress:
            progress(len(sims) + state["pruned"], len(cands), runner.label(rows[-1]) if rows else "")

    batch_size = max(1, execu.requested or 1)
    status: dict[str, str] = {}  # run_id -> why it was not simulated (pruned, or refused by the simulator)
    refused: set[str] = set()
    ctx = {"out_dir": str(out_dir.resolve()), "traces": []}

    def run_batch(batch: list[dict]) -> None:
        """Simulate `batch`; a layout the simulator refuses when it runs it is kept out with its message."""
        try:
            execu.run(runner, [[b] for b in batch], ctx, record)
        except InputError as e:
            done = {str(r["run_id"]) for r in sims}
            left = [b for b in batch if b["run_id"] not in done]
            if len(left) == 1:
                status[left[0]["run_id"]] = f"simulator: {e}"
                refused.add(left[0]["run_id"])
            else:  # which one failed is not known: one at a time
                for b in left:
                    run_batch([b])
    try:
        i = 0
        while i < len(cands):
            batch = []
            while i < len(cands) and len(batch) < batch_size:
                c = cands[i]
                i += 1
                if c["run_id"] in stored:  # simulated before (resume): kept, whatever the pruning says
                    take(stored[c["run_id"]])
                    state["reused"] += 1
                    continue
                why = _prunable(c, best.get(c["strategy"], []), sims, top, front)
                if why:
                    status[c["run_id"]] = why
                    state["pruned"] += 1
                else:
                    batch.append({k: v for k, v in c.items() if k not in ("bound_s", "mem_gib", "run_id")}
                                 | {"run_id": c["run_id"]})
            run_batch(batch)
    finally:
        try:
            order = [c["run_id"] for c in cands if c["run_id"] not in status]  # simulated rows
            store.finalize(order, columns)
        finally:
            execu.close()
    wall = time.perf_counter() - t0
    sims.sort(key=lambda r: (float(r["step_s"]), str(r["run_id"])))
    violations = sum(1 for r in sims if float(r["step_s"]) < r["bound_s"] * (1 - 1e-9))
    if violations:
        notes.append(f"{violations} simulated layouts ran below their lower bound: pruning may be unsound")
    by_id = {str(r["run_id"]): r for r in sims}
    for c in cands:
        r = by_id.get(c["run_id"])
        st = "simulated" if r else ("refused" if c["run_id"] in refused else "pruned")
        layouts.append({**c, "status": st, "reason": status.get(c["run_id"], ""),
                        "step_s": float(r["step_s"]) if r else None})
    _write_layouts(out_dir / LAYOUTS_CSV, layouts)
    write_provenance(out_dir, exp, store.read_rows(), kind=runner.kind, wall_s=wall, jobs=execu.jobs,
                     command=command, command_line=command, **execu.describe(), rows_run=state["ran"],
                     rows_skipped=state["reused"])
    return SearchSummary(out_dir=out_dir, rows=sims, layouts=layouts, enumerated=len(kept) + len(dropped),
                         dropped=len(dropped), unfit=len(kept) - len(cands), pruned=state["pruned"],
                         simulated=state["ran"], reused=state["reused"], bound_violations=violations,
                         wall_s=wall, front=front, refused=len(refused), memory_modelled=mem_fn is not None, notes=notes)


def _write_layouts(path: Path, layouts: list[dict]) -> None:
    import pandas as pd

    from dmuon.io import atomic_path

    lead = [k for k in LAYOUT_KEYS if any(k in r for r in layouts)]
    cols = [*lead, "status", "reason", "bound_s", "mem_gib", "step_s", "run_id"]
    df = pd.DataFrame(layouts)
    df = df[[c for c in cols if c in df.columns]]
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


__all__ = ["Bounds", "LAYOUTS_CSV", "SearchSummary", "default_capacity", "default_memory", "run_search"]
