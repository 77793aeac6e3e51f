"""Sharded checkpoints of a model and its DMuon / NaiveMuon optimizer with `torch.distributed.checkpoint`
(DCP), for every layout, loadable at another world size. See docs/fsdp.md.

    dmuon.save_checkpoint(path, model, opt)     # every rank; each writes only what it holds
    dmuon.load_checkpoint(path, model, opt)     # a fresh model + optimizer, any world size

What each rank contributes (DCP keys "model.<param>" and "optim.state.<param>.<key>"):
  DTensor (FSDP2) parameters and their state    DTensors: DCP re-shards them on load
  Muon matrices of the owner layouts             the owner's copy of the weight and its momentum, as
                                                 plain tensors: nobody else writes them
  replicated tensors                             plain tensors, written once (DCP de-duplicates)
  ZeRO pieces (replicated layout, sharded AdamW) "<key>@<lo>:<hi>": elements [lo, hi) of the flattened
                                                 state; on load each rank reads the saved pieces that
                                                 overlap its new range (found in the checkpoint metadata)
  step counts, hyperparameters, step counters    Python values (written once)
  expert parameters and their momentum (ep > 1)  DTensors of every EP rank's experts (`ExpertMuon.as_global`:
                                                 replicated over the replica group, Shard(0) over the EP
                                                 ranks); the momentum of each local expert gathered from
                                                 its owner first; on load each owner keeps its rows
On load every rank requests what *its* plan makes it update: a matrix's momentum goes to the matrix's new
owner, whoever saved it; the owners' weights are then published to every rank. Nothing is gathered.
"""

from __future__ import annotations

import json

import torch

from ..errors import InputError
from .fsdp import is_dtensor, local_tensor
from .units import AllReduceUnit, OwnerUnit

FORMAT = "dmuon.dcp/1"
TENSOR_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def _as_dtensor(t: torch.Tensor, like) -> torch.Tensor:
    """A local shard `t` (same local shape as `like`'s) as a DTensor placed like the parameter."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def updated_ranges(opt) -> dict[int, tuple[int, int] | None]:
    """Parameter index -> what this rank updates: None (the whole parameter, or the local shard of a
    DTensor) or (lo, hi), a flat range of it (ZeRO piece)."""
    out: dict[int, tuple[int, int] | None] = {}
    for i in range(len(opt.params)):
        if opt.local[i]:
            out[i] = None
    for u in opt.units:
        if isinstance(u, AllReduceUnit):
            for m in u.members:
                out[m.index] = None
        elif isinstance(u, OwnerUnit):
            for k, lo, hi in u.pieces:
                p = u.members[k].param
                out[u.members[k].index] = None if (lo, hi) == (0, p.numel()) else (lo, hi)
    if opt.plan is not None and not opt._muon_units:  # fsdp2-sharded: every rank, local shards
        for i in range(opt.n_muon):
            out[i] = None
    return out


def _owned_muon(opt) -> set[int]:
    """Muon matrices whose weight this rank writes / reads in an owner layout (owners publish them)."""
    if opt.plan is None or not opt._muon_units or not opt.owner_centric:
        return set(range(opt.n_muon)) if opt.n_muon else set()
    return {i for i in range(opt.n_muon) if opt.plan.owners[i] == opt.rank}


# ---- save ----------------------------------------------------------------------------------------
def model_state_dict(model, opt) -> dict:
    """The model's state for DCP: owner layouts keep only this rank's Muon matrices."""
    res = getattr(opt, "_residency", None)
    if res is not None:
        res.suspended = True
    try:
        sd = model.state_dict()
    finally:
        if res is not None:
            res.suspended = False
    if opt.owner_centric and opt._muon_units and opt.plan is not None:
        mine = _owned_muon(opt)
        skip = {opt.names[i] for i in range(opt.n_muon) if i not in mine}
        sd = {k: v for k, v in sd.items() if k not in skip}
    for i in _experts(opt):  # every rank's own experts: one global tensor
        sd[opt.names[i]] = opt.experts.as_global(opt.params[i].detach())
    return sd


def optimizer_state_dict(opt) -> dict:
    """The optimizer's state for DCP (see the module docstring)."""
    opt.synchronize_exchanges()
    state = {}
    experts = set(_experts(opt))
    for i in sorted(experts):  # collective: every rank, every expert parameter
        full = opt.experts.full_momentum(i)
        state[opt.names[i]] = {"momentum_buffer": opt.experts.as_global(full)}
    for i, p in enumerate(opt.params):
        st = opt.state.get(p)
        if not st or i in experts:
            continue
        entry = {}
        piece = st.get("shard")
        for key in TENSOR_KEYS:
            if key in st:
                t = st[key]
                if opt.local[i]:
                    entry[key] = _as_dtensor(t, p)
                elif piece is not None:
                    entry[f"{key}@{piece[0]}:{piece[1]}"] = t
                else:
                    entry[key] = t
        if "step" in st:
            entry["step"] = int(st["step"])
        state[opt.names[i]] = entry
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names", "layouts")}
              for g in opt.param_groups]
    meta = {"format": FORMAT, "optimizer": type(opt).__name__, "layout": opt.layout,
            "param_groups": json.dumps(groups), "steps": opt._steps, "skipped_steps": opt.skipped_steps}
    return {"meta": meta, "state": state}


