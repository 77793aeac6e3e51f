"""Newton-Schulz orthogonalization: standard quintic NS and Gram NS (with restarts), batched.

Public API:
  orthogonalize(G, method=, coefficients=, steps=, dtype=, restart=, kernels=)
      approximate polar factor of one matrix (..., rows, cols) or a stack of them.
  orthogonalize_many(matrices, max_batch=, merge_transposed=, **same_kwargs)
      a list of 2-D tensors: same-shape ones are stacked into one batched call each.
  orthogonalize_reshaped(W, ...) / as_matrix(W)
      conv-style (>2-D) weights, viewed as (out, -1) matrices.
  NSConfig: the same knobs as one frozen dataclass (what Muon / DMuon take as `ns=`).
  coefficient_schedule(coefficients, steps), resolve_method(rows, cols, ...), iteration_dtype(...).

Every symmetric n x n product goes through the op namespace `dmuon.kernels.get_ops(X, kernels)`
(`syrk`, `sym_poly`, `sym_mul_add`); the non-symmetric products B X / Q X are plain torch matmuls.
The math follows muon.md: X = G / (||G||_F + 1e-7) (fp32 or wider), iterate on the short side
(tall inputs are transposed, or with torch ops iterated as they are through X^T X, the same math),
each step maps singular values s -> a s + b s^3 + c s^5.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import InputError, choice_error
from .kernels import KERNEL_CHOICES, get_ops, torch_ops
from .plan.flops import ns_flops

METHODS = ("auto", "standard", "gram")
COEFFICIENT_NAMES = ("jordan", "polar_express")
NORM_EPS = 1e-7

JORDAN = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
POLAR_EXPRESS_SAFETY = 1.05

DTYPE_NAMES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}
ITERATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

Triple = tuple[float, float, float]


# ---- argument checking ---------------------------------------------------------------------------
def coefficient_schedule(coefficients="jordan", steps: int = 5) -> tuple[Triple, ...]:
    """The (a, b, c) triple of each of the `steps` iterations.

    coefficients: "jordan" (one triple for every step), "polar_express" (the 5 published triples with
    the safety factor f = 1.05 applied as (a/f, b/f^3, c/f^5)), one explicit (a, b, c) triple (used
    for every step) or a sequence of triples. A sequence shorter than `steps` repeats its last triple;
    a longer one is cut to its first `steps` triples (the same rule as Polar Express).
    """
    _check_steps(steps)
    if isinstance(coefficients, str):
        if coefficients == "jordan":
            triples: tuple[Triple, ...] = (JORDAN,)
        elif coefficients == "polar_express":
            f = POLAR_EXPRESS_SAFETY
            triples = tuple((a / f, b / f**3, c / f**5) for a, b, c in POLAR_EXPRESS_RAW)
        else:
            raise InputError(f"unknown coefficients {coefficients!r}; accepted: 'jordan', 'polar_express', "
                             "one (a, b, c) triple, or a sequence of (a, b, c) triples")
    else:
        triples = _explicit_triples(coefficients)
    return tuple(triples[min(t, len(triples) - 1)] for t in range(steps))


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _explicit_triples(coefficients) -> tuple[Triple, ...]:
    bad = InputError(f"coefficients must be 'jordan', 'polar_express', one (a, b, c) triple of real numbers "
                     f"or a non-empty sequence of such triples; got {coefficients!r}")
    if not isinstance(coefficients, Sequence) or len(coefficients) == 0:
        raise bad
    if all(_is_number(v) for v in coefficients):
        coefficients = (coefficients,)
    out = []
    for t in coefficients:
        if (not isinstance(t, Sequence) or isinstance(t, str) or len(t) != 3
                or not all(_is_number(v) for v in t)):
            raise bad
        out.append(tuple(float(v) for v in t))
    return tuple(out)


def _check_steps(steps) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be a positive integer, got {steps!r}")


def _check_restart(restart) -> tuple[int, ...]:
    if isinstance(restart, int) and not isinstance(restart, bool):
        restart = (restart,)
    if not isinstance(restart, Sequence) or isinstance(restart, str) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in restart):
        raise InputError(f"restart must be a tuple of non-negative step indices (e.g. (2,), or () for none), "
                         f"got {restart!r}")
    return tuple(sorted(set(restart)))


def _check_method(method) -> None:
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; accepted: {', '.join(repr(m) for m in METHODS)}")


def parse_dtype(dtype) -> torch.dtype | None:
    """None, a floating torch.dtype, or one of the names 'bf16', 'fp16', 'fp32', 'fp64' (and long forms)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise InputError(f"unknown dtype {dtype!r}; accepted: 'bf16', 'fp16', 'fp32', 'fp64' "
                             "(or the torch dtypes), or None for the default")
        return DTYPE_NAMES[dtype]
    if isinstance(dtype, torch.dtype):
        if dtype not in ITERATION_DTYPES:
            raise InputError(f"iteration dtype must be bfloat16, float16, float32 or float64, got {dtype}")
        return dtype
    raise TypeError(f"dtype must be None, a torch.dtype or a string like 'bf16', got {type(dtype).__name__}")


