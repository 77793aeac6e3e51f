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

import contextlib

import torch
import torch.distributed as dist

from ..optim import momentum_update, muon_ns_input
from .fsdp import local_tensor
from .hooks import BackwardTracker
from .planning import batch_method


def _versions(grad):
    """In-place changes of a gradient: a DTensor's own counter (DTensor ops) and its local tensor's (ops on
    the local shard, FSDP2's accumulation)."""
    return None if grad is None else (grad._version, local_tensor(grad)._version)


class TPPipeline:
    """The pipelined TP step; mixed into TPDMuonSteps (uses its _geo, plan, _finish_gather, ...)."""

    # ---- A in backward ------------------------------------------------------------------------------
    def _install_backward_launch(self) -> None:
        """Post-accumulate-grad hooks (FSDP2 runs them on the sharded parameter once its reduce-scatter
        is done): each Muon matrix's shard-group gather starts in backward, in a fixed order (reverse
        parameter order, `BackwardTracker`'s rule: the same on every rank); overlap=False: none."""
        self.tp_launches = {"backward": 0, "step": 0}  # the gathers step() used, by where they started
        self._early = {}  # matrix -> (grad, its version, momentum, nesterov, buffer, its version, new buffer,
        #                              NS input, gather in flight)
        order = list(reversed(range(self.n_muon))) if self.plan is not None else []
        self._tp_tracker = BackwardTracker([[self.params[i]] for i in order],
                                           lambda u: self._launch_early(order[u]), enabled=self.overlap)

    def _takes_part(self, i: int) -> bool:
        r, s, t, mode = self._owner(i)
        return r == self._geo.r and (mode != "whole" or t == self._geo.t)

    def _launch_early(self, i: int) -> None:
        """Matrix i's NS input from its gradient and a copy of the momentum (nothing is committed before
        the flags are agreed), and the start of its shard-group gather to the owner."""
        if not self._takes_part(i):
            return
        self._drain(i)
        p, group = self.params[i], self.param_groups[0]
        mu, nesterov = group["momentum"], group["nesterov"]
        buf = self.state[p].get("momentum_buffer")
        key = (p.grad, _versions(p.grad), mu, nesterov, buf,
               None if buf is None else buf._version)
        with torch.no_grad():
            if p.grad is None:  # the zeros keep the collectives matched; step() redoes it (stale)
                new_buf = x = torch.zeros_like(local_tensor(p))
            else:
                g = local_tensor(p.grad).to(p.dtype)
                new_buf = momentum_update(g, torch.zeros_like(g) if buf is None else buf, mu)
                x = muon_ns_input(g, new_buf, mu, nesterov)
            self._early[i] = (*key, new_buf, x, self._gather_rows(i, x, self._owner(i)[1]))

    def _stale(self, i: int) -> bool:
        """Whether matrix i's early launch no longer matches its gradient, momentum or hyperparameters
        (e.g. gradients clipped in place after backward, another backward, a state load)."""
        e = self._early.get(i)
        if e is None:
            return True
        p, group = self.params[i], self.param_groups[0]
        buf = self.state[p].get("momentum_buffer")
        return (p.grad is None or e[0] is not p.grad or e[1] != _versions(p.grad)
                or (e[2], e[3]) != (group["momentum"], group["nesterov"]) or e[4] is not buf
                or (buf is not None and e[5] != buf._version))

    def _drain(self, i: int):
        """Forget matrix i's early launch, once its gather is done (every rank waits for what it started)."""
        e = self._early.pop(i, None)
        if e is not None and self._geo.S > 1:
            e[-1][1].wait()
        return e

    def _take_early(self, active, mine, group):
        """At step(): the momentum committed and the NS inputs and gathers of the active matrices, from the
        early launches where every rank of the shard group still finds them current, else started now
        (in the same order on every rank of the group: the staleness flags are agreed first)."""
        geo = self._geo
        stale = torch.tensor([self._stale(i) for i in range(self.n_muon)], dtype=torch.int32)
        if geo.S > 1:
            dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=geo.shard_group)
        inputs, gathers = {}, {}
        for i in active:
            if i in mine and not stale[i]:
                e = self._early.pop(i)
                st = self.state[self.params[i]]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = e[6]
                else:
                    st["momentum_buffer"].copy_(e[6])
                inputs[i], gathers[i] = e[7], e[8]
                self.tp_launches["backward"] += 1
            else:
                self._drain(i)
                inputs[i] = self._momentum(i, group)
                if i in mine:
                    gathers[i] = self._gather_rows(i, inputs[i], mine[i][0])
                    self.tp_launches["step"] += 1
        for i in list(self._early):  # launched, but no rank has its gradient (or it is not mine)
            self._drain(i)
        return inputs, gathers

    def synchronize_exchanges(self) -> None:
        for e in getattr(self, "_early", {}).values():  # (none yet while the base class constructs)
            if self._geo.S > 1:
                e[-1][1].wait()
        super().synchronize_exchanges()

    @contextlib.contextmanager
    def no_sync(self):
        with self._tp_tracker.no_sync(), super().no_sync():
            yield

    def _teardown(self) -> None:
        self._tp_tracker.remove()
        super()._teardown()

    def _speculate(self):
        self._tp_tracker.finish()  # no backward round since the last step: launch them all now
        return None

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

    def _broadcast_back(self, active, inputs, scatters, wait_each: bool = False) -> dict:
        """Wait the shard-group scatters; whole matrices over the TP group and (HSDP) every matrix over the
        replicas, all started before any is waited for (wait_each, overlap=False: each waited at once)."""
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
                if wait_each:
                    tp_works.pop(i).wait()
        if geo.R > 1:
            for i in active:
                if i in tp_works:
                    tp_works.pop(i).wait()
                out = results.get(i, torch.empty_like(inputs[i])).contiguous()
                rep_works.append(dist.broadcast(out, group_src=self._owner(i)[0], group=geo.replicate_group,
                                                async_op=True))
                results[i] = out
                if wait_each:
                    rep_works.pop().wait()
        for w in [*tp_works.values(), *rep_works]:
            w.wait()
        return results