def _experts(opt) -> list[int]:
    """Indices of the expert parameters (ep > 1; `dmuon.runtime.ep`)."""
    return list(range(opt.expert_first, len(opt.params))) if getattr(opt, "experts", None) else []


def state_dict(model, opt) -> dict:
    return {"model": model_state_dict(model, opt), "optim": optimizer_state_dict(opt)}


def save_checkpoint(path, model, opt, **dcp_kwargs) -> None:
    """Save model + optimizer with DCP into `path` (a directory); every rank must call it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict(model, opt), checkpoint_id=path, **dcp_kwargs)


# ---- load ----------------------------------------------------------------------------------------
def _saved_keys(path, storage_reader=None) -> dict:
    import torch.distributed.checkpoint as dcp

    reader = storage_reader or dcp.FileSystemReader(path)
    try:
        return reader.read_metadata().state_dict_metadata
    except (FileNotFoundError, NotADirectoryError) as e:
        raise InputError(f"{path}: no torch.distributed.checkpoint metadata there ({e}); accepted: a "
                         "directory written by dmuon.save_checkpoint") from None


def _request(opt, saved: dict) -> tuple[dict, list]:
    """The optimizer part of the load request, and how to install it (list of (i, key, how, value))."""
    ranges = updated_ranges(opt)
    muon_owned = _owned_muon(opt)
    state, todo = {}, []
    experts = set(_experts(opt))
    for i in sorted(experts):
        key = f"optim.state.{opt.names[i]}.momentum_buffer"
        if key in saved:
            t = opt.experts.as_global(torch.zeros_like(opt.params[i]))
            state[opt.names[i]] = {"momentum_buffer": t}
            todo.append((i, "momentum_buffer", "expert", t))
    for i, p in enumerate(opt.params):
        if i not in ranges or i in experts or (i < opt.n_muon and i not in muon_owned):
            continue
        name, rng = opt.names[i], ranges[i]
        prefix = f"optim.state.{name}."
        entry = {}
        keys = ["momentum_buffer"] if i < opt.n_muon else ["exp_avg", "exp_avg_sq"]
        for key in keys:
            if opt.local[i]:
                if prefix + key in saved:
                    t = _as_dtensor(torch.zeros_like(local_tensor(p)), p)
                    entry[key] = t
                    todo.append((i, key, "local", t))
                continue
            lo, hi = rng if rng is not None else (0, p.numel())
            if prefix + key in saved:  # saved whole
                t = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
                entry[key] = t
                todo.append((i, key, ("slice", lo, hi, rng is None), t))
                continue
            parts = []
            for k in saved:
                if k.startswith(prefix + key + "@"):
                    a, b = (int(x) for x in k[len(prefix + key) + 1:].split(":"))
                    if a < hi and b > lo:
                        t = torch.zeros(b - a, dtype=p.dtype, device=p.device)
                        entry[k[len(prefix):]] = t
                        parts.append((a, b, t))
            if parts:
                todo.append((i, key, ("pieces", lo, hi, rng is None), parts))
        if prefix + "step" in saved:
            entry["step"] = 0
        if entry:
            state[name] = entry
    return state, todo


def _install(opt, state: dict, todo: list) -> None:
    opt.state.clear()
    for i, key, how, value in todo:
        p = opt.params[i]
        if how == "expert":
            opt.experts.install_momentum(i, value.to_local())
            continue
        if how == "local":
            t = value.to_local()
        else:
            kind, lo, hi, whole = how
            if kind == "slice":
                t = value.reshape(-1)[lo:hi]
            else:
                t = torch.empty(hi - lo, dtype=p.dtype, device=p.device)
                covered = 0
                for a, b, part in value:
                    x, y = max(a, lo), min(b, hi)
                    t[x - lo:y - lo].copy_(part[x - a:y - a])
                    covered += y - x
                if covered != hi - lo:
                    raise InputError(f"checkpoint: the saved pieces of {opt.names[i]}.{key} cover "
                                     f"{covered} of the {hi - lo} elements this rank needs; the checkpoint "
                                     "is incomplete")
            t = t.reshape(p.shape) if whole else t.clone()
        st = opt.state[p]
        st[key] = t.clone()
        if how != "local" and not how[3]:
            st["shard"] = (how[1], how[2])
    for name, entry in state.items():
        if "step" in entry:
            i = opt.names.index(name)
            if opt.state[opt.params[i]]:
                opt.state[opt.params[i]]["step"] = int(entry["step"])


def load_checkpoint(path, model, opt, storage_reader=None, **dcp_kwargs) -> None:
    """Load what `save_checkpoint` wrote into a fresh model + optimizer (any world size and layout whose
    parameter names match); every rank must call it. Owners' weights are then published."""
    import torch.distributed.checkpoint as dcp

    saved = _saved_keys(path, storage_reader)
    if "optim.meta.format" not in saved:
        raise InputError(f"{path}: not a dmuon checkpoint (no optim.meta entry); accepted: a directory "
                         "written by dmuon.save_checkpoint")
    opt.synchronize_exchanges()
    model_sd = model_state_dict(model, opt)
    missing = [k for k in model_sd if f"model.{k}" not in saved]
    if missing:
        raise InputError(f"{path}: the checkpoint has no entry for model parameters {missing[:5]}; accepted: "
                         "a checkpoint of a model with the same parameter names")
    optim, todo = _request(opt, saved)
    meta = {"format": "", "optimizer": "", "layout": "", "param_groups": "", "steps": 0, "skipped_steps": 0}
    request = {"model": model_sd, "optim": {"meta": meta, "state": optim}}
    kwargs = dict(dcp_kwargs)
    if storage_reader is not None:
        kwargs["storage_reader"] = storage_reader
    dcp.load(request, checkpoint_id=path, **kwargs)
    if meta["format"] != FORMAT:
        raise InputError(f"{path}: checkpoint format {meta['format']!r}; accepted: {FORMAT!r}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in model_sd.items():  # DCP loads in place; copy where state_dict() returned copies
            target, v = params.get(k), local_tensor(v)  # experts: their DTensor's local stack
            if target is not None and not is_dtensor(target) and target.data_ptr() != v.data_ptr():
                target.copy_(v)
    _install(opt, optim, todo)
    for g, saved_g in zip(opt.param_groups, json.loads(meta["param_groups"]), strict=False):
        g.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved_g.items()
                  if k in g and k not in ("params", "param_names", "use_muon")})
    opt._steps, opt.skipped_steps = int(meta["steps"]), int(meta["skipped_steps"])
    opt.publish_owned()
