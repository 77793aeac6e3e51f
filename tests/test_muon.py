"""Tests of dmuon.Muon and parameter routing: agreement with torch.optim.Muon / torch.optim.AdamW and
with an independent fp64 reference of the update rule, state_dict round trips, routing of a small
transformer, non-finite gradients and bad input."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

import dmuon
from dmuon.optim import lr_scale, muon_momentum_
from dmuon.params import route

SHAPES = [(32, 64), (64, 32), (48, 48)]
BF16_JORDAN = dmuon.NSConfig(method="standard", coefficients="jordan", dtype="bf16")


# ---- a least-squares-through-tanh problem on a few matrices --------------------------------------
def problem(dtype):
    """Weights, inputs, targets; inputs have 128 columns so gradients are full rank (NS in bf16
    amplifies rounding noise in the null space of a rank-deficient input)."""
    g = torch.Generator().manual_seed(1)
    ws = [0.1 * torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]
    xs = [torch.randn(s[1], 128, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]
    ys = [torch.randn(s[0], 128, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]
    return ws, xs, ys


def run(make_opt, dtype=torch.float32, steps=5):
    """Accumulated parameter change after `steps` optimizer steps."""
    ws, xs, ys = problem(dtype)
    params = [nn.Parameter(w.clone()) for w in ws]
    opt = make_opt(params)
    for _ in range(steps):
        opt.zero_grad()
        sum(((torch.tanh(p @ x) - y) ** 2).sum() for p, x, y in zip(params, xs, ys, strict=True)).backward()
        opt.step()
    return [p.detach() - w for p, w in zip(params, ws, strict=True)]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_agrees_with_torch_muon(adjust_lr, nesterov):
    # torch keeps an EMA buffer (lerp) where we sum; NS normalizes its input so the updates agree.
    # torch decays with the unscaled lr and steps with lr * adjust: the same form as ours.
    theirs = run(lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                                             adjust_lr_fn=adjust_lr))
    ours = run(lambda ps: dmuon.Muon(ps, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                                     adjust_lr=adjust_lr, ns=BF16_JORDAN))
    for a, b in zip(ours, theirs, strict=True):
        assert rel(a, b) <= 2e-2


def test_torch_muon_comparison_can_fail():
    """The tolerance above separates a correct rule from a wrong scale or a missing weight decay."""
    theirs = run(lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1, adjust_lr_fn="original"))
    other_scale = run(lambda ps: dmuon.Muon(ps, weight_decay=0.1, adjust_lr="match_rms_adamw",
                                            ns=BF16_JORDAN))
    no_decay = run(lambda ps: dmuon.Muon(ps, weight_decay=0.0, adjust_lr="original", ns=BF16_JORDAN))
    assert all(rel(a, b) > 2e-2 for a, b in zip(other_scale, theirs, strict=True))
    assert any(rel(a, b) > 2e-2 for a, b in zip(no_decay, theirs, strict=True))


# ---- an independent fp64 reference of our rule --------------------------------------------------
def reference_ns(x: torch.Tensor, coeffs) -> torch.Tensor:
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for a, b, c in coeffs:
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


class ReferenceMuon:
    """muon.md's update rule in plain fp64 torch, written without any dmuon code."""

    def __init__(self, params, lr, momentum, nesterov, weight_decay, adjust_lr, coeffs):
        self.params, self.coeffs = params, coeffs
        self.bufs = [torch.zeros_like(p) for p in params]
        self.h = (lr, momentum, nesterov, weight_decay, adjust_lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        lr, mu, nesterov, wd, adjust = self.h
        for p, buf in zip(self.params, self.bufs, strict=True):
            buf.copy_(mu * buf + p.grad)
            u = reference_ns(p.grad + mu * buf if nesterov else buf, self.coeffs)
            m, n = p.shape
            scale = 0.2 * math.sqrt(max(m, n)) if adjust == "match_rms_adamw" else math.sqrt(max(1.0, m / n))
            p.copy_(p * (1 - lr * wd) - lr * scale * u)


PE = dmuon.coefficient_schedule("polar_express", 5)


@pytest.mark.parametrize("method, coefficients, adjust_lr, nesterov", [
    ("standard", "jordan", "match_rms_adamw", True),
    ("gram", "jordan", "original", False),
    ("gram", "polar_express", "match_rms_adamw", True),
    ("auto", "polar_express", "original", True),
])
def test_agrees_with_fp64_reference(method, coefficients, adjust_lr, nesterov):
    coeffs = dmuon.coefficient_schedule(coefficients, 5)
    hp = dict(lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=0.1, adjust_lr=adjust_lr)
    ref = run(lambda ps: ReferenceMuon(ps, **hp, coeffs=coeffs), torch.float64)
    def ours(dtype):
        return lambda ps: dmuon.Muon(ps, **hp, ns=dmuon.NSConfig(method=method, coefficients=coefficients,
                                                                 dtype=dtype))

    fp32 = run(ours("fp32"), torch.float64)  # fp64 params, NS iterated in fp32
    fp64 = run(ours("fp64"), torch.float64)
    fp32_params = run(ours(None), torch.float32)  # fp32 params, default (fp32 on CPU) iteration
    for a, b, c, r in zip(fp32, fp64, fp32_params, ref, strict=True):
        assert rel(a, r) <= 1e-5 and rel(c, r) <= 1e-5
        assert rel(b, r) <= 1e-10


def test_functional_pieces():
    g, buf = torch.tensor([[1.0, 2.0]]), torch.tensor([[10.0, 20.0]])
    out = muon_momentum_(g, buf, 0.5, nesterov=True)
    assert torch.equal(buf, torch.tensor([[6.0, 12.0]])) and torch.equal(out, torch.tensor([[4.0, 8.0]]))
    out = muon_momentum_(g, buf, 0.5, nesterov=False)
    assert out is buf and torch.equal(buf, torch.tensor([[4.0, 8.0]]))
    assert lr_scale((1024, 4096)) == pytest.approx(0.2 * 64)
    assert lr_scale((4096, 1024), "original") == pytest.approx(2.0)
    assert lr_scale((1024, 4096), "original") == 1.0
    assert lr_scale((8, 3, 3, 3), "original") == 1.0 and lr_scale((64, 2, 2, 2)) == pytest.approx(1.6)
    p = torch.ones(2, 3)
    dmuon.muon_apply_(p, torch.full((2, 3), 2.0), lr=0.1, weight_decay=0.5, scale=3.0)
    assert torch.allclose(p, torch.full((2, 3), 0.95 - 0.6))
    with pytest.raises(ValueError, match="unknown adjust_lr 'sqrt'; accepted: 'match_rms_adamw', 'original'"):
        lr_scale((4, 4), "sqrt")


# ---- AdamW part ----------------------------------------------------------------------------------
def test_adamw_part_equals_torch_adamw():
    g = torch.Generator().manual_seed(5)
    shapes = [(7,), (4, 5), (3, 2, 2)]
    ours = [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = dmuon.Muon([{"params": ours, "use_muon": False, "adamw_lr": 3e-3, "adamw_weight_decay": 0.1}])
    ref = torch.optim.AdamW(theirs, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)
    for _ in range(6):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)  # the same arithmetic, op for op
    assert opt.state[ours[0]]["step"] == 6


# ---- a small transformer-like model --------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.proj(att @ v)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=50, d=16, layers=2, ctx=8, tie=False, head_name="lm_head"):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(ctx, d))
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head_name = head_name
        setattr(self, head_name, nn.Linear(d, vocab, bias=False))
        if tie:
            getattr(self, head_name).weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos_embed[: idx.shape[-1]]
        for b in self.blocks:
            x = b(x)
        return getattr(self, self.head_name)(self.norm(x))


HIDDEN = {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc1", "fc2")}


def muon_names(model, predicate=None):
    return {r.name for r in route(model, predicate) if r.use_muon}


@pytest.mark.parametrize("kwargs", [{}, {"tie": True}, {"head_name": "proj_out"}, {"head_name": "output"}])
def test_routing_of_a_transformer(kwargs):
    torch.manual_seed(0)
    model = TinyLM(**kwargs)
    routes = {r.name: r for r in route(model)}
    assert muon_names(model) == HIDDEN
    assert set(routes) == {n for n, _ in model.named_parameters()}
    assert routes["tok.weight"].reason == "embedding"
    assert routes["pos_embed"].reason == "embedding (by name)"
    if not kwargs.get("tie"):
        assert routes[f"{kwargs.get('head_name', 'lm_head')}.weight"].reason == "output head"
    hidden_ids = {id(p) for n, p in model.named_parameters() if n in HIDDEN}
    assert {id(p) for p in dmuon.muon_params(model)} == hidden_ids
    assert len(dmuon.muon_params(model)) + len(dmuon.adamw_params(model)) == len(list(model.parameters()))


def test_routing_head_by_name_and_tied_weight_under_another_module():
    model = nn.Sequential()
    model.add_module("emb", nn.Embedding(10, 8))
    model.add_module("hidden", nn.Linear(8, 8))
    model.add_module("classifier", nn.Linear(8, 3))
    model.add_module("decoder", nn.Linear(8, 10))
    model.decoder.weight = model.emb.weight
    assert muon_names(model) == {"hidden.weight"}
    reasons = {r.name: r.reason for r in route(model)}
    assert reasons["classifier.weight"] == "output head"


def test_routing_predicate_frozen_and_named_pairs():
    model = TinyLM()
    everything_2d = muon_names(model, lambda name, p: p.dim() == 2)
    assert everything_2d == HIDDEN | {"tok.weight", "pos_embed", "lm_head.weight"}
    assert muon_names(model, lambda name, p: name.endswith("fc1.weight")) == {"blocks.0.fc1.weight",
                                                                              "blocks.1.fc1.weight"}
    model.blocks[0].fc1.weight.requires_grad_(False)
    assert "blocks.0.fc1.weight" not in {r.name for r in route(model)}
    pairs = {r.name: r.use_muon for r in route(list(model.named_parameters()))}
    assert pairs["lm_head.weight"] is False and pairs["pos_embed"] is False and pairs["tok.weight"] is True
    plain = route([torch.zeros(3, 4), torch.zeros(4), torch.zeros(2, 2, 2)])
    assert [(r.name, r.use_muon) for r in plain] == [("params.0", True), ("params.1", False),
                                                     ("params.2", False)]
    with pytest.raises(TypeError, match="muon_predicate must return a bool"):
        route(model, lambda n, p: "yes")


def test_muon_on_module_builds_routed_groups():
    model = TinyLM()
    opt = dmuon.Muon(model, lr=0.03, adamw_lr=2e-3, adamw_weight_decay=0.05)
    muon_g = [g for g in opt.param_groups if g["use_muon"]]
    adamw_g = [g for g in opt.param_groups if not g["use_muon"]]
    assert len(muon_g) == len(adamw_g) == 1
    assert set(muon_g[0]["param_names"]) == HIDDEN and muon_g[0]["lr"] == 0.03
    assert adamw_g[0]["lr"] == 2e-3 and adamw_g[0]["weight_decay"] == 0.05
    assert adamw_g[0]["betas"] == (0.9, 0.999) and adamw_g[0]["eps"] == 1e-8


def lm_step(model, opt, g):
    idx = torch.randint(0, 50, (4, 8), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
    opt.step()


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    model = TinyLM()
    model.blocks[1].fc2.weight.requires_grad_(False)  # a frozen matrix: skipped throughout
    opt = dmuon.Muon(model, weight_decay=0.01)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        lm_step(model, opt, g)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    saved_model = copy.deepcopy(model)
    rng_state = g.get_state()
    for _ in range(3):
        lm_step(model, opt, g)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    fresh = TinyLM()
    fresh.load_state_dict(ckpt["model"])
    fresh.blocks[1].fc2.weight.requires_grad_(False)
    opt2 = dmuon.Muon(fresh, weight_decay=0.01)
    opt2.load_state_dict(ckpt["opt"])
    g.set_state(rng_state)
    for _ in range(3):
        lm_step(fresh, opt2, g)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), n
    assert torch.equal(model.blocks[1].fc2.weight, saved_model.blocks[1].fc2.weight)


def test_named_parameters_and_deepcopy():
    torch.manual_seed(0)
    model = TinyLM()
    opt = dmuon.Muon(model.named_parameters(), ns=dmuon.NSConfig(method="gram"), nonfinite="skip")
    assert {n for g in opt.param_groups if g["use_muon"] for n in g["param_names"]} == HIDDEN | {"tok.weight"}
    twin_model = copy.deepcopy(model)
    lm_step(model, opt, torch.Generator().manual_seed(3))
    twin = copy.deepcopy({"model": model, "opt": opt})
    assert twin["opt"].ns == opt.ns and twin["opt"].nonfinite == "skip"
    for m, o in ((model, opt), (twin["model"], twin["opt"])):
        lm_step(m, o, torch.Generator().manual_seed(4))
    for a, b, c in zip(model.parameters(), twin["model"].parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_load_state_dict_copies_and_checks_routing():
    a = nn.Parameter(torch.randn(4, 6))
    opt = dmuon.Muon([a])
    a.grad = torch.randn(4, 6)
    opt.step()
    b = nn.Parameter(a.detach().clone())
    opt2 = dmuon.Muon([b])
    sd = opt.state_dict()
    opt2.load_state_dict(sd)
    assert opt2.state[b]["momentum_buffer"].data_ptr() != opt.state[a]["momentum_buffer"].data_ptr()
    opt3 = dmuon.Muon([{"params": [nn.Parameter(torch.randn(4, 6))], "use_muon": False}])
    with pytest.raises(ValueError, match="param group 0 is AdamW here but use_muon=True in the loaded"):
        opt3.load_state_dict(sd)


def test_conv_weight_through_predicate_and_lr_scheduler():
    conv = nn.Conv2d(3, 8, 3)
    w0 = conv.weight.detach().clone()
    opt = dmuon.Muon(conv, lr=0.1, muon_predicate=lambda n, p: p.dim() == 4, ns=dmuon.NSConfig(dtype="fp64"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.0005]
    conv.weight.grad = torch.randn_like(conv.weight)
    opt.step()
    sched.step()
    expected = w0 - 0.05 * lr_scale((8, 27)) * dmuon.orthogonalize_reshaped(conv.weight.grad * 1.95,
                                                                            dtype="fp64")
    assert torch.allclose(conv.weight.detach(), expected, atol=1e-6)
    assert conv.bias.grad is None and "step" not in opt.state[conv.bias]  # no grad: skipped


# ---- non-finite gradients ------------------------------------------------------------------------
def test_nonfinite_raise_names_the_parameter():
    model = TinyLM()
    opt = dmuon.Muon(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model.blocks[1].fc1.weight.grad[0, 0] = float("nan")
    model.norm.bias.grad[2] = float("inf")
    with pytest.raises(FloatingPointError, match=r"non-finite .* in blocks\.1\.fc1\.weight, norm\.bias"):
        opt.step()


def test_nonfinite_skip_leaves_everything_untouched():
    torch.manual_seed(0)
    model = TinyLM()
    opt = dmuon.Muon(model, nonfinite="skip", weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    lm_step(model, opt, g)
    before_params = copy.deepcopy(model.state_dict())
    before_state = copy.deepcopy(opt.state_dict())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.tok.weight.grad[1, 1] = float("-inf")
    opt.step()
    assert opt.skipped_steps == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_params[k]), k
    after_state = opt.state_dict()
    for i, st in before_state["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after_state["state"][i][k])), (i, k)
    model.tok.weight.grad[1, 1] = 0.0
    opt.step()  # a finite step goes through
    assert not torch.equal(model.tok.weight, before_params["tok.weight"])


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"lr": -1.0}, r"lr must be a real number >= 0.0, got -1.0"),
    ({"momentum": 1.0}, r"momentum must be a real number in \[0.0, 1.0\), got 1.0"),
    ({"adjust_lr": "sqrt"}, "unknown adjust_lr 'sqrt'; accepted: 'match_rms_adamw', 'original'"),
    ({"nonfinite": "warn"}, "unknown nonfinite 'warn'; accepted: 'raise', 'skip', 'ignore'"),
    ({"adamw_betas": (0.9,)}, r"adamw_betas must be a pair"),
    ({"nesterov": 1}, "nesterov must be True or False"),
    ({"max_batch": 0}, "max_batch must be a positive integer"),
])
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dmuon.Muon([nn.Parameter(torch.randn(3, 3))], **kwargs)


def test_bad_params():
    with pytest.raises(TypeError, match="ns must be a dmuon.NSConfig"):
        dmuon.Muon([nn.Parameter(torch.randn(3, 3))], ns={"method": "gram"})
    with pytest.raises(ValueError, match="no parameters to optimize"):
        dmuon.Muon([])
    with pytest.raises(TypeError, match="got a single tensor"):
        dmuon.Muon(nn.Parameter(torch.randn(3, 3)))
    with pytest.raises(ValueError, match=r"Muon needs .* at least 2 dims; params.0 has shape \(5,\)"):
        dmuon.Muon([{"params": [nn.Parameter(torch.randn(5))], "use_muon": True}])
    with pytest.raises(ValueError, match=r"unknown param-group keys \['betas'\]; accepted: params, use_muon"):
        dmuon.Muon([{"params": [nn.Parameter(torch.randn(5))], "betas": (0.9, 0.99)}])
    with pytest.raises(ValueError, match=r"use_muon=False got \['lr'\], which apply only to Muon"):
        dmuon.Muon([{"params": [nn.Parameter(torch.randn(5))], "use_muon": False, "lr": 0.1}])
    p = nn.Parameter(torch.randn(3, 3))
    with pytest.raises(ValueError, match="appears in more than one parameter group"):
        dmuon.Muon([{"params": [p]}, {"params": [p]}])
    with pytest.raises(TypeError, match="not a set"):
        dmuon.Muon([{"params": {p}}])
    with pytest.raises(TypeError, match="not a set"):
        dmuon.Muon({p})
    with pytest.raises(TypeError, match="all param-group dicts or no dicts"):
        dmuon.Muon([{"params": [p]}, nn.Parameter(torch.randn(2, 2))])


def test_fused_adamw_equals_torch_fused_and_matches_the_op_sequence():
    g = torch.Generator().manual_seed(11)
    shapes = [(300,), (17, 9), (2, 3, 5)]
    base = [torch.randn(*s, generator=g) for s in shapes]
    runs = {}
    for name, fused in (("fused", True), ("ops", False)):
        ps = [b.clone() for b in base]
        m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        gg = torch.Generator().manual_seed(3)
        for t in range(1, 6):
            grads = [torch.randn(p.shape, generator=gg) for p in ps]
            dmuon.adamw_step_(ps, grads, m, v, [t] * len(ps), lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                              weight_decay=0.1, fused=fused)
        runs[name] = ps
    theirs = [nn.Parameter(b.clone()) for b in base]
    ref = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=True)
    gg = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p in theirs:
            p.grad = torch.randn(p.shape, generator=gg)
        ref.step()
    for a, b, c in zip(runs["fused"], theirs, runs["ops"], strict=True):
        assert torch.equal(a, b.detach())  # torch's fused kernel, same inputs
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)  # the op sequence, to rounding
    noncontig = torch.randn(4, 6, generator=g).t()  # not contiguous: the op sequence takes it
    dmuon.adamw_step_([noncontig], [torch.ones(6, 4)], [torch.zeros(6, 4)], [torch.zeros(6, 4)], [1],
                      lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    assert torch.isfinite(noncontig).all()


def test_suspect_indices_is_a_superset_of_the_exact_check():
    from dmuon.optim import nonfinite_names, suspect_indices

    big = torch.full((4,), 3e38)  # finite, but its fp32 sum overflows
    grads = [torch.ones(3), torch.tensor([1.0, float("nan")]), big, torch.tensor([float("-inf")]),
             torch.ones(2, dtype=torch.bfloat16)]
    sus = suspect_indices(grads)
    assert sus == [1, 2, 3]
    assert nonfinite_names(sus, [grads[k] for k in sus]) == [1, 3]
    assert suspect_indices([]) == []


def test_suspect_indices_sums_a_storage_run_once_and_still_finds_each_bad_tensor():
    from dmuon.optim import nonfinite_names, storage_runs, suspect_indices

    flat = torch.arange(30.0)
    grads = [flat[0:6], flat[6:18].view(3, 4), flat[20:30].view(2, 5), torch.ones(4),
             flat[6:18].view(3, 4).t()]
    runs = storage_runs(grads)
    # the first two lie back to back: one run over their span; the third starts after a gap; the
    # transposed view is not contiguous: each of those is a run of its own
    assert [(tuple(f.shape), idx) for f, idx in runs] == [((18,), [0, 1]), ((2, 5), [2]), ((4,), [3]),
                                                         ((4, 3), [4])]
    assert torch.equal(runs[0][0], flat[:18])
    assert suspect_indices(grads) == []
    flat[8] = float("nan")  # in grads 1 and 4 (the same elements); grads 0 shares the run of grads 1
    flat[25] = float("inf")
    sus = suspect_indices(grads)
    assert sus == [0, 1, 2, 4]
    assert nonfinite_names(sus, [grads[k] for k in sus]) == [1, 2, 4]


def test_muon_apply_many_is_bitwise_muon_apply_per_tensor():
    from dmuon.optim import muon_apply_many_

    g = torch.Generator().manual_seed(3)
    shapes = [(5, 7), (7, 5), (3, 2, 2), (5, 7)]
    scales = [0.7, 1.3, 0.7, 2.0]
    for wd in (0.0, 0.1):
        ps = [torch.randn(s, generator=g) for s in shapes]
        us = [torch.randn(s[0], math.prod(s[1:]), generator=g) for s in shapes]
        us[1] = us[1].to(torch.bfloat16)  # another dtype than its parameter's
        ref = [p.clone() for p in ps]
        for p, u, s in zip(ref, us, scales, strict=True):
            dmuon.muon_apply_(p, u, lr=0.05, weight_decay=wd, scale=s)
        muon_apply_many_(ps, us, lr=0.05, weight_decay=wd, scales=scales)
        for a, b in zip(ps, ref, strict=True):
            assert torch.equal(a, b)