def _check_kernels(kernels) -> None:
    if kernels not in KERNEL_CHOICES:
        raise choice_error("kernels", kernels, KERNEL_CHOICES)


def _check_input(G) -> None:
    if not isinstance(G, torch.Tensor):
        raise TypeError(f"orthogonalize expects a torch.Tensor, got {type(G).__name__}")
    if not G.is_floating_point():
        raise TypeError(f"orthogonalize expects a floating-point tensor (fp16, bf16, fp32, fp64), "
                        f"got {G.dtype}")
    if G.dtype not in ITERATION_DTYPES:
        raise TypeError(f"orthogonalize expects a floating-point tensor (fp16, bf16, fp32, fp64), got "
                        f"{G.dtype} (8-bit floats: convert the input to bf16 or fp32 first)")
    if G.dim() < 2:
        raise InputError(f"orthogonalize expects a matrix (rows, cols) or a batch (..., rows, cols); got a "
                         f"{G.dim()}-D tensor of shape {tuple(G.shape)}")
    if G.numel() == 0:
        raise InputError(f"orthogonalize got an empty tensor of shape {tuple(G.shape)}")


# ---- choices -------------------------------------------------------------------------------------
def resolve_method(rows: int, cols: int, method: str = "auto", *, steps: int = 5,
                   restart: tuple[int, ...] = (2,)) -> str:
    """'standard' or 'gram' for a (rows, cols) matrix. 'auto' picks Gram NS only where it needs fewer
    (dense-matmul) FLOPs than standard NS, per `dmuon.plan.flops.ns_flops`: aspect ratio above ~1.5
    for 5 steps with one restart."""
    _check_method(method)
    if method != "auto":
        return method
    gram = ns_flops(rows, cols, "gram", steps=steps, restarts=tuple(restart))
    return "gram" if gram < ns_flops(rows, cols, "standard", steps=steps) else "standard"


def iteration_dtype(method: str, device: torch.device, dtype=None) -> torch.dtype:
    """The dtype the iteration runs in: `dtype` if given, else bf16 (standard) / fp16 (gram) on CUDA,
    fp32 elsewhere."""
    parsed = parse_dtype(dtype)
    if parsed is not None:
        return parsed
    if torch.device(device).type == "cuda":
        return torch.float16 if method == "gram" else torch.bfloat16
    return torch.float32


# ---- the iterations ------------------------------------------------------------------------------
DIRECT_NORM_MIN = 1e-10  # below it, squares of small entries may underflow (see `normalize`)


def normalize(x: torch.Tensor, *, dtype: torch.dtype | None = None, transpose: bool = False) -> torch.Tensor:
    """X / (||X||_F + NORM_EPS) per matrix, without overflow or underflow in the norm.
    On a CPU the plain formula runs wherever every matrix's norm came out finite and at least
    DIRECT_NORM_MIN (checked on the host, free there: one read for the norm, one division; the squares of
    entries under ~1e-19 underflow, but against a squared norm of at least 1e-20 they weigh under 1e-18
    each); anywhere else (and always on other devices, where the check would synchronize) the norm is
    taken of X / max|X| (entries at most 1) and scaled back: equal to the plain formula where that is
    finite, finite where it is not (fp32 entries ~1e20 square to inf, which made the update zero).
    dtype / transpose: the result in that dtype, of the transposed matrices, contiguous; the last
    division writes it directly (bitwise the same as converting and copying afterwards, two passes
    fewer)."""
    if x.device.type == "cpu":
        n = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
        if bool((torch.isfinite(n) & (n >= DIRECT_NORM_MIN)).all()):
            src = x.mT if transpose else x
            out = torch.empty(src.shape, dtype=dtype or x.dtype, device=x.device)
            return torch.div(src, n + NORM_EPS, out=out)
    # max |X| as max(max X, -min X): two reads and no |X| temporary (bitwise the same as |X|.amax, 1.6x
    # faster on the development CPU; ~10x faster than vector_norm(ord=inf) there)
    amax = torch.maximum(x.amax(dim=(-2, -1), keepdim=True), x.amin(dim=(-2, -1), keepdim=True).neg_())
    scale = torch.where(amax > 0, amax, torch.ones_like(amax))
    y = x / scale
    denom = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True) + NORM_EPS / scale
    src = y.mT if transpose else y
    out = torch.empty(src.shape, dtype=dtype or y.dtype, device=y.device)
    return torch.div(src, denom, out=out)


