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

As which matrices (`Route.layout`, a `dmuon.matrices.MatrixLayout`; `Route.matrices` names them): one rule,
`decide(name, shape, kind)`, that the optimizers and the simulator's config.json reader
(`simulator.models.hf_config`) both call, so the simulator prices the matrices the runtime runs:
  3-D `.experts.` parameters   fused MoE experts (E, out, in): E matrices; a fused gate / up
                               (`gate_up_proj`, `w13`) 2 per expert (rows [0, I) gate, [I, 2I) up)
  routers                      a module named `gate` / `router` (the MoE router, E x hidden) or
                               `*expert_gate` (Qwen2-MoE's shared-expert gate): AdamW
  fused QKV                    `qkv_proj` (Phi-3: rows [q | k | v], sizes from the attention shape) and
                               GPT-2's `c_attn` (a Conv1D stored (in, out): column blocks q, k, v)
  fused dense gate / up        a 2-D `gate_up_proj` (Phi-3): rows [gate | up]
  per_head=True (off by default)  q / k / v (and fused QKV's parts) in head_dim row blocks, o_proj (and
                               GPT-2's attention c_proj, stored (in, out): row blocks) in head_dim
                               column blocks
The attention shape (heads, kv heads, head_dim) comes from `attention=` or the model's `config`
(Hugging Face models carry one). Other >2-D parameters stay AdamW unless a predicate opts them in (then
viewed (shape[0], -1) as one matrix). `DMuon(..., warn_no_muon=True)` warns about every parameter of 3
or more dims that goes to AdamW.

Used by `dmuon.Muon` (and the distributed optimizers) to build param groups, and by FSDP2 set-ups
through `muon_params(model)`. torch is imported by the functions that take modules or tensors (`route`), not
with this module: the simulator's config.json reader calls `decide` and `attention_shape` without torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InputError
from .matrices import MatrixLayout

if TYPE_CHECKING:
    import torch
    from torch import nn

HEAD_NAMES = frozenset({"lm_head", "output", "head", "classifier", "embed_out"})
Predicate = Callable[[str, "torch.Tensor"], bool]


@dataclass(frozen=True)
class Route:
    """One parameter's routing decision and why."""

    name: str
    param: torch.Tensor
    use_muon: bool
    reason: str
    layout: MatrixLayout | None = None  # the matrices Muon runs (None: AdamW)

    @property
    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, rows, cols) of every matrix Muon runs for this parameter; [] for AdamW."""
        if not self.use_muon or self.layout is None:
            return []
        return list(zip(self.layout.matrix_names(self.name), *zip(*self.layout.shapes, strict=True),
                        strict=True))


def _name_says_embedding(name: str) -> bool:
    """The parameter's own name or its module's name mentions "embed" (pos_embed, embed_tokens.weight)."""
    return any("embed" in part.lower() for part in name.split(".")[-2:])


def _name_says_head(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in HEAD_NAMES


ROUTER_NAMES = frozenset({"gate", "router"})  # a MoE layer's router module (E x hidden)
EXPERT_GATE_UP = frozenset({"gate_up_proj", "w13"})  # fused expert gate / up (E, 2I, H)
FUSED_QKV = frozenset({"qkv_proj", "c_attn"})
PER_HEAD_ROWS = frozenset({"q_proj", "k_proj", "v_proj"})
PER_HEAD_COLS = frozenset({"o_proj"})
KINDS = (None, "linear", "conv1d", "embedding", "tied", "head")


@dataclass(frozen=True)
class AttentionShape:
    """What cutting fused QKV and per-head matrices needs: query heads, key / value heads, head_dim."""

    heads: int
    kv_heads: int
    head_dim: int
    mla: bool = False  # multi-head latent attention (DeepSeek): its projections are not cut per head


def attention_shape(config) -> AttentionShape | None:
    """The attention shape of a model config (a transformers config object or a config.json dict), or None
    where it names no heads: num_attention_heads (GPT-2: n_head), num_key_value_heads (default: the heads),
    head_dim (default: hidden_size (n_embd) / heads)."""
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    heads = get("num_attention_heads") or get("n_head")
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim")
    if not isinstance(head_dim, int) or head_dim < 1:
        hidden = get("hidden_size") or get("n_embd")
        if not isinstance(hidden, int) or hidden % heads:
            return None
        head_dim = hidden // heads
    return AttentionShape(heads, kv, head_dim, get("kv_lora_rank") is not None)


def _leaf(name: str) -> tuple[str, str]:
    """(the module's own name, its parent's) of a parameter name: 'a.b.q_proj.weight' -> ('q_proj', 'b');
    a parameter held directly ('mlp.experts.gate_up_proj') -> ('gate_up_proj', 'experts')."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return parts[-1], (parts[-2] if len(parts) >= 2 else "")


def _heads(name: str, side: int, attention: AttentionShape | None, what: str) -> tuple[int, ...]:
    if attention is None:
        raise InputError(f"{name}: {what} needs the attention shape; pass "
                         "attention=dmuon.params.AttentionShape(heads, kv_heads, head_dim) (a model with a "
                         "Hugging Face `config` gives it)")
    hd = attention.head_dim
    if side % hd:
        raise InputError(f"{name}: {side} is not a multiple of head_dim {hd} ({what})")
    return (hd,) * (side // hd)


def decide(name: str, shape, kind: str | None = None, *, per_head: bool = False,
           attention: AttentionShape | None = None) -> tuple[bool, str, MatrixLayout | None]:
    """The one routing rule (module docstring): (Muon or not, why, as which matrices) of a parameter from
    its name, shape and module kind (None / 'linear': any module, 'conv1d': a transformers Conv1D stored
    (in, out), 'embedding', 'tied' (tied to an embedding), 'head' (the output head)). Raises InputError
    for a fused or per-head parameter it cannot cut (no attention shape, sizes that do not add up)."""
    shape = tuple(int(x) for x in shape)
    if kind not in KINDS:
        raise InputError(f"unknown parameter kind {kind!r}; accepted: {KINDS}")
    if kind == "embedding":
        return False, "embedding", None
    if kind == "tied":
        return False, "tied to an embedding", None
    if kind == "head":
        return False, "output head", None
    if len(shape) < 2:
        return False, f"{len(shape)}-D parameter", None
    if math.prod(shape) == 0:
        return False, "empty matrix (nothing to orthogonalize)", None
    if _name_says_head(name):
        return False, "output head (by name)", None
    if _name_says_embedding(name):
        return False, "embedding (by name)", None
    leaf, parent = _leaf(name)
    if leaf in ROUTER_NAMES or leaf.endswith("expert_gate"):
        return False, "MoE router (by name)", None
    if len(shape) >= 3:
        if len(shape) == 3 and EXPERT_MARK in f".{name}":
            E, R, C = shape
            if leaf in EXPERT_GATE_UP and R % 2 == 0:
                return True, f"fused experts: {E} x (gate, up)", MatrixLayout(
                    shape, E, 0, (R // 2, R // 2), ("gate_proj", "up_proj"))
            return True, f"fused experts: {E} matrices", MatrixLayout(shape, E, 0, (R,), ("",))
        return False, f"{len(shape)}-D parameter", None
    rows, cols = shape
    conv = kind == "conv1d"
    if leaf in FUSED_QKV:
        if leaf == "c_attn" and conv:  # GPT-2: (in, 3 out), column blocks q, k, v
            side, axis = cols, 1
            sizes = _heads(name, side, attention, "per-head c_attn") if per_head else (cols // 3,) * 3
            if not per_head and cols % 3:
                raise InputError(f"{name}: c_attn's {cols} outputs do not split into q, k, v")
        elif leaf == "qkv_proj":
            side, axis = rows, 0
            if attention is None:
                _heads(name, side, None, "splitting fused QKV")
            q, kv = attention.heads * attention.head_dim, attention.kv_heads * attention.head_dim
            if q + 2 * kv != rows:
                raise InputError(f"{name}: {rows} rows are not q + k + v = {q} + {kv} + {kv} of the "
                                 f"attention shape {attention}")
            sizes = _heads(name, side, attention, "per-head QKV") if per_head else (q, kv, kv)
        else:
            return True, "hidden matrix", MatrixLayout.whole(shape)
        if per_head:
            n_q = (attention.heads if leaf == "qkv_proj" else len(sizes) // 3)
            n_kv = (len(sizes) - n_q) // 2
            names = tuple([f"q.h{h}" for h in range(n_q)] + [f"k.h{h}" for h in range(n_kv)]
                          + [f"v.h{h}" for h in range(n_kv)])
            return (True, f"fused QKV, per head ({len(sizes)} matrices)",
                    MatrixLayout(shape, 1, axis, sizes, names))
        return True, "fused QKV: q, k, v", MatrixLayout(shape, 1, axis, sizes, ("q", "k", "v"))
    if leaf in EXPERT_GATE_UP and rows % 2 == 0:
        return True, "fused gate / up", MatrixLayout(shape, 1, 0, (rows // 2,) * 2, ("gate", "up"))
    if per_head and not (attention is not None and attention.mla):
        attn_out = leaf in PER_HEAD_COLS or (conv and leaf == "c_proj" and parent == "attn")
        if leaf in PER_HEAD_ROWS or attn_out:
            rows_cut = leaf in PER_HEAD_ROWS or conv  # a Conv1D stores (in, out): its input side is rows
            side = rows if rows_cut else cols
            sizes = _heads(name, side, attention, "per-head orthogonalization")
            return True, f"per head ({len(sizes)} matrices)", MatrixLayout(
                shape, 1, 0 if rows_cut else 1, sizes, tuple(f"h{h}" for h in range(len(sizes))))
    return True, "hidden matrix", MatrixLayout.whole(shape)


def _apply_predicate(name: str, p: torch.Tensor, default: tuple, predicate: Predicate | None) -> Route:
    if predicate is None:
        return Route(name, p, *default)
    decision = predicate(name, p)
    if not isinstance(decision, bool):
        raise TypeError(f"muon_predicate must return a bool, got {type(decision).__name__} for {name!r}")
    if not decision:
        return Route(name, p, False, "muon_predicate")
    # the predicate opts in: the rule's matrices where it has them, else the parameter as one matrix
    layout = default[2] if default[0] else MatrixLayout.whole(p.shape) if p.dim() >= 2 else None
    return Route(name, p, True, "muon_predicate", layout)


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2 family): a linear layer stored (in, out)."""
    return type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None and m.weight.dim() == 2


def _module_routes(module: nn.Module, predicate: Predicate | None, per_head: bool,
                   attention: AttentionShape | None) -> list[Route]:
    from torch import nn

    embedding_types = (nn.Embedding, nn.EmbeddingBag)
    embeddings = [m for m in module.modules() if isinstance(m, embedding_types)]
    vocab_sizes = {m.num_embeddings for m in embeddings}
    embedding_weights = {id(m.weight) for m in embeddings}
    linears = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    head_ids = {id(m.weight) for n, m in linears if n.split(".")[-1] in HEAD_NAMES}
    by_vocab = [m for _, m in linears if m.out_features in vocab_sizes]
    if by_vocab:
        head_ids.add(id(by_vocab[-1].weight))
    if attention is None:
        attention = attention_shape(getattr(module, "config", None))

    # a parameter shared by several modules is routed once, under its first name
    kinds: dict[int, str] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if isinstance(m, embedding_types):
                kinds.setdefault(id(p), "embedding")
            elif id(p) in embedding_weights:
                kinds.setdefault(id(p), "tied")
            elif id(p) in head_ids:
                kinds.setdefault(id(p), "head")
            elif _is_conv1d(m) and p is m.weight:
                kinds.setdefault(id(p), "conv1d")
    routes = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        default = decide(name, p.shape, kinds.get(id(p)), per_head=per_head, attention=attention)
        routes.append(_apply_predicate(name, p, default, predicate))
    return routes


def route(params_or_module, predicate: Predicate | None = None, *, per_head: bool = False,
          attention: AttentionShape | None = None) -> list[Route]:
    """Routing decisions for a module, (name, param) pairs, or plain params (see module docstring):
    per_head cuts attention matrices per head; attention: the shape that cutting needs (a module's
    `config` gives it where it has one)."""
    import torch
    from torch import nn

    if predicate is not None and not callable(predicate):
        raise TypeError(f"muon_predicate must be callable (name, param) -> bool, "
                        f"got {type(predicate).__name__}")
    if not isinstance(per_head, bool):
        raise InputError(f"per_head must be True or False, got {per_head!r}")
    if attention is not None and not isinstance(attention, AttentionShape):
        raise InputError("attention must be a dmuon.params.AttentionShape or None, got "
                         f"{type(attention).__name__}")
    if isinstance(params_or_module, nn.Module):
        return _module_routes(params_or_module, predicate, per_head, attention)
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
        default = decide(name, p.shape, per_head=per_head, attention=attention)
        routes.append(_apply_predicate(name, p, default, predicate))
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
    def matrices(r: Route) -> str:
        if not r.use_muon or r.layout is None or r.layout.is_whole:
            return ""
        shapes = sorted(set(r.layout.shapes))
        return f" -> {r.layout.count} matrices of " + ", ".join(f"{a}x{b}" for a, b in shapes)

    return "\n".join(f"{r.name:<{width}}  {tuple(r.param.shape)!s:<16} "
                      f"{'muon' if r.use_muon else 'adamw':<6} {r.reason}{matrices(r)}" for r in rows)
