"""Split batches in the step programs: every member of a batch's owner group runs its share of the NS.

A plan batch with a group of k ranks (`dmuon.plan.types.Batch.group`, split NS:
`dmuon.orthogonalize_distributed`) becomes, on each member, in program order:
  batch<j>.prep   the member's share of the step's momentum pass (its column block's elements, as the
                  owners' shares are priced) once the buckets holding the batch have arrived
  split/ag        the call's two small all-gathers (shape check, Frobenius normalization): latency only
  batch<j>.ns<i>  the compute between the group's all-reduces, each segment its FLOP share
                  (`simulator.programs.split_program.segments`) of the plan's compute time for the batch
                  (`Batch.ns_s - Batch.comm_s`, the cost table's time of the widest block's call plus
                  the replicated n^3 work: `dmuon.plan.split.split_price`) x the NS contention factor
  split/ar<i>     the all-reduce of the b upper triangles of the n x n partial products (fp32)
The collectives are real collectives of the group's ranks (a `Group` of the nodes they span:
`simulator.programs.split_links.group_of`), priced by `simulator.fabric.collectives.collective_time_s` on the step's
network, the same links the plan was priced with (`SimConfig.max_split`). They run on the rank's own
"split" stream, as the runtime's group has its own process group (and NCCL stream): they do not queue
behind the backward's gradient reductions still in flight on the comm stream (ASSUMPTION: the two
streams share the links without slowing each other; the engine models no link contention).

Who holds what (`StepSpec.split_exchange`, `SimConfig.split_exchange`):
  lead    as the runtime does it (dmuon.runtime.split_exec): the lead receives the whole gradient, runs the
          whole momentum pass and publishes the whole update, as an unsplit owner; around the NS it
          scatters the members' column blocks of the (b, n, m) stack (parameter dtype) and gathers their
          blocks of the polar factor: `split/.../scatter` ("broadcast" from one root: the lead's links
          carry (k - 1) / k of the stack) and `split/.../gather` ("reduce" to one root, the same bytes)
  blocks  block ownership: each member receives the reduced gradient of its column block (the bucket
          reduce to owners delivers blocks: `owned` counts numel / k per member), keeps that block's
          momentum and publishes its block of the new weights; no scatter / gather. What the runtime does
          for fsdp2-sharded batches whose group is the shard group (`split_exec.row_split_batches`: the
          local Shard(0) rows are the blocks) and could do in every layout with the same plan.
In the HSDP layouts too the plan spans every rank (as the runtime plans), so each group runs once.
"""

from __future__ import annotations

from simulator.fabric.collectives import bytes_per_rank, collective_time_s
from simulator.engine.engine import Op
from .split_links import group_of
from .split_program import split_calls

SPLIT_EXCHANGES = ("lead", "blocks")


class SplitPrograms:
    """Split-batch ops of one rank (mixed into `simulator.programs.step._Programs` through OptimizerPrograms)."""

    def _group_ranks(self, r: int, group) -> tuple[int, ...]:
        """The global ranks of plan group `group` (the plan spans every rank in every layout)."""
        return tuple(group)

    def _group_coll(self, ranks: tuple[int, ...], key: tuple, kind: str, size_bytes: float, step: int,
                    repeat: int = 1, max_share: float = 0.0):
        full = ("split", key, ranks)
        col = self.colls.get(full)
        if col is None:
            s, n = self.s, len(ranks)
            cost = collective_time_s(kind, size_bytes, group_of(ranks, s.per_node), s.network,
                                     hierarchical=s.hierarchical, max_share_bytes=max_share)
            col = self.c.new_collective("/".join(str(k) for k in ("split", *key)), kind, n, cost * repeat,
                                        bytes_per_rank=bytes_per_rank(kind, size_bytes, n) * repeat,
                                        muon_fraction=1.0, group=f"split{ranks[0]}-{ranks[-1]}", step=step)
            self.colls[full] = col
        return col

    def _split_batch(self, r: int, step: int, k: int, bt, prep_s: float, deps) -> Op:
        """Rank r's share of split batch k (module docstring); returns its last op."""
        s, c = self.s, self.c
        ranks = self._group_ranks(r, bt.group)
        prog = split_calls(bt.rows, bt.cols, bt.size, len(ranks), bt.method or s.plan.method)
        compute_s = max(bt.ns_s - bt.comm_s, 0.0) * s.ns_stretch  # momentum: prep_s, priced by the step
        last = c.compute(r, f"batch{k}.prep", prep_s, phase="opt", step=step, deps=deps)
        lead = s.split_exchange == "lead"
        stack = bt.size * bt.rows * bt.cols * s.param_bytes
        via_lead = stack * (len(ranks) - 1) / len(ranks)  # what the lead's links carry
        if lead:
            col = self._group_coll(ranks, (step, k, "scatter"), "broadcast", stack, step, max_share=via_lead)
            last = c.collective(col, r, phase="opt", step=step, deps=(last,), stream="split")
        count, small = prog["small"]
        col = self._group_coll(ranks, (step, k, "ag"), "all_gather", small, step, repeat=count)
        wait = c.collective(col, r, phase="opt", step=step, deps=(last,), stream="split")
        fractions = prog["fractions"]
        for i, f in enumerate(fractions):
            last = c.compute(r, f"batch{k}.ns{i}", compute_s * f, phase="opt", step=step, deps=(wait,))
            if i + 1 < len(fractions):
                col = self._group_coll(ranks, (step, k, f"ar{i}"), "all_reduce", prog["all_reduce_bytes"],
                                       step)
                wait = c.collective(col, r, phase="opt", step=step, deps=(last,), stream="split")
        if lead:
            col = self._group_coll(ranks, (step, k, "gather"), "reduce", stack, step, max_share=via_lead)
            last = c.collective(col, r, phase="opt", step=step, deps=(last,), stream="split")
        return last


__all__ = ["SplitPrograms"]