def _mm_add(a_mat: torch.Tensor, x: torch.Tensor, beta: float) -> torch.Tensor:
    """a_mat @ x + beta * x (a general, non-symmetric product)."""
    if x.dim() == 3:
        return torch.baddbmm(x, a_mat, x, beta=beta, alpha=1.0)
    return torch.addmm(x, a_mat, x, beta=beta, alpha=1.0)


def _standard_ns(x: torch.Tensor, triples, ops) -> torch.Tensor:
    for a, b, c in triples:
        gram = ops.syrk(x)  # A = X X^T
        poly = ops.sym_poly(gram, b, c)  # B = b A + c A^2
        x = _mm_add(poly, x, a)  # X = a X + B X
    return x


def _standard_ns_tall(x: torch.Tensor, triples) -> torch.Tensor:
    """`_standard_ns` on the transpose of x, iterated on tall x itself (torch ops: the products read
    x^T through the BLAS transpose flag): A = X^T X, B = b A + c A^2, X = a X + X B. No transposed copy
    of X is ever made."""
    for a, b, c in triples:
        gram = torch_ops.syrk(x.mT)  # A = X^T X
        poly = torch_ops.sym_poly(gram, b, c)
        x = torch.baddbmm(x, x, poly, beta=a) if x.dim() == 3 else torch.addmm(x, x, poly, beta=a)
    return x


def _gram_ns(x: torch.Tensor, triples, ops, restarts: set[int], tall: bool = False) -> torch.Tensor:
    """Gram NS on wide x (R = X X^T, result Q X) or, tall=True, on tall x itself (R = X^T X, result X Q:
    Q is a polynomial in R, so symmetric, and X Q is the transpose of Q X^T; the products read x^T
    through the BLAS transpose flag, no transposed copy of X is made; torch ops only)."""
    steps = len(triples)

    def gram(v):
        return ops.syrk(v.mT if tall else v)

    def apply(q, v):
        return v @ q if tall else q @ v

    r = gram(x)
    q = None  # None stands for the identity (fresh start)
    for t, (a, b, c) in enumerate(triples):
        if t in restarts:
            x = apply(q, x)
            r = gram(x)
            q = None
        z = ops.sym_poly(r, b, c)  # Z = b R + c R^2
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)  # Q = Z + a I
        else:
            q = ops.sym_mul_add(q, z, a)  # Q = Q Z + a Q
        if t + 1 < steps and (t + 1) not in restarts:
            rz = ops.sym_mul_add(r, z, a)  # RZ = R Z + a R
            r = ops.sym_mul_add(rz, z, a)  # R = Z RZ + a RZ = (aI + Z)^2 R
    return apply(q, x)


def _call_setup(rows: int, cols: int, device, method: str, steps: int, restart, dtype, kernels: str):
    """What one `orthogonalize` call of a (rows, cols) matrix on `device` runs: (the resolved method, its
    restart steps, the iteration dtype, the op set, whether a tall matrix is iterated as it is: with torch
    ops, standard NS as A = X^T X, X = a X + X B and Gram NS as R = X^T X, result X Q, instead of
    transposed into the wide orientation and back; the Triton kernels take the wide orientation)."""
    restarts = {r for r in _check_restart(restart) if 0 < r < steps}
    method = resolve_method(rows, cols, method, steps=steps, restart=tuple(restarts))
    it_dtype = iteration_dtype(method, device, dtype)
    ops = get_ops(torch.empty((), dtype=it_dtype, device=device).expand(min(rows, cols), max(rows, cols)),
                  kernels)
    return method, restarts, it_dtype, ops, ops is torch_ops


