"""Process groups of the distributed optimizers: a private copy of the data-parallel group, and the
two-level (intra-node, inter-node) groups when `node_size` is given.

Why private groups: the optimizers issue their collectives from a background communication thread
(`dmuon.runtime.comm`). A collective the training script issues on the same group from the main thread
at the same time could interleave differently on different ranks, so every collective of the optimizer
runs on groups nobody else uses.

Two-level layout with g = node_size ranks per node (group ranks r = node * g + local):
  intra: the g ranks of my node, ordered by local index;
  inter: the ranks with my local index on every node, ordered by node.
A hierarchical exchange runs an intra-node stage and an inter-node stage (see `exchange.py`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import InputError


@dataclass
class CommGroups:
    """The groups one rank uses; ranks are positions in `group` (0 .. world_size-1)."""

    group: object  # ProcessGroup with every data-parallel rank
    rank: int
    world_size: int
    global_ranks: tuple[int, ...]  # global (default-group) rank of each group rank
    node_size: int | None = None
    intra: object | None = None  # ProcessGroup of my node
    inter: object | None = None  # ProcessGroup of my local index across nodes
    timeout_s: float = 600.0
    backend: str = "gloo"

    @property
    def two_level(self) -> bool:
        return self.node_size is not None and self.n_nodes > 1 and self.node_size > 1

    @property
    def n_nodes(self) -> int:
        return self.world_size // self.node_size if self.node_size else 1

    def node_of(self, rank: int) -> int:
        return rank // self.node_size if self.node_size else 0

    def local_of(self, rank: int) -> int:
        return rank % self.node_size if self.node_size else rank

    def global_rank(self, rank: int) -> int:
        return self.global_ranks[rank]


def check_node_size(node_size, world_size: int) -> int | None:
    if node_size is None:
        return None
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise InputError(f"node_size must be a positive integer (ranks per node) or None, got {node_size!r}")
    if world_size % node_size != 0:
        raise InputError(f"node_size={node_size} does not divide the world size {world_size}; accepted: a "
                         "divisor of the number of ranks, or None for a flat (single-level) exchange")
    return node_size


def build_groups(process_group=None, node_size: int | None = None, timeout_s: float = 600.0) -> CommGroups:
    """Create the private groups. Every rank of `process_group` must call this, in the same order as
    its other `new_group` calls (the optimizers call it from their constructors)."""
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("the distributed optimizers need torch.distributed initialized first: call "
                         "torch.distributed.init_process_group(...) (or launch with torchrun) before "
                         "building DMuon / NaiveMuon")
    if not timeout_s > 0:
        raise InputError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    parent = process_group if process_group is not None else dist.group.WORLD
    global_ranks = tuple(dist.get_process_group_ranks(parent))
    world_size = len(global_ranks)
    rank = dist.get_rank(parent)
    node_size = check_node_size(node_size, world_size)
    timeout = datetime.timedelta(seconds=float(timeout_s))
    # the default group: every rank calls every new_group; a user subgroup: only its members do
    local_sync = process_group is not None and world_size != dist.get_world_size()

    def new(ranks):
        return dist.new_group(ranks=list(ranks), timeout=timeout, use_local_synchronization=local_sync)

    groups = CommGroups(group=new(global_ranks), rank=rank, world_size=world_size, global_ranks=global_ranks,
                        node_size=node_size, timeout_s=float(timeout_s), backend=dist.get_backend(parent))
    if groups.two_level:
        g, n_nodes = node_size, world_size // node_size
        for node in range(n_nodes):
            members = [global_ranks[node * g + local] for local in range(g)]
            if not local_sync or node == groups.node_of(rank):
                pg = new(members)
                if node == groups.node_of(rank):
                    groups.intra = pg
        for local in range(g):
            members = [global_ranks[node * g + local] for node in range(n_nodes)]
            if not local_sync or local == groups.local_of(rank):
                pg = new(members)
                if local == groups.local_of(rank):
                    groups.inter = pg
    return groups
