"""Real Hugging Face models (transformers 5, built from config classes, never downloaded) under DMuon and
NaiveMuon: the one routing rule (`dmuon.params.decide`) gives the runtime and the simulator's config.json
reader the same matrices, and the distributed optimizers equal single-process `dmuon.Muon` on them.

Families: llama (tied embeddings), qwen2, qwen3, qwen3_moe, mixtral, deepseek_v3 (MLA + shared experts),
gemma, gpt2 (Conv1D, fused c_attn) and phi3 (fused qkv_proj / gate_up_proj).

The distributed runs share one spawn per rank count (`_battery`: 1, 2 and 4 ranks): starting ranks that
import transformers costs seconds, a family's run a fraction of that; each run's failure is its own test's."""

from __future__ import annotations

import functools
import traceback

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_distributed, scratch_dir  # noqa: E402

H, L, V = 32, 2, 96  # hidden, layers, vocabulary: tiny
ATTN = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
            intermediate_size=48, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
CONFIGS = {
    "llama": ("LlamaConfig", dict(ATTN, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", ATTN),
    "qwen3": ("Qwen3Config", dict(ATTN, head_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(ATTN, **MOE, num_experts=4, head_dim=8)),
    "mixtral": ("MixtralConfig", dict(ATTN, num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=16)),
    "deepseek_v3": ("DeepseekV3Config", dict(ATTN, **MOE, num_key_value_heads=4, n_routed_experts=4,
                                             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
                                             q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                             v_head_dim=8, n_group=1, topk_group=1)),
    "gemma": ("GemmaConfig", dict(ATTN, head_dim=8)),
    "gpt2": ("GPT2Config", dict(n_embd=H, n_layer=L, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)),
    "phi3": ("Phi3Config", dict(ATTN, num_key_value_heads=4)),
}


def build(family: str, seed: int = 0):
    cls, kw = CONFIGS[family]
    cfg = getattr(transformers, cls)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.float().train(), cfg


def config_dict(family: str) -> dict:
    _, cfg = build(family)
    return cfg.to_dict()


# ---- one routing rule: runtime = simulator, matrix by matrix ----------------------------------------
@pytest.mark.parametrize("per_head", [False, True], ids=["whole", "per-head"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_runtime_routing_equals_simulator_routing(family, per_head):
    from dmuon.params import route
    from simulator.models.hf_config import workload_from_config

    model, cfg = build(family)
    routes = route(model, per_head=per_head)
    runtime = [m for r in routes for m in r.matrices]
    runtime_adamw = sorted(r.name.removesuffix(".weight") for r in routes if not r.use_muon)
    raw = cfg.to_dict()
    raw["num_nextn_predict_layers"] = 0  # transformers builds no MTP modules; the simulator can add them
    wl = workload_from_config(raw, name=family, per_head=per_head)
    sim = [m for p in wl.params if p.optimizer == "muon" for m in p.matrices()]
    sim_adamw = sorted(p.name for p in wl.params if p.optimizer == "adamw")
    assert sorted(runtime) == sorted(sim)
    assert runtime_adamw == sim_adamw
    # the parameters the runtime trains are the simulator's, element for element
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel for p in wl.params)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_moe_experts_run_muon_and_routers_adamw(family):
    from dmuon.params import route

    model, _ = build(family)
    routes = {r.name: r for r in route(model)}
    experts = [r for n, r in routes.items() if ".experts." in n and not n.endswith("bias")]
    assert experts and all(r.use_muon for r in experts)
    up = next(r for n, r in routes.items() if n.endswith("experts.gate_up_proj"))
    E, two_i, h = up.param.shape
    assert up.layout.count == 2 * E and set(up.layout.shapes) == {(two_i // 2, h)}
    assert [m[0] for m in up.matrices[:2]] == [up.name.replace("experts.", "experts.0.").replace(
        "gate_up_proj", k) for k in ("gate_proj", "up_proj")]
    routers = [r for n, r in routes.items() if n.endswith("mlp.gate.weight")]
    assert routers and not any(r.use_muon for r in routers)


def test_fused_projections_are_cut_as_the_model_uses_them():
    """Phi-3's qkv_proj rows and GPT-2's c_attn columns are q, k, v exactly as forward slices them; a fused
    gate_up is (gate, up); Muon orthogonalizes each alone."""
    from dmuon.newton_schulz import orthogonalize
    from dmuon.params import route

    phi, pcfg = build("phi3")
    r = {r.name: r for r in route(phi)}
    qkv = r["model.layers.0.self_attn.qkv_proj.weight"]
    q = pcfg.num_attention_heads * (H // pcfg.num_attention_heads)
    parts = qkv.layout.pieces(qkv.param.detach())
    assert torch.equal(parts[0], qkv.param[:q]) and torch.equal(parts[2], qkv.param[-parts[2].shape[0]:])
    gpt, _ = build("gpt2")
    c = {r.name: r for r in route(gpt)}["transformer.h.0.attn.c_attn.weight"]
    pieces = c.layout.pieces(c.param.detach())
    assert [tuple(p.shape) for p in pieces] == [(H, H)] * 3 and torch.equal(pieces[1], c.param[:, H:2 * H])
    # a stacked view writes through to the parameter
    g = torch.randn_like(c.param)
    st = c.layout.stack(g)
    assert torch.equal(c.layout.unstack(orthogonalize(st)), torch.cat([orthogonalize(p) for p in
                                                                         c.layout.pieces(g)], dim=1))


def test_per_head_needs_the_attention_shape_and_gqa_fused_qkv_is_refused_by_dmuon():
    from dmuon.errors import InputError
    from dmuon.params import decide

    with pytest.raises(InputError, match="attention shape"):
        decide("layers.0.self_attn.qkv_proj.weight", (96, 32))
    with pytest.raises(InputError, match="head_dim"):
        from dmuon.params import AttentionShape

        decide("layers.0.self_attn.q_proj.weight", (30, 32), per_head=True, attention=AttentionShape(4, 4, 8))


def test_warn_no_muon_names_a_3d_parameter_left_to_adamw():
    results = _results(1, "warn")
    assert any("conv" in w and "AdamW" in w for w in results[0])


def _warn_rank(rank, world):
    import warnings

    import dmuon

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model.register_parameter("conv", torch.nn.Parameter(torch.randn(2, 3, 4)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dmuon.DMuon(model)
    return [str(w.message) for w in caught]


# ---- distributed = single-process Muon ----------------------------------------------------------------
STEPS = 3


def tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(3, V, (2, 12), generator=g)


def loss_of(model, ids) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference(family: str, world: int, per_head: bool = False) -> dict:
    import dmuon

    model, _ = build(family)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, per_head=per_head)
    for step in range(STEPS):
        for r in range(world):
            (loss_of(model, tokens(step, r)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def train(rank: int, world: int, family: str, layout: str, strategy: str, ckpt: str | None = None,
          per_head: bool = False):
    import dmuon

    model, _ = build(family)
    if layout != "replicated":
        dmuon.shard_model(model, layout)
    cls = dmuon.DMuon if strategy == "dmuon" else dmuon.NaiveMuon
    opt = cls(model, lr=0.02, adamw_lr=1e-3, timeout_s=60, per_head=per_head)
    for step in range(STEPS):
        loss_of(model, tokens(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    out = {n: full(p.detach()).clone() for n, p in model.named_parameters()}

    if ckpt is not None:  # sharded DCP checkpoint, then a fresh model and optimizer resume from it
        from dmuon.runtime.checkpoint import load_checkpoint, save_checkpoint

        save_checkpoint(ckpt, model, opt)
        fresh, _ = build(family, seed=7)
        if layout != "replicated":
            dmuon.shard_model(fresh, layout)
        opt2 = cls(fresh, lr=0.02, adamw_lr=1e-3, timeout_s=60)
        load_checkpoint(ckpt, fresh, opt2)
        for m, o in ((model, opt), (fresh, opt2)):
            loss_of(m, tokens(STEPS, rank)).backward()
            o.step()
            o.zero_grad()
            o.synchronize()
        a = {n: full(p.detach()) for n, p in model.named_parameters()}
        b = {n: full(p.detach()) for n, p in fresh.named_parameters()}
        out["__resume_bitwise__"] = all(torch.equal(a[n], b[n]) for n in a)
    opt.close()
    return out


def run_family(rank: int, world: int, family: str, cases: list, ckpt_dir: str | None,
               per_head: bool = False):
    torch.set_num_threads(1)
    got = {}
    for layout, strategy in cases:
        ckpt = f"{ckpt_dir}/{layout}-{strategy}" if ckpt_dir and layout != "replicated" and \
            strategy == "dmuon" else None
        got[(layout, strategy)] = train(rank, world, family, layout, strategy, ckpt, per_head)
    return got


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12)) if b.numel() else 0.0


def compared(name: str, t: torch.Tensor) -> torch.Tensor:
    """What a parameter is compared on. Key biases are left out (Qwen2's k_proj.bias, the middle third of
    GPT-2's c_attn.bias): the softmax is invariant to them, so their exact gradient is 0 and what the ranks
    sum is rounding noise, which AdamW normalizes to steps of lr size in an order-dependent direction
    (measured 2e-5 - 9.5e-5 apart in every layout and in NaiveMuon alike; scripts/hf_matrix.py)."""
    if name.endswith("attn.c_attn.bias"):
        return torch.cat([t[:H], t[2 * H:]])
    if name.endswith("self_attn.k_proj.bias"):
        return t[:0]
    return t


LAYOUTS = ["replicated", "fsdp2-owner", "fsdp2-sharded"]
ALL = [(lay, s) for lay in LAYOUTS for s in ("dmuon", "naive")]
RUNS = [  # (family, ranks, cases, checkpoint): every family on 2 ranks, the MoE on 1 and 4 too
    ("qwen3_moe", 2, ALL, True),
    ("qwen3_moe", 4, [(lay, "dmuon") for lay in LAYOUTS], False),
    ("mixtral", 2, [("replicated", "dmuon"), ("fsdp2-sharded", "dmuon"), ("fsdp2-owner", "naive")], False),
    ("deepseek_v3", 2, [("fsdp2-owner", "dmuon"), ("fsdp2-sharded", "naive")], False),
    ("phi3", 2, [("replicated", "dmuon"), ("fsdp2-sharded", "dmuon"), ("replicated", "naive")], False),
    ("gpt2", 2, [("fsdp2-owner", "dmuon"), ("fsdp2-sharded", "dmuon")], False),
    ("llama", 2, [("fsdp2-sharded", "dmuon")], False),
    ("qwen3_moe", 1, [("replicated", "dmuon"), ("fsdp2-sharded", "naive")], False),
    ("qwen2", 2, [("replicated", "dmuon"), ("fsdp2-owner", "naive")], False),
    ("qwen3", 2, [("fsdp2-owner", "dmuon")], False),
    ("gemma", 2, [("fsdp2-sharded", "dmuon")], False),
]


@pytest.mark.distributed
@pytest.mark.parametrize("family,world,cases,ckpt", RUNS, ids=[f"{f}-{w}r" for f, w, *_ in RUNS])
def test_hf_model_distributed_equals_single_process_muon(family, world, cases, ckpt):
    want = reference(family, world)
    results = _results(world, ("run", family))
    for rank, got in enumerate(results):
        for case, weights in got.items():
            resumed = weights.pop("__resume_bitwise__", None)
            assert resumed in (None, True), f"{family} {case} rank {rank}: resumed training differs"
            worst = max(rel(compared(n, weights[n]), compared(n, want[n])) for n in want)
            assert worst < 1e-5, f"{family} {case} rank {rank}: {worst:.2e} from single-process Muon"


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["gpt2", "phi3"])
def test_per_head_distributed_equals_single_process_per_head_muon(family):
    """per_head=True: DMuon / NaiveMuon equal `Muon(per_head=True)` (GPT-2: c_attn column blocks and the
    Conv1D c_proj's row blocks per head; Phi-3: the fused qkv_proj's rows per head), which is not whole
    Muon's update."""
    want = reference(family, 2, per_head=True)
    whole = reference(family, 2)
    assert max(rel(compared(n, whole[n]), compared(n, want[n])) for n in want) > 1e-3
    for got in _results(2, ("per_head", family)):
        assert list(got) == PER_HEAD_CASES
        for case, weights in got.items():
            worst = max(rel(compared(n, weights[n]), compared(n, want[n])) for n in want)
            assert worst < 1e-5, f"{family} per head {case}: {worst:.2e} from single-process Muon"


# ---- one spawn per rank count runs every distributed case (the module docstring) ----------------------
PER_HEAD_CASES = [("replicated", "dmuon"), ("fsdp2-sharded", "dmuon"), ("fsdp2-owner", "naive")]


def run_battery(rank: int, world: int, todo: list) -> dict:
    out = {}
    for key, args in todo:
        try:
            out[key] = _warn_rank(rank, world) if key == "warn" else run_family(rank, world, *args)
        except Exception:  # noqa: BLE001 - reported by the case's own test
            out[key] = {"failed": traceback.format_exc()}
    return out


@functools.cache
def _battery(world: int) -> tuple:
    todo = [(("run", f), (f, cases, scratch_dir(f"dmuon-hf-{f}-") if ckpt else None))
            for f, w, cases, ckpt in RUNS if w == world]
    if world == 1:
        todo.append(("warn", ()))
    if world == 2:
        todo += [(("per_head", f), (f, PER_HEAD_CASES, None, True)) for f in ("gpt2", "phi3")]
    return tuple(run_distributed(run_battery, world, (todo,), timeout_s=280))


def _results(world: int, key) -> list:
    per_rank = [r[key] for r in _battery(world)]
    for rank, res in enumerate(per_rank):
        assert "failed" not in res, f"{key} rank {rank}: {res['failed']}"
    return per_rank