def lossless_narrower(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Whether every `narrow` value is exactly a `wide` value and `narrow` takes fewer bytes (bf16 or fp16
    into fp32 or fp64): a result computed in `narrow` may stay there and travel or be stored that way, its
    conversion to `wide` later giving the same bits as converting it first."""
    return narrow in (torch.bfloat16, torch.float16) and wide in (torch.float32, torch.float64)


def iterates_tall_as_is(rows: int, cols: int, device, *, method: str = "auto", coefficients="jordan",
                        steps: int = 5, dtype=None, restart=(2,), kernels: str = "auto") -> bool:
    """True where `orthogonalize` with these arguments (those of `NSConfig`; the coefficients do not
    matter) runs the tall orientation of a `rows` x `cols` shape (either way round) without a transposed
    copy, so stacking tall matrices in the wide orientation would only add copies: the runtime then
    gives them a stack of their own (`dmuon.runtime.planning.own_orientation_stacks`); elsewhere one
    stack of the plan batch's shape is as cheap (the tall members are transposed either way) and makes
    one call, as the plan prices it."""
    _check_method(method)
    _check_kernels(kernels)
    return _call_setup(max(rows, cols), min(rows, cols), torch.device(device), method, steps, restart, dtype,
                       kernels)[-1]


def orthogonalize(G: torch.Tensor, *, method: str = "auto", coefficients="jordan", steps: int = 5,
                  dtype=None, restart=(2,), kernels: str = "auto", out_dtype=None) -> torch.Tensor:
    """Approximate polar factor (U V^T of G = U S V^T) of each matrix in G by Newton-Schulz.

    G: (rows, cols) or (..., rows, cols), any floating dtype; the result has G's shape and dtype.
    method: 'standard' (quintic NS), 'gram' (Gram NS, restarting at the step indices in `restart`),
        'auto' (Gram NS where it saves FLOPs, see `resolve_method`).
    coefficients, steps: see `coefficient_schedule`.
    dtype: iteration dtype (None = bf16 standard / fp16 gram on CUDA, fp32 elsewhere).
    restart: Gram NS restart step indices; indices 0 and >= steps are no-ops; () = never restart.
    kernels: 'auto' | 'torch' | 'triton', passed to `dmuon.kernels.get_ops`.
    out_dtype: the result's dtype (None: G's). The iteration dtype where that is narrower than G's keeps
        the result as the iteration left it, without the conversion pass: converting it later (a copy, an
        apply) gives the same bits (`lossless_narrower`).
    Tall matrices (rows > cols) are iterated transposed, or as they are with torch ops. A zero matrix
    gives a zero result.
    """
    _check_input(G)
    _check_method(method)
    _check_kernels(kernels)
    target = parse_dtype(out_dtype) or G.dtype
    triples = coefficient_schedule(coefficients, steps)
    rows, cols = G.shape[-2], G.shape[-1]
    method, restarts, it_dtype, ops, tall_as_is = _call_setup(rows, cols, G.device, method, steps, restart,
                                                              dtype, kernels)
    lead = G.shape[:-2]
    x = G.reshape(-1, rows, cols) if G.dim() > 3 else G
    norm_dtype = torch.promote_types(torch.promote_types(G.dtype, torch.float32), it_dtype)
    # tall matrices: with torch ops NS iterates on X itself; else on X^T, transposed once when normalized
    # and once back at the end
    flip = rows > cols and not tall_as_is
    x = normalize(x.to(norm_dtype), dtype=it_dtype, transpose=flip)
    if method == "gram":
        x = _gram_ns(x, triples, ops, restarts, tall=rows > cols and not flip)
    elif rows > cols and not flip:
        x = _standard_ns_tall(x, triples)
    else:
        x = _standard_ns(x, triples, ops)

    if flip or x.dtype != target:  # one pass: converted and transposed back into a contiguous result
        res = torch.empty((*x.shape[:-2], rows, cols), dtype=target, device=x.device)
        x = res.copy_(x.mT if flip else x)
    return x.reshape(*lead, rows, cols)


# ---- many matrices -------------------------------------------------------------------------------
def orthogonalize_many(matrices, *, max_batch: int | None = None, merge_transposed: bool = False,
                       **kwargs) -> list[torch.Tensor]:
    """Orthogonalize a list of 2-D tensors with one batched call per group of same shape, dtype and
    device (at most `max_batch` matrices per call); results come back in input order.

    merge_transposed: also stack (m, n) with (n, m) matrices (the tall ones transposed), which gives
    the same results since the iteration runs on the short side anyway.
    Other keyword arguments are those of `orthogonalize`.
    """
    matrices = list(matrices)
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int)
                                  or max_batch < 1):
        raise InputError(f"max_batch must be a positive integer or None, got {max_batch!r}")
    groups: dict[tuple, list[tuple[int, bool]]] = {}
    for i, m in enumerate(matrices):
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"orthogonalize_many expects a list of torch.Tensor; item {i} is "
                            f"{type(m).__name__}")
        if m.dim() != 2:
            raise InputError(f"orthogonalize_many expects 2-D matrices; item {i} has shape {tuple(m.shape)} "
                             "(use as_matrix() for conv weights, orthogonalize() for a batch)")
        rows, cols = m.shape
        flip = merge_transposed and rows > cols
        shape = (cols, rows) if flip else (rows, cols)
        groups.setdefault((shape, m.dtype, m.device), []).append((i, flip))
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for members in groups.values():
        chunk = max_batch or len(members)
        for start in range(0, len(members), chunk):
            part = members[start:start + chunk]
            if len(part) == 1:
                i, flip = part[0]
                res = orthogonalize(matrices[i].mT if flip else matrices[i], **kwargs)
                out[i] = res.mT if flip else res
                continue
            stack = torch.stack([matrices[i].mT if flip else matrices[i] for i, flip in part])
            res = orthogonalize(stack, **kwargs)
            for (i, flip), r in zip(part, res.unbind(0), strict=True):
                out[i] = r.mT if flip else r
    return out  # type: ignore[return-value]


# ---- conv-style weights --------------------------------------------------------------------------
def as_matrix(W: torch.Tensor) -> torch.Tensor:
    """W viewed as a matrix (out, -1): conv weights (out, in, kh, kw) -> (out, in*kh*kw); 2-D unchanged."""
    if not isinstance(W, torch.Tensor) or W.dim() < 2:
        shape = tuple(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
        raise InputError(f"as_matrix expects a tensor with at least 2 dims, got {shape}")
    return W.reshape(W.shape[0], -1)


def orthogonalize_reshaped(W: torch.Tensor, **kwargs) -> torch.Tensor:
    """Orthogonalize a (>= 2-D) weight as the matrix (out, -1) and reshape the result back to W's shape."""
    return orthogonalize(as_matrix(W), **kwargs).reshape(W.shape)


