"""FSDP2 layouts of DMuon / NaiveMuon: detection, the geometry of DTensor-sharded matrices, and
`shard_model`, which applies `fully_shard` the way each layout expects. See docs/fsdp.md.

Layouts (the `layout=` argument of DMuon / NaiveMuon; "auto" detects them from the parameters):
  replicated     no DTensor parameter: every rank holds the whole model (DDP-like; distributed.py).
  fsdp2-owner    the Muon matrices are plain tensors (passed to `fully_shard(..., ignored_params=...)`),
                 everything else is FSDP2-sharded (DTensor). The optimizer moves the Muon matrices itself
                 (reduce to owner, publish from owner); AdamW updates FSDP2's local shards.
  fsdp2-sharded  the Muon matrices are FSDP2-sharded too (DTensor, Shard(0) on a 1-D mesh, or
                 (Replicate, Shard(0)) on a 2-D HSDP mesh): `fsdp_sharded.py`.

Parameters that are DTensors are *local*: FSDP2 synchronizes their gradients, the optimizer updates the
local shard (`local_tensor`) and keeps their state on that shard.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError, choice_error

LAYOUTS = ("auto", "replicated", "fsdp2-owner", "fsdp2-sharded")
MEMORY = ("keep", "free")


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of the storage FSDP2 keeps), or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def detect_layout(routes) -> str:
    """The layout of a model from its routed parameters (see the module docstring). Expert parameters left
    out of FSDP2 (plain tensors: each EP rank's own experts, `dmuon.runtime.ep`) say nothing about it."""
    from ..params import is_expert_param

    routes = [r for r in routes if not (is_expert_param(r.name, r.param) and not is_dtensor(r.param))]
    muon = [is_dtensor(r.param) for r in routes if r.use_muon]
    other = [is_dtensor(r.param) for r in routes if not r.use_muon]
    if not any(muon) and not any(other):
        return "replicated"
    if muon and any(muon) and not all(muon):
        names = [r.name for r in routes if r.use_muon and not is_dtensor(r.param)][:3]
        raise InputError(f"some Muon matrices are FSDP2-sharded (DTensor) and some are not (e.g. {names}); "
                         "accepted: all of them sharded (layout 'fsdp2-sharded') or none of them, passed as "
                         "fully_shard(..., ignored_params=set(dmuon.muon_params(model))) (layout "
                         "'fsdp2-owner')")
    return "fsdp2-sharded" if muon and all(muon) else "fsdp2-owner"


def resolve_layout(model, layout: str, predicate=None) -> str:
    """Check a requested layout against the model; "auto" returns the detected one."""
    from ..params import route

    if layout not in LAYOUTS:
        raise choice_error("layout", layout, LAYOUTS)
    if not isinstance(model, nn.Module):
        return "replicated" if layout == "auto" else layout
    found = detect_layout(route(model, predicate))
    if layout not in ("auto", found):
        hint = {"fsdp2-owner": "apply fully_shard with ignored_params=set(dmuon.muon_params(model)) (or "
                               "dmuon.shard_model(model, layout='fsdp2-owner'))",
                "fsdp2-sharded": "apply fully_shard without ignoring the Muon matrices (or "
                                 "dmuon.shard_model(model, layout='fsdp2-sharded'))",
                "replicated": "do not apply fully_shard"}[layout]
        raise InputError(f"layout={layout!r} but the model's parameters are laid out as {found!r}; to use "
                         f"{layout!r}, {hint}")
    return found


# ---- geometry of a Shard(0) DTensor ------------------------------------------------------------
def chunk_rows(rows: int, n: int) -> list[int]:
    """Rows of each of n shards under torch.chunk semantics (what FSDP2 uses for Shard(0)): ceil(rows/n)
    each, the last ones shorter or empty."""
    c = -(-rows // n)
    return [max(0, min(c, rows - s * c)) for s in range(n)]


def mesh_of(params) -> tuple[object, bool]:
    """(the DeviceMesh shared by these DTensors, is it 2-D HSDP (Replicate, Shard(0))); InputError if the
    parameters use different meshes or placements this runtime does not handle."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, hsdp = None, False
    for name, p in params:
        pl = tuple(p.placements)
        if pl == (Shard(0),):
            two = False
        elif pl == (Replicate(), Shard(0)):
            two = True
        else:
            raise InputError(f"{name}: placements {pl} are not handled; accepted: (Shard(0),) on a 1-D mesh "
                             "(FSDP2) or (Replicate(), Shard(0)) on a 2-D mesh (HSDP), or a tensor-parallel "
                             "mesh whose TP dim is named 'tp' (docs/runtime.md, Tensor parallelism)")
        if mesh is None:
            mesh, hsdp = p.device_mesh, two
        elif p.device_mesh != mesh:
            raise InputError(f"{name} lives on a different device mesh than the other Muon matrices; "
                             "accepted: one mesh for every Muon matrix")
    return mesh, hsdp


def mesh_node_size(model) -> int | None:
    """For an HSDP (2-D) model: the shard-dim size when global rank = replica * S + shard (then the owner
    layout's two-level exchange runs intra-replica first); None otherwise."""
    for p in model.parameters():
        if is_dtensor(p) and p.device_mesh.ndim == 2:
            m = p.device_mesh.mesh
            if torch.equal(m.flatten(), torch.arange(m.numel())):
                return int(m.shape[1])
            return None
    return None


def fsdp_owner_module(model: nn.Module, param: torch.Tensor) -> nn.Module | None:
    """The nearest fully_shard-ed module whose subtree holds `param` (it all-gathers it in forward)."""
    from torch.distributed.fsdp import FSDPModule

    best = None
    for _, module in model.named_modules():
        if isinstance(module, FSDPModule) and any(p is param for p in module.parameters()):
            best = module  # named_modules is pre-order: a later hit is deeper
    return best


# ---- applying FSDP2 ----------------------------------------------------------------------------
def shard_model(model: nn.Module, layout: str = "fsdp2-owner", *, mesh=None, reshard_after_forward=True,
                blocks=None, muon_predicate=None, ep: int = 1) -> nn.Module:
    """Apply `fully_shard` to each block and to the root, as `layout` expects (in place; returns model).

    layout 'fsdp2-owner': the Muon matrices (`dmuon.muon_params(model, muon_predicate)`) are passed as
    ignored_params, so they stay plain replicated tensors; 'fsdp2-sharded': everything is sharded. mesh:
    a 1-D DeviceMesh (FSDP) or a 2-D one (HSDP: replicate x shard); None: 1-D over the world.
    blocks: the modules to shard one by one (default: the children of every nn.ModuleList).
    ep > 1 (expert parallelism, `DMuon(model, ep=E)`): the expert parameters (`dmuon.params.is_expert_param`)
    are ignored too in both layouts: each rank holds its own experts.
    """
    from torch.distributed.fsdp import fully_shard

    from ..params import is_expert_param, muon_params

    if layout not in ("fsdp2-owner", "fsdp2-sharded"):
        raise choice_error("layout", layout, ("fsdp2-owner", "fsdp2-sharded"))
    ignored = set(muon_params(model, muon_predicate)) if layout == "fsdp2-owner" else set()
    if ep > 1:
        ignored |= {p for n, p in model.named_parameters() if is_expert_param(n, p)}
    ignored = ignored or None
    if blocks is None:
        blocks = [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]
    opts = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    for b in blocks:
        fully_shard(b, **opts)
    fully_shard(model, **opts)
    return model
