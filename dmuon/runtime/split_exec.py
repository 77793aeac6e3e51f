"""Split batches at run time: the plan gives a batch a group of k > 1 owner ranks (`Batch.group`, lead
first) and the group orthogonalizes it with `dmuon.orthogonalize_distributed`, each member one block of
the long side.

Who holds what. The lead is `Plan.owners[i]` of every member matrix, so the exchange units, the state
dicts and the checkpoints see an ordinary owner: the lead receives the summed gradient, keeps the whole
momentum, forms the NS input stack (B, n, m) (n <= m, the batch's NS shape) exactly as an unsplit owner
does, and, once the group is done, applies the whole update and publishes the new weights as before.
In between (`SplitExecutor.run`), within the group's own process group:
  1. blocks out: the lead sends member j its column block j of the stack (`split_sizes(m, k)` widths;
     point-to-point, so uneven blocks need no padding), in the stack's dtype;
  2. NS: every member runs `orthogonalize_distributed` on its block (k-way all-reduces of the m x m
     Gram products, upper triangles in fp32: see dmuon/split_ns.py);
  3. blocks back: the lead receives the members' blocks of the polar factor and concatenates them.
Extra bytes per split batch over the unsplit owner: 2 (k - 1) / k of the stack through the lead (out
and back), beside the Gram all-reduces the plan prices; the plan does not price these two
(`dmuon.plan.split` counts the all-reduces only), see docs/runtime.md. A member that is not the lead
needs no gradient, momentum or weight of the matrix (memory='free' works unchanged).

Process groups: one per distinct `Batch.group`, created once at construction on every rank of the
optimizer's group, in plan order, with the runtime's timeout (only the members when the optimizer runs
on a subgroup of the world, as `groups.build_groups` does). Every rank is in at most one split batch
(the plan's rule), so a rank never orders the collectives of two groups. Every wait has the timeout.

`check_split_plan` rejects a plan whose groups cannot run (a rank outside the optimizer's group, k larger
than it, a lead that is not the owner, a rank in two split batches, a long side shorter than k) with a
one-line InputError before any collective.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

from ..errors import InputError
from ..plan.split import all_reduces_per_call
from ..split_ns import orthogonalize_distributed, split_sizes


def check_split_plan(plan, world_size: int) -> None:
    """InputError naming what is accepted when a split batch of `plan` cannot run on `world_size` ranks."""
    seen: dict[int, int] = {}
    for j, b in enumerate(plan.batches):
        if not b.group:
            continue
        g = tuple(b.group)
        if len(g) > world_size:
            raise InputError(f"plan batch {j} ({b.rows}x{b.cols}) has a group of {len(g)} ranks but the "
                             f"optimizer runs on {world_size}; accepted: groups of 2 .. {world_size} ranks")
        if len(g) < 2 or len(set(g)) != len(g) or any(not 0 <= r < world_size for r in g):
            raise InputError(f"plan batch {j}: group {list(g)} is not a set of >= 2 distinct ranks in "
                             f"[0, {world_size}); accepted: ranks of the optimizer's process group")
        if g[0] != b.owner or any(plan.owners[i] != b.owner for i in b.members):
            raise InputError(f"plan batch {j}: the group's first rank {g[0]} must be the batch's owner "
                             f"{b.owner} and the owner of all its matrices; accepted: lead first")
        long_side = max(b.rows, b.cols)
        if long_side < len(g):
            raise InputError(f"plan batch {j}: a {b.rows}x{b.cols} matrix has {long_side} columns along its "
                             f"long side, fewer than its group of {len(g)}; accepted: k <= {long_side}")
        for r in g:
            if r in seen:
                raise InputError(f"plan: rank {r} is in split batches {seen[r]} and {j}; accepted: every "
                                 "rank in at most one split batch")
            seen[r] = j


class SplitExecutor:
    """The process groups of a plan's split batches and the lead/member protocol (module docstring)."""

    def __init__(self, plan, comm_groups, timeout_s: float, stats=None):
        check_split_plan(plan, comm_groups.world_size)
        self.rank, self.timeout_s, self.stats = comm_groups.rank, float(timeout_s), stats
        self.pg: dict[tuple[int, ...], object] = {}
        # plan position -> rank inside the group's process group (new_group orders its ranks, so a group
        # whose lead is not its lowest rank has them in another order than the plan's)
        self.pos: dict[tuple[int, ...], list[int]] = {}
        timeout = datetime.timedelta(seconds=self.timeout_s)
        local_sync = comm_groups.world_size != dist.get_world_size()
        for g in dict.fromkeys(tuple(b.group) for b in plan.batches if b.group):
            if local_sync and self.rank not in g:
                continue
            pg = dist.new_group([comm_groups.global_rank(r) for r in g], timeout=timeout,
                                use_local_synchronization=local_sync)
            if self.rank in g:
                self.pg[g] = pg
                self.pos[g] = [dist.get_group_rank(pg, comm_groups.global_rank(r)) for r in g]

    @staticmethod
    def is_split(batch) -> bool:
        return len(batch.group) > 1

    def _wait(self, work, what: str) -> None:
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise RuntimeError(f"rank {self.rank}: {what} failed or did not finish within "
                               f"{self.timeout_s:g} s (a peer of the split group failed or never called): "
                               f"{e}") from e
        if ok is False:
            raise RuntimeError(f"rank {self.rank}: {what} did not finish within {self.timeout_s:g} s")

    def run_rows(self, batch, block: torch.Tensor, ns_kwargs: dict) -> torch.Tensor:
        """A row-split batch (`row_split_batches`): this rank's rows (count, rows_s, cols) of the stacked
        members in, its rows of their polar factors out; one `orthogonalize_distributed` on the group."""
        with self.stats.ns_call() if self.stats is not None else contextlib.nullcontext():
            out = orthogonalize_distributed(block, group=self.pg[tuple(batch.group)], tall=True,
                                            timeout_s=self.timeout_s, check=False, **ns_kwargs)
        if self.stats is not None:
            self._count_gram(batch, block.shape[0], len(batch.group), ns_kwargs)
        return out

    def _count_gram(self, batch, count: int, k: int, ns_kwargs: dict) -> None:
        n = batch.rows
        calls = all_reduces_per_call(str(ns_kwargs.get("method", "standard")), ns_kwargs.get("steps", 5),
                                     tuple(ns_kwargs.get("restart", ())))
        tri = count * n * (n + 1) // 2 * 4  # fp32 upper triangles; ring all-reduce: 2 (k - 1) / k of it
        self.stats.add_bytes("split_gram", int(calls * tri * 2 * (k - 1) / k))

    def run(self, batch, stack: torch.Tensor | None, *, count: int, dtype: torch.dtype, device,
            ns_kwargs: dict) -> torch.Tensor | None:
        """Orthogonalize the split batch on its group. The lead passes the NS input `stack`
        (count, n, m) and gets the polar factors (same shape); a member passes None and gets None.
        `count` / `dtype` must be what the lead's stack has (every rank derives them from the plan)."""
        group = tuple(batch.group)
        pg, pos = self.pg[group], self.pos[group]
        k, me = len(group), group.index(self.rank)
        lead = me == 0
        n, m = batch.rows, batch.cols
        sizes = split_sizes(m, k)
        starts = [sum(sizes[:j]) for j in range(k)]
        name = f"split batch {batch.rows}x{batch.cols} x{count} on ranks {list(group)}"
        with self.stats.ns_call() if self.stats is not None else contextlib.nullcontext():
            if lead:
                if stack.shape != (count, n, m):
                    raise AssertionError(f"{name}: stack {tuple(stack.shape)}, expected {(count, n, m)}")
                sends = [dist.isend(stack[:, :, starts[j]:starts[j] + sizes[j]].contiguous(),
                                    group_dst=pos[j], group=pg) for j in range(1, k)]
                block = stack[:, :, :sizes[0]]  # a view: orthogonalize_distributed copies what it needs
            else:
                block = torch.empty((count, n, sizes[me]), dtype=dtype, device=device)
                self._wait(dist.irecv(block, group_src=pos[0], group=pg), f"{name}: block from the lead")
            out = orthogonalize_distributed(block, group=pg, tall=False, timeout_s=self.timeout_s,
                                            check=False, **ns_kwargs)
            if lead:
                parts = [torch.empty((count, n, w), dtype=dtype, device=device) for w in sizes[1:]]
                recvs = [dist.irecv(t, group_src=pos[j + 1], group=pg) for j, t in enumerate(parts)]
                for w in sends:
                    self._wait(w, f"{name}: blocks to the members")
                for w in recvs:
                    self._wait(w, f"{name}: blocks from the members")
            else:
                self._wait(dist.isend(out, group_dst=pos[0], group=pg), f"{name}: block to the lead")
        if self.stats is not None:
            item = torch.empty(0, dtype=dtype).element_size()
            mine = count * n * sizes[me] * item
            self.stats.add_bytes("split_blocks", count * n * (m - sizes[0]) * item if lead else mine)
            self._count_gram(batch, count, k, ns_kwargs)
        if not lead:
            return None
        return torch.cat([out, *parts], dim=-1)



def row_split_batches(opt) -> list:
    """fsdp2-sharded: the split batches whose blocks are already in place, so they need no all-to-all.
    A Shard(0) matrix with at least as many rows as columns is tall (or square) in NS terms: its local
    rows are a block of its long side. A batch qualifies when its group is the shard ranks of one replica
    in shard order (k = shard group size) and every member is such a matrix with >= 1 row on every shard
    rank; each member of the group then runs `orthogonalize_distributed(tall=True)` on its own rows (its
    own momentum, no lead scatter / gather, no all-to-all) and applies its rows of the update."""
    geo, plan, out = opt.geo, opt.plan, []
    for b in plan.split_batches:
        coords = [geo.coord[r] for r in b.group]
        if len(b.group) != geo.S or coords != [(coords[0][0], s) for s in range(geo.S)]:
            continue
        if all(opt.params[i].shape[0] == b.cols and geo.cols[i] == b.rows and min(geo.rows[i]) >= 1
               for i in b.members):
            out.append(b)
    return out
