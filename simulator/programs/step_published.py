"""`SimConfig.system = "published"`: the public implementation's schedule (X-Square-Robot/dmuon), one switch
per mechanism, beside ours (docs/simulator.md, "The published implementation's schedule beside ours": the
item numbers below are that section's).

`MECHANISMS` are on by default under `system="published"` (`SimConfig.published_off` turns any of them
off); `OPT_IN` are public modes that are not the published runs' defaults (`SimConfig.published_on`).
Each is a change to one place of the step programs, guarded by its name, so `system="ours"` builds the
same programs as before bit for bit, and `published` with every switch off builds ours too
(tests/test_sim_published.py). Mixed into `simulator.programs.step._Programs`.
"""

from __future__ import annotations

from collections import Counter

from dmuon.errors import InputError

from simulator.engine.engine import Op
from .published_partition import owner_slots, published_plan

# name -> (item, public code it models): what each switch turns on
MECHANISMS = {
    "ns_per_matrix": "16: one NS call per owned matrix (muon.py `_step_muon_params`: `self._ns.local` per "
                     "matrix), i.e. the plan's batches of one",
    "opt_order": "5: every group's NS waits for its full reduce, walked in forward order, so no NS starts "
                 "before the last group's (layer 0's) reduce (`_step_muon_and_dispatch_groups_async`, "
                 "`wait_group_muon_grads`, HSDP `delay_stage2_to_optimizer=True`)",
    "drain": "6: the backward waits the previous group's stage-1 reduce before the next group's reduce is "
             "dispatched (`DedicatedState._run_post_backward`, group.py `wait_for_stage1_reduce`)",
    "flat_exchange": "4, 12: FSDP's owner reduce and broadcast over the 1-D shard group, i.e. flat over "
                     "every rank (`DedicatedParamGroup.reduce_grads`, `unshard`), not two-level",
    "coalesce": "12: a layer's per-owner reduces / broadcasts as one `dist._coalescing_manager` group: the "
                "launch latency once per layer, each owner's ring steps still paid "
                "(`collective_time_s(coalesced=True)`)",
    "hsdp_stages": "4, 7: HSDP reduce in two stages (shard group in the node, then `_launch_stage2_replicate_"
                   "reduce` across replicas) and publication as a post-step replicate broadcast of the owned "
                   "matrix across nodes (`replicate_broadcast_async`) plus an in-node broadcast in every "
                   "forward (and, Z3, backward) `unshard`; ours: one two-level exchange over every rank",
    "master_fp32": "7: the replicate broadcast carries the fp32 master (`master_dtype=torch.float32`), "
                   "4 bytes per element (HSDP only)",
    "owner_cost": "1-3: the NS placement is the public partition's (`compute_balanced_assignment`: LPT of "
                  "`_matrix_optimizer_cost_units` over (shard, replicate) slots, same-layer spreading), not "
                  "build_plan's: each allocation unit's owner runs its matrices' NS "
                  "(simulator.programs.published_partition); FSDP / HSDP layouts",
    "pack_small": "2, 3: a layer's broadcasts over the shard group one per owner of the public partition's "
                  "allocation units (`unshard`, `_by_owner`'s packed buffers: each matrix of at least 5 M "
                  "elements its own unit on its own slot, `used_slots`; those below merged into one, "
                  "`pack_small_params`, `SMALL_PARAM_THRESHOLD`); with `owner_cost` the merged unit's "
                  "matrices have one owner",
    "param_collectives": "4, 7: group.py's reduces one per parameter (`reduce_grads` stage 1 over the shard "
                         "group, `_launch_stage2_replicate_reduce` across nodes) and HSDP's replicate "
                         "broadcast one per parameter of the shard column (`replicate_broadcast_async`), "
                         "not one per owner",
    "fwd_prefetch": "9: the next group's publication is prefetched at depth 1 on the broadcast stream: "
                    "issued from layer l's pre-forward hook (`unshard(prefetch=True)`, the cap "
                    "`forward_prefetch_depth` has while HSDP publications are pending), so it starts once "
                    "layer l - 1's compute is done, not as soon as its update is",
    "adamw_unfused": "14: DMuon's AdamW as a Python loop of 9 eager kernels per non-Muon tensor (norms, "
                     "biases, embeddings; `_step_adamw_params` -> `_adamw_update_tensor`), host-bound at one "
                     "launch per `EAGER_OP_S` past the stream's launch queue (programs.published_host)",
    "ns_eager": "15-17: momentum, Gram NS and update eager per owned matrix (`_step_muon_params`, "
                "`gram_newton_schulz_local`: 33 launches with bf16 gradients; no CUDA-graph replay at the "
                "run set's date), on the same host loop (simulator.programs.published_host)",
}
OPT_IN = {
    "prefetch_wait": "9: the stored state.py's `_pre_forward` -> `self._next_group.unshard()` without "
                     "prefetch=True: layer l's compute waits for layer l + 1's publication on the compute "
                     "stream (a stall in every layer; which state.py the published runs used is not stored)",
    "sync_publish": "11: `replicate_async=False`: every group's publication dispatched and waited in one "
                    "post-step phase (`broadcast_all_updates`): the next forward starts after all of them",
}
SYSTEMS = ("ours", "published")


