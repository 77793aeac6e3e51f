"""DMuon and NaiveMuon on tensor-parallel (TP) meshes: TP alone, FSDP2 x TP (torchtitan's recipe) and
HSDP x TP. See docs/runtime.md, "Tensor parallelism".

Accepted parameters. Every Muon matrix is a 2-D DTensor on one device mesh whose TP dimension is the
mesh dim named "tp" (or the only dim of a 1-D mesh whose parameters no fully_shard manages), with
placements, per mesh dim:
  TP alone      (Shard(0) | Shard(1) | Replicate(),)                       1-D mesh ("tp",)
  FSDP2 x TP    (Shard(0) | _StridedShard(0), <tp placement>)              2-D mesh (dp, "tp")
  HSDP x TP     (Replicate(), Shard(0) | _StridedShard(0), <tp placement>) 3-D mesh (replicate, shard, "tp")
Shard(0) on "tp" is a ColwiseParallel weight (rows cut), Shard(1) a RowwiseParallel one (columns cut),
Replicate() a matrix TP leaves whole. TP rank t holds block t of the matrix along the TP dim (torch.chunk
of an evenly divisible dim); fully_shard then cuts that block's rows torch.chunk-style over the shard
ranks (what _StridedShard(0, sf=tp) and (Shard(0), Shard(1)) say in global terms), so a rank's local
tensor is rows chunk s of TP block t.

DMuon, per step (overlap=False: all at step(), in this order; overlap=True starts A in backward and
pipelines B and C one matrix apart, the same bits: runtime/tp_overlap.py and docs/runtime.md):
  momentum on the local shards (every rank; kept there, so DCP saves and re-shards it like the weight);
  A  each matrix's TP blocks are gathered over the shard group to the TP group that owns it (the plan's
     `TPChoice.dp_index`; one replica: the owner's), all matrices' gathers queued at once, AdamW runs
     while they travel; padded to the largest chunk (gloo gathers equal sizes);
  B  that TP group orthogonalizes: mode "group" `orthogonalize_distributed` on its blocks (tall=True for
     row blocks of a tall matrix; no gather), mode "gather" the blocks to TP rank `owner`, whole NS
     there, the blocks back; a matrix TP leaves whole is orthogonalized by its owner alone;
  C  the rows of the update go back over the shard group (scatter); a whole matrix's then over the TP
     group (broadcast); HSDP: the owner replica broadcasts the new local shards to the other replicas.
comm_dtype narrows A, the gather / scatter of B and C (the Gram all-reduces of "group" stay fp32).
NaiveMuon ("duplicated"): every rank all-gathers every matrix (`DTensor.full_tensor`), orthogonalizes
it and keeps its local piece.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..errors import InputError
from ..optim import muon_momentum_
from ..plan.tp import check_tp_shape
from .fsdp import chunk_rows, fsdp_owner_module, is_dtensor, local_tensor
from .fsdp_sharded import _ShardedMixin
from .planning import batch_method
from .tp_overlap import TPPipeline

ACCEPTED = ("accepted: 2-D DTensor Muon matrices on a mesh whose TP dim is named 'tp' (or an unnamed 1-D "
            "mesh no fully_shard manages), placements (tp,), (Shard(0)|_StridedShard(0), tp) or (Replicate(), "
            "Shard(0)|_StridedShard(0), tp) with tp one of Shard(0), Shard(1), Replicate()")


def _tp_dim(p, model=None) -> int | None:
    """The mesh dim of a DTensor that is TP (see the module docstring), None if it has none."""
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        return names.index("tp")
    if mesh.ndim == 1 and not names and model is not None and fsdp_owner_module(model, p) is None:
        return 0  # an unnamed 1-D mesh; a named one ("dp": FSDP2 over a pipeline stage's dp group) is not TP
    return None


def is_tp_model(model, predicate=None) -> bool:
    """Whether some Muon matrix of the model is a DTensor on a TP mesh (module docstring)."""
    from ..params import route

    for r in route(model, predicate):
        if r.use_muon and is_dtensor(r.param) and _tp_dim(r.param, model) is not None:
            return True
    return False


def tp_variant_of(cls, model, predicate=None):
    """The class DMuon / NaiveMuon (`cls`) becomes for `model`: its TP variant on a TP model, else cls."""
    if cls.tp_variant is not None and isinstance(model, torch.nn.Module) and is_tp_model(model, predicate):
        return cls.tp_variant
    return cls


def _kind(pl) -> str:
    name = type(pl).__name__
    if name == "Replicate":
        return "R"
    if name in ("Shard", "_StridedShard"):
        return f"{'T' if name == '_StridedShard' else 'S'}{pl.dim}"
    return name


_TABLES: dict[tuple, object] = {}  # (profile, device, dtype) -> the cost table TP plans read


class TPGeometry:
    """The mesh of the TP Muon matrices as a (R replicas, S shard ranks, T TP ranks) grid, this rank's
    coordinates, private process groups along each axis, and every matrix's TP shard dim."""

    def __init__(self, opt, model, timeout_s: float):
        mesh = None
        self.shard_dims: list[int | None] = []
        for i in range(opt.n_muon):
            name, p = opt.names[i], opt.params[i]
            if not is_dtensor(p) or p.dim() != 2:
                raise InputError(f"{name}: every Muon matrix of a TP model must be a 2-D DTensor on the TP "
                                 f"mesh, got {'a plain tensor' if not is_dtensor(p) else p.dim()}-D; "
                                 f"{ACCEPTED}")
            if mesh is None:
                mesh, tdim = p.device_mesh, _tp_dim(p, model)
                if tdim is None or tdim != mesh.ndim - 1 or mesh.ndim > 3:
                    raise InputError(f"{name}: mesh {mesh.mesh_dim_names} of {mesh.ndim} dims has no TP dim "
                                     f"last; {ACCEPTED}")
            elif p.device_mesh != mesh:
                raise InputError(f"{name} lives on another device mesh than the other Muon matrices; "
                                 "accepted: one mesh for every Muon matrix")
            kinds = [_kind(pl) for pl in p.placements]
            tp_kind, rest = kinds[-1], kinds[:-1]
            want = [["S0", "T0"]] if len(rest) == 1 else [["R"], ["S0", "T0"]] if len(rest) == 2 else []
            if tp_kind not in ("S0", "S1", "R") or any(k not in w for k, w in zip(rest, want, strict=True)):
                raise InputError(f"{name}: placements {tuple(p.placements)} are not handled on a TP mesh; "
                                 f"{ACCEPTED}")
            sd = None if tp_kind == "R" else int(tp_kind[1])
            check_tp_shape(name, p.shape[0], p.shape[1], sd, mesh.size(mesh.ndim - 1))
            self.shard_dims.append(sd)
        grid = mesh.mesh
        while grid.dim() < 3:
            grid = grid.unsqueeze(0)
        self.R, self.S, self.T = (int(x) for x in grid.shape)
        ranks = opt.groups.global_ranks
        if sorted(ranks) != sorted(grid.flatten().tolist()):
            raise InputError(f"the optimizer's process group (ranks {list(ranks)}) differs from the TP "
                             f"mesh's ranks ({grid.flatten().tolist()}); accepted: the mesh's ranks "
                             "(process_group=None when the mesh spans the world)")
        me = dist.get_rank()
        (self.r, self.s, self.t), = [(a, b, c) for a in range(self.R) for b in range(self.S)
                                     for c in range(self.T) if int(grid[a, b, c]) == me]
        timeout = datetime.timedelta(seconds=timeout_s)

        def axis(lines, mine):  # every rank creates every group, in the same order
            out = None
            for key, members in lines:
                pg = dist.new_group([int(g) for g in members], timeout=timeout) if len(members) > 1 else None
                if key == mine:
                    out = pg
            return out

        self.tp_group = axis([((a, b), grid[a, b].tolist()) for a in range(self.R) for b in range(self.S)],
                             (self.r, self.s))
        self.shard_group = axis([((a, c), grid[a, :, c].tolist()) for a in range(self.R)
                                 for c in range(self.T)], (self.r, self.t))
        self.replicate_group = axis([((b, c), grid[:, b, c].tolist()) for b in range(self.S)
                                     for c in range(self.T)], (self.s, self.t))
        self.dp = self.R * self.S  # TP groups: plan dp index d = r * S + s, plan rank = d * T + t
        self.block = []  # per matrix: TP block shape, rows per shard rank
        for i in range(opt.n_muon):
            rows, cols = opt.params[i].shape
            sd = self.shard_dims[i]
            shape = ((rows, cols) if sd is None else (rows // self.T, cols) if sd == 0
                     else (rows, cols // self.T))
            chunks = chunk_rows(shape[0], self.S)
            have = tuple(local_tensor(opt.params[i]).shape)
            if have != (chunks[self.s], shape[1]):
                raise InputError(f"{opt.names[i]}: local shard {have} is not rows chunk {self.s} of its TP "
                                 f"block {shape} over {self.S} shard ranks; {ACCEPTED}")
            self.block.append((shape, chunks))

    def local_of(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's local piece of a whole matrix i (TP block t, then rows chunk s)."""
        sd, (shape, chunks) = self.shard_dims[i], self.block[i]
        blk = full if sd is None else full.narrow(sd, self.t * shape[sd], shape[sd])
        return blk.narrow(0, sum(chunks[:self.s]), chunks[self.s])


class _TPMixin:
    """Construction and momentum shared by TPDMuon and TPNaiveMuon (Muon matrices in no exchange unit)."""

    sharded_variant = None
    tp_variant = None
    _muon_units = False

    def __init__(self, model, **kwargs):
        from ..params import route

        plain = [r.name for r in route(model, kwargs.get("muon_predicate"))
                 if r.use_muon and not is_dtensor(r.param)]
        if plain:
            raise InputError(f"{plain[0]}: every Muon matrix of a TP model must be a DTensor on the TP mesh "
                             f"({len(plain)} are plain tensors); {ACCEPTED}")
        self._tp_model = model
        super().__init__(model, **kwargs)
        self.layout = "tp"
        for i in range(self.n_muon):
            if not self.layouts[i].is_whole:
                raise InputError(f"{self.names[i]}: a TP matrix is orthogonalized as one matrix; accepted: "
                                 "per_head=False and no fused-parameter layout on a TP model")
        self.ns_matrices = 0

    def _tp_geometry(self):
        geo = getattr(self, "_geo", None)
        if geo is None:
            geo = self._geo = TPGeometry(self, self._tp_model, self.timeout_s)
        return geo

    def _momentum(self, i: int, group) -> torch.Tensor:
        p = self.params[i]
        mine = local_tensor(p)
        st = self.state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(mine, memory_format=torch.preserve_format)
        return muon_momentum_(local_tensor(p.grad).to(p.dtype), st["momentum_buffer"], group["momentum"],
                              group["nesterov"])

    _apply_tp = _ShardedMixin._apply_local  # rows of the update onto the local shards, one foreach call

    def _active(self, has_any: torch.Tensor) -> list[int]:
        """The Muon matrices some rank has a gradient for (the agreed flags)."""
        flags = has_any.tolist()
        return [i for i in range(self.n_muon) if flags[i]]


class TPDMuonSteps(TPPipeline, _TPMixin):
    """DMuon's TP steps (module docstring; overlap=True: TPPipeline's order)."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._install_backward_launch()  # overlap=True: A starts in backward (runtime/tp_overlap.py)

    def _build_plan(self, specs, balancer: str, profile: str | None, bucket_numel: int):
        from ..plan.split import links_for
        from ..plan.tp import build_tp_plan
        from .planning import DTYPE_NAMES, ConfigCost, FlopCost, iteration_dtype, load_cost

        geo = self._tp_geometry()
        given = getattr(self, "_given_plan", None)
        if given is not None:
            from .planning import check_given_plan

            plan = check_given_plan(given, specs, self.world_size)
            if plan.tp != geo.T or [c.shard_dim if c else None for c in plan.tp_choices] != geo.shard_dims:
                raise InputError(f"the plan is for tp={plan.tp} (shard dims of its choices) but the model "
                                 f"runs tp={geo.T}; accepted: dmuon.plan.tp.build_tp_plan of this model")
            return plan
        view = ConfigCost(FlopCost(), self.ns, self.device)
        methods = {view.method_for(s.rows, s.cols) for s in specs}
        method = methods.pop() if len(methods) == 1 else "auto"
        base = method.removesuffix("_sym") if method != "auto" else "standard"
        dtype = DTYPE_NAMES[iteration_dtype(base, self.device, self.ns.dtype)]
        key = (profile, str(self.device), dtype)
        table = _TABLES.get(key)
        if table is None:  # fitting a profile's curves takes seconds on a CPU: once per process
            table = _TABLES[key] = load_cost(profile, self.device, dtype)
        links = links_for(table) if not isinstance(table, FlopCost) else None
        if links is None:
            from ..plan.split import LINKS

            links = LINKS["cpu"]
        wire = 2 if self.comm_dtype in (torch.bfloat16, torch.float16) else 4
        return build_tp_plan(specs, self.world_size, table, tp=geo.T, shard_dims=geo.shard_dims,
                             mode=getattr(self, "_tp_mode", "auto"), method=method, dtype=dtype, links=links,
                             wire_bytes=wire, bucket_numel=bucket_numel, method_for=view.method_for)

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.comm_dtype is None else t.to(self.comm_dtype)

    def _owner(self, i: int) -> tuple[int, int, int, str]:
        """(replica, shard rank, TP rank) of matrix i's owner and its mode ('group' | 'gather' | 'whole')."""
        geo, plan = self._geo, self.plan
        owner = plan.owners[i]
        d, t = divmod(owner, geo.T)
        c = plan.tp_choices[i] if plan.tp_choices else None
        return d // geo.S, d % geo.S, t, ("whole" if c is None else c.mode)

    def _muon_update(self, has_any: torch.Tensor, pending) -> None:
        if self.plan is None:
            return
        geo, group = self._geo, self.param_groups[0]
        active = self._active(has_any)
        mine = {}  # matrices whose owner replica is mine and that my TP rank takes part in
        for i in active:
            r, s, t, mode = self._owner(i)
            if r == geo.r and (mode != "whole" or t == geo.t):
                mine[i] = (s, t, mode)
        # A: TP blocks to the owning shard rank: overlap=True started in backward (tp_overlap.py), else all
        # queued at once here; AdamW runs while they travel
        if self.overlap:
            inputs, gathers = self._take_early(active, mine, group)
        else:
            inputs = {i: self._momentum(i, group) for i in active}
            gathers = {i: self._gather_rows(i, inputs[i], s) for i, (s, t, mode) in mine.items()}
            self.tp_launches["step"] += len(gathers)
        self._adamw_update(has_any)
        self._adamw_done = True
        if self.overlap:  # B and C pipelined, one matrix apart (runtime/tp_overlap.py): the same bits
            results = self._pipelined(active, inputs, mine, gathers)
            self._apply_tp([(i, results[i]) for i in active], group)
            return
        # overlap=False: B the owning TP group orthogonalizes, C rows back, one matrix after another
        scatters = {}
        for i, (s, t, mode) in mine.items():
            block = self._finish_gather(i, gathers[i], s)
            if block is not None:
                block = self._orthogonalize_block(i, block.to(self.params[i].dtype), t, mode)
            scatters[i] = self._scatter_rows(i, block, s, inputs[i])
        results = self._broadcast_back(active, inputs, scatters, wait_each=True)
        self._apply_tp([(i, results[i]) for i in active], group)

    def _gather_rows(self, i, x, s):
        geo = self._geo
        if geo.S == 1:
            return x
        send, _ = self._row_buffer(i, x)
        send[:x.shape[0]].copy_(x)
        recv = [torch.empty_like(send) for _ in range(geo.S)] if geo.s == s else None
        return recv, dist.gather(send, recv, group_dst=s, group=geo.shard_group, async_op=True)

    def _row_buffer(self, i, like):
        """A zeroed buffer of the largest rows chunk of matrix i's TP block in the wire dtype, the chunks."""
        shape, chunks = self._geo.block[i]
        dtype = self.comm_dtype or like.dtype
        return torch.zeros(max(chunks), shape[1], dtype=dtype, device=like.device), chunks

    def _finish_gather(self, i, pending, s):
        geo = self._geo
        if geo.S == 1:
            return pending
        recv, work = pending
        work.wait()
        if geo.s != s:
            return None
        chunks = geo.block[i][1]
        return torch.cat([b[:n] for b, n in zip(recv, chunks, strict=True)])

    def _orthogonalize_block(self, i, block, t, mode):
        """The owning TP group's NS of matrix i from its TP blocks (this rank's block in, its block out)."""
        from ..split_ns import orthogonalize_distributed

        geo, plan = self._geo, self.plan
        kwargs = {**self.ns.kwargs(), "method": batch_method(plan, self._batch_of(i))}
        if mode == "whole" or geo.T == 1:
            self.ns_matrices += 1
            return self._ns(block[None], kwargs["method"])[0]
        c = plan.tp_choices[i]
        if mode == "group":
            self.ns_matrices += geo.t == 0
            return orthogonalize_distributed(block, group=geo.tp_group, tall=c.tall, timeout_s=self.timeout_s,
                                             **kwargs)
        wire = self._wire(block).contiguous()
        parts = [torch.empty_like(wire) for _ in range(geo.T)] if geo.t == t else None
        dist.gather(wire, parts, group_dst=t, group=geo.tp_group)
        back = [None] * geo.T
        if geo.t == t:
            full = torch.cat(parts, dim=c.shard_dim).to(block.dtype)
            u = self._ns(full[None], kwargs["method"])[0]
            self.ns_matrices += 1
            back = [self._wire(x).contiguous() for x in u.chunk(geo.T, dim=c.shard_dim)]
        out = torch.empty_like(wire)
        dist.scatter(out, back if geo.t == t else None, group_src=t, group=geo.tp_group)
        return out

    def _batch_of(self, i):
        if getattr(self, "_batch_index", None) is None:
            self._batch_index = {j: b for b in self.plan.batches for j in b.members}
        return self._batch_index[i]

    def _scatter_rows(self, i, block, s, like):
        geo = self._geo
        if geo.S == 1:
            return block
        out, chunks = self._row_buffer(i, like)
        parts = None
        if geo.s == s:
            parts, pos = [], 0
            for n in chunks:
                part = torch.zeros_like(out)
                part[:n].copy_(block[pos:pos + n])
                parts.append(part)
                pos += n
        return out, chunks[geo.s], dist.scatter(out, parts, group_src=s, group=geo.shard_group, async_op=True)

    def _finish_scatter(self, pending):
        if self._geo.S == 1:
            return pending
        out, n, work = pending
        work.wait()
        return out[:n]


class TPNaiveSteps(_TPMixin):
    """NaiveMuon's TP steps ("duplicated"): every rank gathers every matrix and orthogonalizes it."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._tp_geometry()

    def _muon_update(self, has_any: torch.Tensor, pending) -> None:
        if self.plan is None:
            return
        from torch.distributed.tensor import DTensor

        geo, group = self._geo, self.param_groups[0]
        idx = self._active(has_any)
        fulls = []
        for i in idx:
            p = self.params[i]
            x = self._momentum(i, group)
            wire = x if self.comm_dtype is None else x.to(self.comm_dtype)
            d = DTensor.from_local(wire, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride())
            fulls.append(d.full_tensor().to(p.dtype))
        out = self._ns_many(fulls)
        self.ns_matrices += len(idx)
        self._apply_tp([(i, geo.local_of(i, u)) for i, u in zip(idx, out, strict=True)], group)
