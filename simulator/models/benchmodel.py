"""The benchmark model: a decoder-only transformer whose weight matrices have a workload's shapes, and
the optimizer each strategy of `harness bench step` builds on it.

It lives in the simulator because both sides of the closed loop use it: `harness bench step` trains it
on real processes, and `simulator.calibration.calibrate_cpu` measures it to write the `cpu` profile the simulator
prices those runs with (the harness imports the simulator, never the reverse).

`build_bench_model(workload)` takes a (usually `.scaled(...)`) `simulator.models.workload.Workload` whose
blocks have attention q/k/v/o and MLP gate/up/down matrices (Qwen / Llama style; the names q_proj,
k_proj, ... of the catalog) and builds:

    embed_tokens (vocab x hidden)  ->  L x [RMSNorm -> attention -> residual, RMSNorm -> SwiGLU MLP ->
    residual]  ->  RMSNorm  ->  lm_head (vocab x hidden; tied to the embedding if the workload has none)

Attention is causal `F.scaled_dot_product_attention` with grouped KV heads (no rotary embedding: it
has no weights and changes no shape). head_dim = gcd(q_out, kv_out), halved while above 128 (Qwen2.5-7B:
128; at width 1/16: 32). Linear layers have no bias. Every matrix has exactly the workload's shape, so
the simulator and this model describe the same matrices (parameter names: model.layers.<i>.self_attn.
q_proj.weight, ...; `matrix_shapes()` lists them).

`wide=(rows, cols)` adds one more Muon matrix of that shape after the last block (`WideMix`, parameter
model.wide.weight): a model with one dominant matrix next to small ones, where splitting that matrix's NS
over a group of ranks (DMuon max_split) is what can shorten the optimizer step.

`shard_for` applies a bench layout (ddp | fsdp2-owner | fsdp2-sharded) to the model and
`bench_optimizer` builds a strategy's optimizer (dmuon | naive | adamw) on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dmuon.errors import InputError

ATTN = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}
MLP = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class Attention(nn.Module):
    def __init__(self, hidden: int, q_out: int, kv_out: int, head_dim: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, q_out, bias=False)
        self.k_proj = nn.Linear(hidden, kv_out, bias=False)
        self.v_proj = nn.Linear(hidden, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, hidden, bias=False)
        self.head_dim, self.heads, self.kv_heads = head_dim, q_out // head_dim, kv_out // head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, self.heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, d).transpose(1, 2)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * d))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden: int, q_out: int, kv_out: int, ffn: int, head_dim: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attn = Attention(hidden, q_out, kv_out, head_dim)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class WideMix(nn.Module):
    """A residual mixer around one rows x cols weight W: the hidden state tiled to `cols` features, W
    applied, its `rows` outputs folded back onto the hidden size by summing hidden-size chunks (zero
    padded). Every entry of W gets a gradient; no other weights."""

    def __init__(self, hidden: int, rows: int, cols: int):
        super().__init__()
        self.hidden, self.rows, self.cols = hidden, rows, cols
        self.weight = nn.Parameter(torch.empty(rows, cols))
        nn.init.normal_(self.weight, 0.0, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden
        tiled = x.repeat(1, 1, -(-self.cols // h))[..., :self.cols]
        y = F.linear(tiled, self.weight)
        chunks = -(-self.rows // h)
        y = F.pad(y, (0, chunks * h - self.rows)).view(*y.shape[:-1], chunks, h).sum(-2)
        return x + y


class Decoder(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: list[tuple[int, int, int]], head_dim: int,
                 wide: tuple[int, int] | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([Block(hidden, q, kv, ffn, head_dim) for q, kv, ffn in layers])
        self.wide = WideMix(hidden, *wide) if wide else None
        self.norm = nn.RMSNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        if self.wide is not None:
            x = self.wide(x)
        return self.norm(x)


class BenchModel(nn.Module):
    """Decoder + lm_head; forward(tokens, targets) returns the mean next-token cross-entropy."""

    def __init__(self, vocab: int, hidden: int, layers: list[tuple[int, int, int]], head_dim: int,
                 tied: bool, wide: tuple[int, int] | None = None):
        super().__init__()
        self.model = Decoder(vocab, hidden, layers, head_dim, wide)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model(tokens))
        return F.cross_entropy(logits.reshape(-1, self.vocab).float(), targets.reshape(-1))

    def matrix_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in self.named_parameters() if p.dim() == 2}


def head_dim_for(q_out: int, kv_out: int) -> int:
    d = math.gcd(q_out, kv_out)
    while d > 128 and d % 2 == 0:
        d //= 2
    return d


@dataclass(frozen=True)
class DecoderSpec:
    """The dimensions `build_bench_model` uses (validated from the workload)."""

    vocab: int
    hidden: int
    layers: tuple[tuple[int, int, int], ...]  # (q_out, kv_out, ffn) per block
    head_dim: int
    tied: bool


def decoder_spec(workload) -> DecoderSpec:
    """Check that the workload is a decoder-only LLM and read its dimensions (no weights allocated)."""
    comps: dict[str, set[str]] = {}
    for p in workload.params:
        if p.block is not None:
            comps.setdefault(p.component, set()).add(p.matrix)
    want = set(ATTN) | set(MLP)
    if len(comps) != 1 or not want <= next(iter(comps.values())):
        found = {c: sorted(n) for c, n in comps.items()}
        raise InputError(f"bench step builds decoder-only LLMs (one component whose blocks have "
                         f"{', '.join(sorted(want))}); workload {workload.name!r} has blocks {found}; "
                         "accepted: qwen2.5-7b, qwen2.5-1.5b, llama3.2-3b, llama3.1-8b or a custom workload "
                         "of that form")
    comp = next(iter(comps))
    params = [p for p in workload.params if p.component == comp]
    embed = next((p for p in params if p.matrix == "embed_tokens"), None)
    if embed is None:
        raise InputError(f"workload {workload.name!r} has no embed_tokens matrix: bench step needs it")
    vocab, hidden = embed.rows, embed.cols
    head = next((p for p in params if p.matrix == "lm_head"), None)
    if head is not None and (head.rows, head.cols) != (vocab, hidden):
        raise InputError(f"lm_head shape {(head.rows, head.cols)} differs from embed_tokens "
                         f"{(vocab, hidden)}")
    blocks: dict[int, dict[str, tuple[int, int]]] = {}
    for p in params:
        if p.block is not None and p.matrix in want:
            blocks.setdefault(p.block, {})[p.matrix] = (p.rows, p.cols)
    layers = []
    for b in sorted(blocks):
        s = blocks[b]
        q_out, kv_out, ffn = s["q_proj"][0], s["k_proj"][0], s["gate_proj"][0]
        expected = {"q_proj": (q_out, hidden), "k_proj": (kv_out, hidden), "v_proj": (kv_out, hidden),
                    "o_proj": (hidden, q_out), "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden),
                    "down_proj": (hidden, ffn)}
        if s != expected:
            raise InputError(f"workload {workload.name!r} block {b}: shapes {s} do not chain as a decoder "
                             f"block with hidden size {hidden} (expected {expected})")
        layers.append((q_out, kv_out, ffn))
    return DecoderSpec(vocab, hidden, tuple(layers), head_dim_for(layers[0][0], layers[0][1]), head is None)


def check_wide(wide) -> tuple[int, int] | None:
    """None or (rows, cols), two positive integers (the extra matrix of `build_bench_model`)."""
    if wide is None:
        return None
    ok = isinstance(wide, (tuple, list)) and len(wide) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 2 for v in wide)
    if not ok:
        raise InputError(f"wide matrix must be ROWSxCOLS, two integers >= 2 (e.g. 512x4096), got {wide!r}")
    return tuple(wide)


def build_bench_model(workload, *, seed: int = 0, device="cpu", dtype=torch.float32,
                      wide: tuple[int, int] | None = None) -> BenchModel:
    """The model for a workload (see the module docstring); same seed -> same weights on every rank.
    wide: (rows, cols) of one extra Muon matrix (`WideMix`), or None."""
    spec = decoder_spec(workload)
    wide = check_wide(wide)
    torch.manual_seed(seed)
    model = BenchModel(spec.vocab, spec.hidden, list(spec.layers), spec.head_dim, tied=spec.tied, wide=wide)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not n.endswith("norm.weight"):
                p.normal_(0.0, 0.02)
    return model.to(device=device, dtype=dtype)


def synthetic_batch(vocab: int, seq_len: int, micro_batch: int, *, seed: int, step: int, rank: int,
                    device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random tokens and next-token targets for one rank and step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def shard_for(model, strategy: str, layout: str, memory: str) -> str:
    """Apply the bench's FSDP2 layout to `model` (in place; a 1-D mesh over the ranks) and return the
    optimizer layout: 'ddp' -> 'replicated' (nothing applied); 'fsdp2-owner' -> DMuon keeps the Muon
    matrices outside FSDP2 ('fsdp2-owner'), NaiveMuon / adamw run on FSDP2-sharded matrices (the naive
    baseline on FSDP); 'fsdp2-sharded' -> everything FSDP2-sharded. memory 'free' = reshard after forward."""
    if layout == "ddp":
        return "replicated"
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.runtime.fsdp import shard_model

    target = "fsdp2-owner" if layout == "fsdp2-owner" and strategy == "dmuon" else "fsdp2-sharded"
    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", None), "layers", None)  # the bench model, Llama-like HF models
    shard_model(model, target, mesh=mesh, reshard_after_forward=memory == "free",
                blocks=list(layers) if layers is not None else None)  # else: every ModuleList's children
    return target


def bench_optimizer(strategy: str, model, *, overlap: bool, exchange: str, layout: str = "ddp",
                    memory: str = "keep", node_size: int | None = None, timeout_s: float = 600.0,
                    balancer: str = "lpt", profile: str | None = None, ns=None, comm_dtype=None,
                    max_split: int = 1):
    """The optimizer `harness bench step` runs for `strategy` on `model` (after `shard_for` applies the
    layout): dmuon -> DMuon, naive -> NaiveMuon, adamw -> DMuon with no Muon matrices (every parameter
    on replicated AdamW with bucketed async all-reduce, DDP-like). ns (a dmuon.NSConfig) and comm_dtype go
    to the Muon strategies, max_split to DMuon (owner groups that split one matrix's NS)."""
    from dmuon.distributed import DMuon, NaiveMuon

    common = dict(overlap=overlap, node_size=node_size, timeout_s=timeout_s, exchange=exchange,
                  balancer=balancer, profile=profile)
    if shard_for(model, strategy, layout, memory) == "fsdp2-owner":
        common["memory"] = memory
    if strategy == "adamw":
        return DMuon(model, muon_predicate=lambda name, p: False, warn_no_muon=False, shard_adamw=False,
                     **common)
    if strategy == "dmuon":
        return DMuon(model, ns=ns, comm_dtype=comm_dtype, max_split=max_split, **common)
    return NaiveMuon(model, ns=ns, comm_dtype=comm_dtype, **common)
