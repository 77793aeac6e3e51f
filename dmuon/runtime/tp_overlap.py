"""TPDMuon's pipelined step (`overlap=True`, the default): the same collectives and arithmetic as the
blocking step of dmuon/runtime/tp.py (so the same bits), issued so that communication and NS overlap.

Per step, after the momentum and the shard-group gathers (all queued at once, AdamW runs while they
travel), the matrices this rank takes part in go through three stages, one matrix apart:
  prepare(k+1)  wait matrix k+1's rows (shard-group gather), then start its TP-group gather to the owner
                TP rank (mode "gather", async);
  compute(k)    matrix k's NS: mode "gather" waits its TP gather, the owner runs the NS and starts the
                TP-group scatter of the blocks (async); mode "group" runs `orthogonalize_distributed`
                (its Gram all-reduces are blocking, but matrix k+1's gather is already in flight); a
                matrix TP leaves whole is orthogonalized by its owner;
  finish(k-1)   wait matrix k-1's TP scatter, start its shard-group scatter (async).
So matrix k+1's TP gather and matrix k-1's TP scatter travel while matrix k's NS computes. Then every
whole-matrix TP broadcast is started (async), and each replica broadcast (HSDP) as soon as its matrix's
TP broadcast has landed; the updates are applied once all have arrived, at the end of step().

Collective order: every rank of a group issues that group's collectives in the same order (the matrices
in plan order, each stage in the order above), which is what gloo and NCCL need.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .planning import batch_method


class TPPipeline:
    """The pipelined TP step; mixed into TPDMuonSteps (uses its _geo, plan, _finish_gather, ...)."""

    def _pipelined(self, active, inputs, mine, gathers) -> dict:
        """The update rows of every active matrix on this rank (module docstring)."""
        geo = self._geo
        order = list(mine)
        blocks, tp_in, tp_out, scatters = {}, {}, {}, {}

        def prepare(i):
            s, t, mode = mine[i]
            block = self._finish_gather(i, gathers.pop(i), s)
            if block is None:
                return
            block = block.to(self.params[i].dtype)
            if mode == "gather" and geo.T > 1:
                tp_in[i] = self._tp_gather_start(block, t)
            else:
                blocks[i] = block

        def compute(i):
            s, t, mode = mine[i]
            if i in tp_in:
                tp_out[i] = self._tp_ns_scatter_start(i, tp_in.pop(i), t)
            elif i in blocks:
                blocks[i] = self._orthogonalize_block(i, blocks[i], t, mode)

        def finish(i):
            s, t, mode = mine[i]
            if i in tp_out:
                out, work = tp_out.pop(i)
                work.wait()
                block = out
            else:
                block = blocks.pop(i, None)
            scatters[i] = self._scatter_rows(i, block, s, inputs[i])

        for k, i in enumerate(order):
            if k == 0:
                prepare(i)
            if k + 1 < len(order):
                prepare(order[k + 1])
            compute(i)
            if k:
                finish(order[k - 1])
        if order:
            finish(order[-1])
        return self._broadcast_back(active, inputs, scatters)

    def _tp_gather_start(self, block, t):
        """Start the TP-group gather of this rank's block to TP rank t (mode "gather")."""
        geo = self._geo
        wire = self._wire(block).contiguous()
        parts = [torch.empty_like(wire) for _ in range(geo.T)] if geo.t == t else None
        return block.dtype, wire, parts, dist.gather(wire, parts, group_dst=t, group=geo.tp_group,
                                                     async_op=True)

    def _tp_ns_scatter_start(self, i, pending, t):
        """Wait the TP gather of matrix i; the owner orthogonalizes the whole matrix; start the scatter of
        the blocks back (this rank's block lands in the returned buffer once the work is done)."""
        geo, plan = self._geo, self.plan
        dtype, wire, parts, work = pending
        work.wait()
        back = None
        if geo.t == t:
            c = plan.tp_choices[i]
            full = torch.cat(parts, dim=c.shard_dim).to(dtype)
            u = self._ns(full[None], batch_method(plan, self._batch_of(i)))[0]
            self.ns_matrices += 1
            back = [self._wire(x).contiguous() for x in u.chunk(geo.T, dim=c.shard_dim)]
        out = torch.empty_like(wire)
        return out, dist.scatter(out, back, group_src=t, group=geo.tp_group, async_op=True)

    def _broadcast_back(self, active, inputs, scatters) -> dict:
        """Wait the shard-group scatters; whole matrices over the TP group and (HSDP) every matrix over the
        replicas, all started before any is waited for."""
        geo = self._geo
        results, tp_works, rep_works = {}, {}, []
        for i in active:
            if i in scatters:
                results[i] = self._finish_scatter(scatters[i])
            r, s, t, mode = self._owner(i)
            if r == geo.r and mode == "whole" and geo.T > 1:  # every TP rank holds the same rows
                out = results.get(i, torch.empty_like(inputs[i]))
                tp_works[i] = dist.broadcast(out, group_src=t, group=geo.tp_group, async_op=True)
                results[i] = out
        if geo.R > 1:
            for i in active:
                if i in tp_works:
                    tp_works.pop(i).wait()
                out = results.get(i, torch.empty_like(inputs[i])).contiguous()
                rep_works.append(dist.broadcast(out, group_src=self._owner(i)[0], group=geo.replicate_group,
                                                async_op=True))
                results[i] = out
        for w in [*tp_works.values(), *rep_works]:
            w.wait()
        return results