# ---- config --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NSConfig:
    """Orthogonalization settings (the keyword arguments of `orthogonalize`), checked on construction."""

    method: str = "auto"
    coefficients: object = "jordan"
    steps: int = 5
    dtype: object = None
    restart: tuple[int, ...] = (2,)
    kernels: str = "auto"

    def __post_init__(self) -> None:
        _check_method(self.method)
        coefficient_schedule(self.coefficients, self.steps)
        if not isinstance(self.coefficients, str):  # a hashable, canonical form of explicit triples
            object.__setattr__(self, "coefficients", _explicit_triples(self.coefficients))
        object.__setattr__(self, "restart", _check_restart(self.restart))
        parse_dtype(self.dtype)
        _check_kernels(self.kernels)

    def kwargs(self) -> dict:
        return dict(method=self.method, coefficients=self.coefficients, steps=self.steps, dtype=self.dtype,
                    restart=self.restart, kernels=self.kernels)

    def method_for(self, rows: int, cols: int) -> str:
        """'standard' or 'gram': what this config runs on a (rows, cols) matrix."""
        restarts = tuple(r for r in self.restart if 0 < r < self.steps)
        return resolve_method(rows, cols, self.method, steps=self.steps, restart=restarts)

    def orthogonalize(self, G: torch.Tensor) -> torch.Tensor:
        return orthogonalize(G, **self.kwargs())

    def orthogonalize_many(self, matrices, *, max_batch: int | None = None,
                           merge_transposed: bool = False) -> list[torch.Tensor]:
        return orthogonalize_many(matrices, max_batch=max_batch, merge_transposed=merge_transposed,
                                  **self.kwargs())