def published_mechanisms(system: str, off=(), on=()) -> frozenset:
    """The mechanisms a config runs: none for "ours"; `MECHANISMS` less `off`, plus `on`, for "published".
    Raises InputError on an unknown system or switch name, or switches given with system "ours"."""
    if system not in SYSTEMS:
        raise InputError(f"unknown system {system!r}; accepted: {', '.join(SYSTEMS)}")
    for what, names, known in (("published_off", off, MECHANISMS), ("published_on", on, OPT_IN)):
        if isinstance(names, str) or not isinstance(names, (tuple, list, frozenset, set)):
            raise InputError(f"{what} must be a list of switch names, got {names!r}")
        bad = [n for n in names if n not in known]
        if bad:
            raise InputError(f"unknown {what} switch {bad[0]!r}; accepted: {', '.join(known)}")
        if names and system != "published":
            raise InputError(f"{what} applies to system 'published' only; accepted: system='published', or "
                             f"no {what}")
    if system == "ours":
        return frozenset()
    return frozenset(set(MECHANISMS) - set(off) | set(on))


def published_plan_of(cfg, published: frozenset, matrices, per_node: int, cost, method: str, dtype: str,
                      orientation):
    """`owner_cost`: the Plan of the public partition on cfg's FSDP (shard = every rank) or HSDP (shard = a
    node's ranks, replicate = the nodes) mesh; None where build_plan's plan stands (the switch off, ddp,
    sharded)."""
    if "owner_cost" not in published or cfg.layout in ("ddp", "sharded"):
        return None
    if cfg.max_split > 1:
        raise InputError("system 'published' places whole matrices as the public partition does (owner_cost); "
                         "accepted: max_split=1, or published_off=('owner_cost',)")
    shard = per_node if cfg.layout.startswith("hsdp") else cfg.gpus
    return published_plan(matrices, shard, cfg.gpus // shard, cost, method=method, dtype=dtype,
                          max_batch=1 if "ns_per_matrix" in published else cfg.max_batch,
                          bucket_numel=cfg.bucket_numel, orientation=orientation,
                          merge_small="pack_small" in published)


