"""Parameter routing: which parameters Muon optimizes and which go to AdamW.

Muon is for hidden 2-D weight matrices. Everything else goes to AdamW: parameters that are not 2-D
(biases, norm scales, conv / >2-D weights unless a predicate opts them in), nn.Embedding /
nn.EmbeddingBag weights and weights tied to them, the output head, and 2-D parameters whose own or
module's name contains "embed" (pos_embed). The output head is the last nn.Linear whose out_features
equals some embedding's num_embeddings, or any nn.Linear named lm_head / output / head / classifier /
embed_out (for (name, param) pairs: a parameter whose module part of the name is one of those).

Inputs accepted everywhere (`route`):
  an nn.Module             full rules above (module types, tying, head detection); frozen params
                           (requires_grad False) are left out
  (name, param) pairs      e.g. module.named_parameters(): the rules that need only names and shapes
  plain params             2-D -> Muon, the rest -> AdamW; names are synthesized as "params.<i>"
A predicate `muon_predicate(name, param) -> bool` replaces the default decision for every parameter.

Used by `dmuon.Muon` (and the distributed optimizers) to build param groups, and by FSDP2 set-ups
through `muon_params(model)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

HEAD_NAMES = frozenset({"lm_head", "output", "head", "classifier", "embed_out"})
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
Predicate = Callable[[str, torch.Tensor], bool]


@dataclass(frozen=True)
class Route:
    """One parameter's routing decision and why."""

    name: str
    param: torch.Tensor
    use_muon: bool
    reason: str


def _name_says_embedding(name: str) -> bool:
    """The parameter's own name or its module's name mentions "embed" (pos_embed, embed_tokens.weight)."""
    return any("embed" in part.lower() for part in name.split(".")[-2:])


def _name_says_head(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in HEAD_NAMES


def _default_reason(name: str, p: torch.Tensor) -> tuple[bool, str]:
    """Rules that need only a name and a shape."""
    if p.dim() != 2:
        return False, f"{p.dim()}-D parameter"
    if p.numel() == 0:
        return False, "empty matrix (nothing to orthogonalize)"
    if _name_says_head(name):
        return False, "output head (by name)"
    if _name_says_embedding(name):
        return False, "embedding (by name)"
    return True, "hidden matrix"


def _apply_predicate(name: str, p: torch.Tensor, default: tuple[bool, str],
                     predicate: Predicate | None) -> Route:
    if predicate is None:
        return Route(name, p, *default)
    decision = predicate(name, p)
    if not isinstance(decision, bool):
        raise TypeError(f"muon_predicate must return a bool, got {type(decision).__name__} for {name!r}")
    return Route(name, p, decision, "muon_predicate")


def _module_routes(module: nn.Module, predicate: Predicate | None) -> list[Route]:
    embeddings = [m for m in module.modules() if isinstance(m, EMBEDDING_TYPES)]
    vocab_sizes = {m.num_embeddings for m in embeddings}
    embedding_weights = {id(m.weight) for m in embeddings}
    linears = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    head_ids = {id(m.weight) for n, m in linears if n.split(".")[-1] in HEAD_NAMES}
    by_vocab = [m for _, m in linears if m.out_features in vocab_sizes]
    if by_vocab:
        head_ids.add(id(by_vocab[-1].weight))

    # a parameter shared by several modules is routed once, under its first name
    special: dict[int, str] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if isinstance(m, EMBEDDING_TYPES):
                special.setdefault(id(p), "embedding")
            elif id(p) in embedding_weights:
                special.setdefault(id(p), "tied to an embedding")
            elif id(p) in head_ids:
                special.setdefault(id(p), "output head")
    routes = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in special:
            default = (False, special[id(p)])
        else:
            default = _default_reason(name, p)
        routes.append(_apply_predicate(name, p, default, predicate))
    return routes


def route(params_or_module, predicate: Predicate | None = None) -> list[Route]:
    """Routing decisions for a module, (name, param) pairs, or plain params (see module docstring)."""
    if predicate is not None and not callable(predicate):
        raise TypeError(f"muon_predicate must be callable (name, param) -> bool, "
                        f"got {type(predicate).__name__}")
    if isinstance(params_or_module, nn.Module):
        return _module_routes(params_or_module, predicate)
    if isinstance(params_or_module, torch.Tensor):
        params_or_module = [params_or_module]
    if isinstance(params_or_module, (set, frozenset)):
        raise TypeError("parameters must come in an ordered collection (list, tuple, generator), not a set: "
                        "the order fixes state_dict indices")
    if not isinstance(params_or_module, Iterable):
        raise TypeError("expected an nn.Module, an iterable of parameters, or of (name, parameter) pairs; "
                        f"got {type(params_or_module).__name__}")
    routes = []
    seen: set[int] = set()
    for i, item in enumerate(params_or_module):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, p = item
        else:
            name, p = f"params.{i}", item
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"expected parameters (tensors) or (name, parameter) pairs; item {i} is "
                            f"{type(p).__name__}")
        if id(p) in seen:
            continue
        seen.add(id(p))
        routes.append(_apply_predicate(name, p, _default_reason(name, p), predicate))
    return routes


EXPERT_MARK = ".experts."


def is_expert_param(name: str, param: torch.Tensor) -> bool:
    """An expert parameter of a MoE model (3-D (E_local, out, in), a name holding '.experts.'): under expert
    parallelism (`DMuon(model, ep=E)`) E_local Muon matrices, held by one EP rank; else routed as any 3-D
    parameter (AdamW)."""
    return param.dim() == 3 and EXPERT_MARK in name


def muon_params(model, predicate: Predicate | None = None) -> list[torch.Tensor]:
    """The parameters Muon optimizes (the hidden matrices), in `model.named_parameters()` order."""
    return [r.param for r in route(model, predicate) if r.use_muon]


def adamw_params(model, predicate: Predicate | None = None) -> list[torch.Tensor]:
    """The parameters AdamW optimizes: everything `muon_params` leaves out (frozen ones excluded)."""
    return [r.param for r in route(model, predicate) if not r.use_muon]


def routing_table(model, predicate: Predicate | None = None) -> str:
    """A human-readable table of the routing: one line per parameter."""
    rows = route(model, predicate)
    width = max((len(r.name) for r in rows), default=4)
    return "\n".join(f"{r.name:<{width}}  {tuple(r.param.shape)!s:<16} "
                     f"{'muon' if r.use_muon else 'adamw':<6} {r.reason}" for r in rows)
