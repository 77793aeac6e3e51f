"""Single-device Muon (with AdamW for the non-matrix parameters) and its reusable functional pieces.

Functional pieces (the distributed optimizers call these on the matrices a rank owns):
  lr_scale(shape, adjust_lr)                          per-matrix learning-rate multiplier
  muon_momentum_(grad, buf, momentum, nesterov)       buf = mu buf + g; returns the NS input
  muon_apply_(param, update, lr, weight_decay, scale) W *= 1 - lr wd; W -= lr scale U
  muon_apply_many_(params, updates, lr, weight_decay, scales)   the same on lists (foreach calls)
  adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, ...)   bias-corrected AdamW, decoupled wd
                                                      (torch's fused kernel where it has one)
  nonfinite_names(names, grads)                       which gradients hold NaN / inf (dmuon.nonfinite)

`Muon.step` = collect grads -> (non-finite check) -> AdamW groups -> momentum -> `orthogonalize_many`
(one batched NS call per shape) -> apply. The update rule is muon.md's:
  buf <- mu buf + G;  inp <- G + mu buf (Nesterov) or buf;  U <- NS(inp)
  W <- W (1 - lr wd);  W <- W - lr scale(m, n) U
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass

import torch

from .errors import InputError
from .matrices import MatrixLayout
from .newton_schulz import ITERATION_DTYPES, NSConfig, orthogonalize_many
from .nonfinite import nonfinite_names, storage_runs, suspect_indices  # noqa: F401 (re-exported)
from .params import route

ADJUST_LR = ("match_rms_adamw", "original")
NONFINITE = ("raise", "skip", "ignore")
MUON_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "adjust_lr")
ADAMW_KEYS = ("adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay")
GROUP_KEYS = ("params", "use_muon") + MUON_KEYS + ADAMW_KEYS


# ---- functional pieces ---------------------------------------------------------------------------
def lr_scale(shape, adjust_lr: str = "match_rms_adamw") -> float:
    """Learning-rate multiplier of a (m, n) matrix (>2-D weights count as (shape[0], rest)).

    'match_rms_adamw': 0.2 sqrt(max(m, n)) (update RMS ~ AdamW's; Moonlight / DMuon default);
    'original': sqrt(max(1, m / n)) (Keller Jordan's Muon).
    """
    shape = tuple(shape)
    if len(shape) < 2:
        raise InputError(f"lr_scale needs a matrix shape (at least 2 dims), got {shape}")
    m, n = shape[0], math.prod(shape[1:])
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr == "original":
        return math.sqrt(max(1.0, m / n))
    raise InputError(f"unknown adjust_lr {adjust_lr!r}; accepted: {', '.join(repr(a) for a in ADJUST_LR)}")


def muon_momentum_(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the momentum buffer in place (buf = momentum * buf + grad) and return the NS input:
    grad + momentum * buf (Nesterov) or buf itself (do not modify the returned tensor). One fused pass
    (grad + momentum * buf, written over buf), bitwise what `momentum_update` returns."""
    torch.add(grad, buf, alpha=momentum, out=buf)
    return muon_ns_input(grad, buf, momentum, nesterov)


def momentum_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The updated momentum buffer, momentum * buf + grad, as a new tensor or in `out` (`buf` untouched):
    bitwise what `muon_momentum_` leaves in `buf` (one fused pass)."""
    return torch.add(grad, buf, alpha=momentum, out=out)


def muon_ns_input(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The NS input from the updated buffer: grad + momentum * buf (Nesterov) or buf; written into `out`
    (any strides, e.g. a transposed slot of a batch) when given."""
    if out is None:
        return grad.add(buf, alpha=momentum) if nesterov else buf
    if nesterov:
        return torch.add(grad, buf, alpha=momentum, out=out)
    return out.copy_(buf)


def muon_apply_(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float,
                scale: float) -> None:
    """Decoupled weight decay, then the orthogonalized step: W *= 1 - lr*wd; W -= lr*scale*U.
    `update` may be the (out, -1) matrix of a >2-D param: it is reshaped to the param's shape."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if update.shape != param.shape:
        update = update.reshape(param.shape)
    param.add_(update.to(param.dtype), alpha=-lr * scale)


def muon_apply_many_(params, updates, lr: float, weight_decay: float, scales) -> None:
    """`muon_apply_` on lists (params[k] with updates[k] and scales[k]): one foreach call per distinct
    (scale, dtype, device) instead of one call per tensor; bitwise the per-tensor result (the same
    in-place ops on each tensor)."""
    groups: dict[tuple, tuple[list, list]] = {}
    for p, u, s in zip(params, updates, scales, strict=True):
        if u.shape != p.shape:
            u = u.reshape(p.shape)
        ps, us = groups.setdefault((s, p.dtype, p.device), ([], []))
        ps.append(p)
        us.append(u if u.dtype == p.dtype else u.to(p.dtype))
    for (s, *_), (ps, us) in groups.items():
        if weight_decay != 0:
            torch._foreach_mul_(ps, 1 - lr * weight_decay)
        torch._foreach_add_(ps, us, alpha=-lr * s)


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr: float, betas: tuple[float, float],
                eps: float, weight_decay: float, fused: bool | None = None) -> None:
    """AdamW on lists of tensors, in place. `steps[i]` is the step number of params[i] counting this
    one (1 on the first call). fused (None: wherever torch has it): torch's fused AdamW kernel, the one
    torch.optim.AdamW(fused=True) runs: one pass per tensor and no temporaries (on the development CPU
    ~9x faster than the op sequence over a 7.9 M-parameter model); tensors it cannot take (sparse,
    non-contiguous, mixed device or dtype in a group) and fused=False use the op sequence of
    torch.optim.AdamW(foreach=False). Both are deterministic; they agree to ~1e-9 relative (fp32)."""
    params, grads, exp_avgs, exp_avg_sqs, steps = (list(x) for x in (params, grads, exp_avgs, exp_avg_sqs,
                                                                      steps))
    rest = list(range(len(params)))
    if fused is not False and params and _FUSED_ADAMW is not None:
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            ts = (p, grads[i], exp_avgs[i], exp_avg_sqs[i])
            if all(t.layout == torch.strided and t.is_contiguous() and t.device == p.device
                   and t.dtype == p.dtype for t in ts) and p.dtype in _FUSED_DTYPES:
                groups.setdefault((p.device, p.dtype), []).append(i)
        taken = {i for idx in groups.values() for i in idx}
        rest = [i for i in rest if i not in taken]
        for (device, _), idx in groups.items():
            step_t = {}
            for i in idx:
                if steps[i] not in step_t:
                    step_t[steps[i]] = torch.tensor(float(steps[i]), dtype=torch.float32, device=device)
            _FUSED_ADAMW([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                         [exp_avg_sqs[i] for i in idx], [], [step_t[steps[i]] for i in idx], lr=lr,
                         beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False,
                         maximize=False)
    beta1, beta2 = betas
    for i in rest:
        p, g, m, v, t = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], steps[i]
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1 ** t
        bias2_sqrt = (1 - beta2 ** t) ** 0.5
        denom = (v.sqrt() / bias2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bias1)


_FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)  # torch's kernel behind AdamW(fused=True)
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# ---- checks --------------------------------------------------------------------------------------
def _check_number(name: str, v, lo: float, hi: float = math.inf, hi_open: bool = False) -> None:
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v >= lo and (
        v < hi if hi_open else v <= hi)
    if not ok:
        rng = f"in [{lo}, {hi})" if hi_open else (f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]")
        raise InputError(f"{name} must be a real number {rng}, got {v!r}")


def _check_muon_hparams(h: dict) -> None:
    _check_number("lr", h["lr"], 0.0)
    _check_number("momentum", h["momentum"], 0.0, 1.0, hi_open=True)
    _check_number("weight_decay", h["weight_decay"], 0.0)
    if not isinstance(h["nesterov"], bool):
        raise InputError(f"nesterov must be True or False, got {h['nesterov']!r}")
    if h["adjust_lr"] not in ADJUST_LR:
        raise InputError(f"unknown adjust_lr {h['adjust_lr']!r}; accepted: "
                         f"{', '.join(repr(a) for a in ADJUST_LR)}")


def _check_adamw_hparams(h: dict) -> None:
    _check_number("adamw_lr", h["adamw_lr"], 0.0)
    _check_number("adamw_weight_decay", h["adamw_weight_decay"], 0.0)
    _check_number("adamw_eps", h["adamw_eps"], 0.0)
    betas = h["adamw_betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise InputError(f"adamw_betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        _check_number(f"adamw_betas[{i}]", b, 0.0, 1.0, hi_open=True)


@dataclass
class MuonWork:
    """One Muon parameter with a gradient this step, and its param group."""

    name: str
    param: torch.Tensor
    grad: torch.Tensor
    group: dict
    layout: MatrixLayout | None = None


def apply_matrices_(param: torch.Tensor, layout: MatrixLayout, updates, lr: float, weight_decay: float,
                    adjust_lr: str) -> None:
    """The orthogonalized updates of a parameter's matrices (one per matrix of `layout`, in order): weight
    decay once on the whole parameter, then each matrix's step with its own learning-rate scale."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    for view, u in zip(layout.pieces(param), updates, strict=True):
        view.add_(u.to(param.dtype), alpha=-lr * lr_scale(view.shape, adjust_lr))


# ---- the optimizer -------------------------------------------------------------------------------
class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices, AdamW for everything else, on one device.

    params: an nn.Module (routed by `dmuon.params.route`: embeddings, output head, norms, biases and
        tied weights go to AdamW), an iterable of params or (name, param) pairs (2-D -> Muon, rest
        AdamW), or param-group dicts. A group dict takes "params" and any of the constructor's
        keyword names: lr, momentum, nesterov, weight_decay, adjust_lr (for its Muon params) and
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay (for its AdamW params); with
        "use_muon": True / False all its params go to Muon / AdamW (and only the matching keys are
        accepted), without it they are routed like a plain iterable.
    Internally each param group is all-Muon or all-AdamW ("use_muon"), and its "lr" / "weight_decay"
    are the ones that apply to it (so LR schedulers work on both); AdamW groups keep "betas", "eps".
    ns: NSConfig of the orthogonalization. max_batch: at most this many same-shape matrices per
    batched NS call (None: all). nonfinite: 'raise' (FloatingPointError naming the parameters),
    'skip' (the whole step is skipped, state untouched; counted in `skipped_steps`) or 'ignore'.
    Frozen params (requires_grad False) and params whose grad is None are skipped.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, adjust_lr: str = "match_rms_adamw", ns: NSConfig | None = None,
                 adamw_lr: float = 1e-3, adamw_betas: tuple[float, float] = (0.9, 0.999),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.01, muon_predicate=None,
                 nonfinite: str = "raise", max_batch: int | None = None, per_head: bool = False):
        ns = NSConfig() if ns is None else ns
        if not isinstance(ns, NSConfig):
            raise TypeError(f"ns must be a dmuon.NSConfig, got {type(ns).__name__}")
        if nonfinite not in NONFINITE:
            accepted = ", ".join(repr(v) for v in NONFINITE)
            raise InputError(f"unknown nonfinite {nonfinite!r}; accepted: {accepted}")
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int)
                                      or max_batch < 1):
            raise InputError(f"max_batch must be a positive integer or None, got {max_batch!r}")
        hparams = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                       adjust_lr=adjust_lr, adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas),
                       adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay)
        _check_muon_hparams(hparams)
        _check_adamw_hparams(hparams)
        self.ns = ns
        self.nonfinite = nonfinite
        self.max_batch = max_batch
        self.skipped_steps = 0
        self._hparams = hparams
        self._predicate = muon_predicate
        self.per_head = per_head
        self._given_layouts: dict = {}  # id(param) -> a module's Route (module kinds, attention shape)
        groups = self._initial_groups(params, muon_predicate, per_head, self._given_layouts)
        user_chose = not isinstance(params, torch.nn.Module) and all("use_muon" in g for g in groups)
        super().__init__(groups, dict(hparams))
        self._given_layouts = {}  # used by the groups built above only
        if not user_chose and not any(g["use_muon"] for g in self.param_groups):
            n = sum(len(g["params"]) for g in self.param_groups)
            warnings.warn(f"Muon: no parameter is a hidden matrix routed to Muon; all {n} parameters use "
                          "AdamW (pass use_muon=True groups or a muon_predicate to choose Muon params)",
                          UserWarning, stacklevel=2)

    @staticmethod
    def _initial_groups(params, predicate, per_head=False, layouts=None) -> list[dict]:
        if isinstance(params, torch.nn.Module):
            routes = route(params, predicate, per_head=per_head)
            if layouts is not None:  # add_param_group takes these routes as they are
                layouts.update({id(r.param): r for r in routes})
            groups = [{"params": [(r.name, r.param) for r in routes if r.use_muon == flag], "use_muon": flag}
                      for flag in (True, False)]
            groups = [g for g in groups if g["params"]]
        elif isinstance(params, torch.Tensor):
            raise TypeError("params must be an nn.Module, an iterable of tensors / (name, tensor) pairs or "
                            "of param-group dicts; got a single tensor (wrap it in a list)")
        elif isinstance(params, (set, frozenset)):
            raise TypeError("params must be an ordered collection (list, tuple, generator), not a set: the "
                            "order fixes state_dict indices")
        else:
            items = list(params)
            n_dicts = sum(isinstance(i, dict) for i in items)
            if 0 < n_dicts < len(items):
                raise TypeError("params must be all param-group dicts or no dicts at all")
            groups = items if n_dicts else ([{"params": items}] if items else [])
        if not groups:
            raise InputError("Muon got no parameters to optimize (empty list, or a module whose parameters "
                             "are all frozen)")
        return groups

    # ---- param groups ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Add a group in the user format (see the class docstring); it may become two internal groups."""
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"a param group must be a dict with a 'params' entry, got {param_group!r:.80}")
        unknown = sorted(set(param_group) - set(GROUP_KEYS))
        if unknown:
            raise InputError(f"unknown param-group keys {unknown}; accepted: {', '.join(GROUP_KEYS)}")
        use_muon = param_group.get("use_muon")
        if use_muon is not None and not isinstance(use_muon, bool):
            raise InputError(f"use_muon must be True, False or absent, got {use_muon!r}")
        for flag, keys in ((True, ADAMW_KEYS), (False, MUON_KEYS)):
            wrong = sorted(k for k in keys if k in param_group)
            if use_muon is flag and wrong:
                raise InputError(f"param group with use_muon={flag} got {wrong}, which apply only to "
                                 f"{'AdamW' if flag else 'Muon'} params")
        h = {**self._hparams, **{k: v for k, v in param_group.items() if k in MUON_KEYS + ADAMW_KEYS}}
        given = getattr(self, "_given_layouts", {})
        items = param_group["params"]
        items = list(items) if isinstance(items, (list, tuple)) else items
        if given and isinstance(items, list) and all(
                isinstance(x, tuple) and len(x) == 2 and id(x[1]) in given for x in items):
            routes = [given[id(x[1])] for x in items]  # a module's own routes (module kinds, attention)
        else:
            routes = route(items, None if use_muon is not None else self._predicate, per_head=self.per_head)
        existing = {id(p) for g in self.param_groups for p in g["params"]}
        devices = {p.device for g in self.param_groups for p in g["params"]}
        devices |= {r.param.device for r in routes}
        if len(devices) > 1:
            raise InputError(f"Muon is a single-device optimizer; its parameters are on "
                             f"{', '.join(sorted(map(str, devices)))}. Accepted: every parameter on one "
                             "device (use one Muon per device, or DMuon / FSDP2 for several)")
        for r in routes:
            if not r.param.is_leaf:
                raise InputError(f"can't optimize a non-leaf tensor ({r.name})")
            if id(r.param) in existing:
                raise InputError(f"parameter {r.name} appears in more than one parameter group")
        for flag in (True, False):
            chosen = [r for r in routes if (r.use_muon if use_muon is None else use_muon) == flag]
            if chosen:
                self.param_groups.append(self._internal_group(chosen, flag, h))

    @staticmethod
    def _internal_group(routes, use_muon: bool, h: dict) -> dict:
        group = {"params": [r.param for r in routes], "param_names": [r.name for r in routes],
                 "use_muon": use_muon}
        if use_muon:
            _check_muon_hparams(h)
            for r in routes:
                if r.param.dim() < 2 or r.param.dtype not in ITERATION_DTYPES or r.param.numel() == 0:
                    raise InputError(f"Muon needs non-empty real floating-point (fp16, bf16, fp32, fp64) "
                                     f"parameters with at least 2 dims; {r.name} has shape "
                                     f"{tuple(r.param.shape)} and dtype {r.param.dtype}")
            group.update({k: h[k] for k in MUON_KEYS})
            # as which matrices (dmuon.params.decide): the rule's where it is Muon's, else one matrix
            group["layouts"] = [r.layout if r.use_muon and r.layout is not None
                                else MatrixLayout.whole(r.param.shape) for r in routes]
        else:
            _check_adamw_hparams(h)
            group.update(lr=h["adamw_lr"], betas=tuple(h["adamw_betas"]), eps=h["adamw_eps"],
                         weight_decay=h["adamw_weight_decay"])
        return group

    # ---- state -------------------------------------------------------------------------------
    _EXTRA_ATTRS = ("ns", "nonfinite", "max_batch", "skipped_steps", "_hparams", "_predicate", "per_head")

    def __getstate__(self) -> dict:
        """torch's pickled state plus this optimizer's settings (so copy / pickle keep them)."""
        state = super().__getstate__()
        state.update({k: getattr(self, k) for k in self._EXTRA_ATTRS})
        return state

    def state_dict(self) -> dict:
        """torch's state dict, less each group's matrix layouts (the routing's, rebuilt from the model:
        `torch.load(weights_only=True)` reads what is left)."""
        sd = super().state_dict()
        sd["param_groups"] = [{k: v for k, v in g.items() if k != "layouts"} for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, after checking each group is the same kind (Muon / AdamW); the loaded state
        tensors are copied, so the optimizer never shares buffers with `state_dict`. The matrix layouts
        stay this optimizer's (the routing of its own parameters)."""
        layouts = [g.get("layouts") for g in self.param_groups]
        saved = state_dict.get("param_groups", [])
        if len(saved) == len(self.param_groups):
            for i, (cur, old) in enumerate(zip(self.param_groups, saved, strict=True)):
                if old.get("use_muon") != cur["use_muon"]:
                    raise InputError(f"param group {i} is {'Muon' if cur['use_muon'] else 'AdamW'} here but "
                                     f"use_muon={old.get('use_muon')!r} in the loaded state dict; the "
                                     "optimizer must be built with the same parameter routing")
        super().load_state_dict(state_dict)
        for g, lay in zip(self.param_groups, layouts, strict=False):
            if lay is not None:
                g["layouts"] = lay
        for st in self.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.clone()

    # ---- the step ----------------------------------------------------------------------------
    def _collect(self) -> tuple[list[MuonWork], list[tuple[dict, list[tuple[str, torch.Tensor]]]]]:
        muon_work, adamw_work = [], []
        for group in self.param_groups:
            with_grad = []
            for name, p in zip(group["param_names"], group["params"], strict=True):
                if p.grad is None or not p.requires_grad:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"Muon does not support sparse gradients ({name})")
                with_grad.append((name, p))
            if group["use_muon"]:
                layout_of = {id(p): lay for p, lay in zip(group["params"], group["layouts"], strict=True)}
                muon_work += [MuonWork(name, p, p.grad, group, layout_of[id(p)]) for name, p in with_grad]
            elif with_grad:
                adamw_work.append((group, with_grad))
        return muon_work, adamw_work

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_work, adamw_work = self._collect()
        if self.nonfinite != "ignore":
            names = [w.name for w in muon_work] + [n for _, items in adamw_work for n, _ in items]
            grads = [w.grad for w in muon_work] + [p.grad for _, items in adamw_work for _, p in items]
            bad = nonfinite_names(names, grads) if grads else []
            if bad:
                if self.nonfinite == "raise":
                    raise FloatingPointError(f"non-finite gradient (NaN or inf) in {', '.join(bad)}; pass "
                                             "nonfinite='skip' to skip such steps")
                self.skipped_steps += 1
                return loss
        for group, items in adamw_work:
            self._adamw_group_step(group, [p for _, p in items])
        if muon_work:
            self._muon_step(muon_work)
        return loss

    def _adamw_group_step(self, group: dict, params: list[torch.Tensor]) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if "step" not in st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] += 1
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        adamw_step_(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, steps, lr=group["lr"],
                    betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])

    def _muon_step(self, work: list[MuonWork]) -> None:
        """Momentum -> one batched NS call per shape -> apply, for the Muon params that have a grad.
        The hook a distributed optimizer overrides (it runs the same pieces on its owned matrices)."""
        inputs, counts = [], []
        for w in work:
            st = self.state[w.param]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(w.param, memory_format=torch.preserve_format)
            inp = muon_momentum_(w.grad, st["momentum_buffer"], w.group["momentum"], w.group["nesterov"])
            pieces = w.layout.pieces(inp)  # the parameter's matrices (one, or its experts / blocks)
            inputs += pieces
            counts.append(len(pieces))
        updates = orthogonalize_many(inputs, max_batch=self.max_batch, **self.ns.kwargs())
        pos = 0
        for w, k in zip(work, counts, strict=True):
            g = w.group
            apply_matrices_(w.param, w.layout, updates[pos:pos + k], g["lr"], g["weight_decay"],
                            g["adjust_lr"])
            pos += k