class PublishedPrograms:
    """The published schedule's owner exchange (mixed into `simulator.programs.step._Programs`; `self.pub` is the
    set of mechanisms on, empty for ours)."""

    def _published_active(self) -> bool:
        """Whether this program's owner exchange runs the published path (dmuon on FSDP / HSDP, no EP)."""
        return bool(self.pub) and self.dm and not self.sharded and self.ep == 1 and self.shard is not None

    def _hsdp_stages(self) -> bool:
        return "hsdp_stages" in self.pub and self.shard == "intra"

    def _own_path(self) -> bool:
        """Whether the published owner exchange replaces ours: HSDP in two stages, or FSDP flat or
        coalesced (with neither, the owner exchange is ours)."""
        if not self._published_active():
            return False
        if self.shard == "intra":
            return self._hsdp_stages() or "coalesce" in self.pub
        return "flat_exchange" in self.pub or "coalesce" in self.pub

    def _pub_coll(self, r: int, key: tuple, b: int, kind: str, elem_bytes: int, group: str, step: int,
                  owned: dict):
        """One collective of bucket b's owner exchange over `group` among `owned` ({root: elements}), as the
        public code issues it: per-owner collectives, one launch each or one coalesced group (`coalesce`);
        over every rank of FSDP's 1-D shard group flat (`flat_exchange`) or two-level (ours). None if
        `owned` is empty."""
        if not owned:
            return None
        payload = self.bucket_numel[b] if group != "inter" else sum(owned.values())
        flat = group != "world" or "flat_exchange" in self.pub
        p = self.s.per_node
        per_local = max(Counter(o % p for o in owned).values()) if group == "world" else 1
        roots = self._roots(r, b, kind, group, owned)
        return self.coll(r, key, group, kind, payload * elem_bytes, muon_fraction=1.0,
                         max_share=max(owned.values()) * elem_bytes, step=step, owners=roots,
                         owners_per_local=per_local, flat=flat, coalesced="coalesce" in self.pub)

    def _roots(self, r: int, b: int, kind: str, group: str, owned: dict) -> int:
        """Collectives in one of bucket b's exchanges, as group.py issues them: one per owner in `owned`
        (ours); `param_collectives`: one per parameter for the reduces and the cross-node broadcast (rank
        r's shard column across nodes); `pack_small`: one broadcast per owner coordinate of the partition's
        allocation units over the shard group."""
        plan = self.s.plan
        members = plan.buckets[b].members
        if "param_collectives" in self.pub and group == "inter":
            p = self.s.per_node
            return sum(1 for i in members if plan.owners[i] % p == r % p)
        if "param_collectives" in self.pub and kind == "reduce":
            return len(members)
        if "pack_small" in self.pub and kind == "broadcast" and group != "inter":
            return self._units(b)
        return len(owned)

    def _units(self, b: int) -> int:
        """Owners of bucket b in the public partition (simulator.programs.published_partition, small matrices
        merged): one per allocation unit of its layers while a layer has slots to spread them over."""
        units = self.__dict__.setdefault("_units_of", {})
        if b not in units:
            slots = owner_slots(self.s.plan.matrices, self.shard_size, self.s.n_ranks // self.shard_size)
            units[b] = len({slots[i] for i in self.s.plan.buckets[b].members})
        return units[b]

    def _row_owned(self, b: int) -> dict:
        """{local index: elements} of bucket b's owners: who broadcasts / receives in each node (HSDP)."""
        p = self.s.per_node
        out: dict[int, float] = {}
        for o, k in self.owned[b].items():
            out[o % p] = out.get(o % p, 0) + k
        return out

    def _column_owned(self, b: int, r: int) -> dict:
        """{owner: elements} of bucket b's owners in rank r's shard column (its local index, every node)."""
        p = self.s.per_node
        return {o: k for o, k in self.owned[b].items() if o % p == r % p}

    def _pub_reduce(self, r: int, b: int, step: int, dep: Op) -> tuple[Op | None, Op | None]:
        """(stage-1 op, the op the owner's NS waits for) of bucket b's gradient reduce."""
        s = self.s
        if not self._own_path():
            op = self._reduce_bucket(r, b, step, dep)
            return op, op
        if self.shard != "intra":  # FSDP: one stage over the world
            col = self._pub_coll(r, ("preduce", step, b), b, "reduce", s.grad_bytes, "world", step,
                                 self.owned[b])
            op = self._cop(col, r, "bwd", step, (dep,))
            return op, op
        if not self._hsdp_stages():  # HSDP, coalesced but one exchange over every rank
            col = self._pub_coll(r, ("preduce", step, b), b, "reduce", s.grad_bytes, "world", step,
                                 self.owned[b])
            op = self._cop(col, r, "bwd", step, (dep,))
            return op, op
        col = self._pub_coll(r, ("preduce1", step, b, r // s.per_node), b, "reduce", s.grad_bytes, "intra",
                             step, self._row_owned(b))
        first = self._cop(col, r, "bwd", step, (dep,))
        col2 = self._pub_coll(r, ("preduce2", step, b, r % s.per_node), b, "reduce", s.grad_bytes, "inter",
                              step, self._column_owned(b, r))
        second = self._cop(col2, r, "bwd", step, (first,), stream="inter") if col2 is not None else first
        return first, second

    def _pub_broadcast(self, r: int, b: int, step: int, deps, *, phase: str, tag: str,
                       issue: Op | None = None) -> Op:
        """Bucket b's publication in a forward / backward `unshard` (HSDP: in the node, from each row's
        copy; FSDP: from the owners over the world), issued once `issue` (the hook it runs from) has run;
        ours where the published path is off."""
        s = self.s
        if not self._own_path():
            return self._publish(r, b, step, deps, phase=phase, tag=tag, stream=self.pub_stream,
                                 which="dense")
        if "fwd_prefetch" in self.pub:
            deps = (*deps, issue)
        if self._hsdp_stages():
            col = self._pub_coll(r, (tag + "_row", step, b, r // s.per_node), b, "broadcast", s.param_bytes,
                                 "intra", step, self._row_owned(b))
        else:
            col = self._pub_coll(r, (tag + "_flat", step, b), b, "broadcast", s.param_bytes, "world", step,
                                 self.owned[b])
        return self._cop(col, r, phase, step, tuple(d for d in deps if d is not None), self.pub_stream)

    def _pub_replicate(self, r: int, step: int, by_bucket: dict, prev: dict) -> None:
        """HSDP's post-step replicate broadcast (`replicate_broadcast_async`): each owner's updated matrices
        to its shard column across nodes, on the replicate stream, after that bucket's NS, in forward
        order; prev["pub_deps"][b] = what the next forward's in-node broadcast of b waits for on rank r."""
        s = self.s
        elem = 4 if "master_fp32" in self.pub else s.param_bytes
        deps = {}
        for b in range(self.n_buckets):
            col = self._pub_coll(r, ("prep", step, b, r % s.per_node), b, "broadcast", elem, "inter", step,
                                 self._column_owned(b, r))
            mine = tuple(by_bucket.get(b, ()))
            deps[b] = (self._cop(col, r, "opt", step, mine, stream="inter"),) if col is not None else mine
        prev["pub_deps"] = deps
        if "sync_publish" in self.pub:
            prev["pubs"] = {("sync", b): d[0] for b, d in deps.items() if d}


def check_published(spec) -> None:
    """Raise InputError where the published schedule cannot run (its switches model dmuon without EP)."""
    if spec.published and spec.ep_spec is not None and spec.ep_spec.ep > 1:
        raise InputError("system 'published' models the public code without expert parallelism; accepted: "
                         "ep=1 with system='published', or system='ours'")
