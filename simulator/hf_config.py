"""A model's weight matrices from a local Hugging Face `config.json` (plain JSON: no transformers, no hub).

`load_model(path)` reads a config.json (or a folder holding one, or the name of a model shipped in
experiments/models/) and returns the same `simulator.workload.Workload` the catalog gives: one
`ParamSpec` per parameter as transformers 5 names and shapes it, in forward order, with its shape (rows =
out features, cols = in features, as torch's Linear stores it), whether Muon or AdamW updates it and as
which matrices, both decided by the runtime's own routing rule (`dmuon.params.decide`: a fused parameter
is one ParamSpec of `count` matrices named `pieces`), and how many times per token the forward pass
multiplies by it (`matmuls_per_token`, what `simulator.compute` charges FLOPs for). per_head=True cuts the
attention matrices per head, as `DMuon(model, per_head=True)` does.

Families (model_type): llama, mistral, qwen2, qwen2_moe, qwen3, qwen3_moe, mixtral, deepseek_v3 (also
read for kimi_k2, which uses its architecture), gemma, phi3 (fused qkv_proj: q, k, v row blocks; fused
gate_up_proj: gate, up) and gpt2 (Conv1D weights stored (in, out); c_attn: q, k, v column blocks;
wte / wpe embeddings; tied head). What each contributes:

    embed_tokens (vocab x hidden)            AdamW, layer 0; tied embeddings (tie_word_embeddings, default
                                             true for gemma) have no lm_head: the head matmul is charged to
                                             the last layer (simulator.compute)
    per decoder layer (one simulator layer)  input / post-attention norms (1 x hidden, AdamW)
      attention, GQA                         q_proj (heads*head_dim x hidden), k_proj / v_proj
                                             (kv_heads*head_dim x hidden), o_proj (hidden x heads*head_dim),
                                             Muon; head_dim from the config when given, else hidden/heads;
                                             q/k/v biases for qwen2 (and attention_bias), AdamW; qwen3's
                                             per-head q_norm / k_norm (1 x head_dim), AdamW
      attention, MLA (deepseek_v3)           q_a_proj (q_lora_rank x hidden), q_a_layernorm, q_b_proj
                                             (heads*(qk_nope+qk_rope) x q_lora_rank) (or q_proj when
                                             q_lora_rank is null), kv_a_proj_with_mqa
                                             (kv_lora_rank+qk_rope x hidden), kv_a_layernorm, kv_b_proj
                                             (heads*(qk_nope+v_head) x kv_lora_rank), o_proj
                                             (hidden x heads*v_head)
      dense MLP                              gate_proj / up_proj (intermediate x hidden), down_proj, Muon
      MoE MLP                                E routed experts (moe_intermediate_size; mixtral:
                                             intermediate_size) in two fused parameters, mlp.experts.
                                             gate_up_proj (E, 2I, H): 2E matrices, and down_proj (E, H, I):
                                             E matrices (`Workload.experts_apart` makes each matrix its own
                                             ParamSpec, as expert parallelism places them); used by top_k/E
                                             of the tokens; the router mlp.gate (E x hidden): AdamW, as the
                                             Muon recipes keep routers (deepseek's e_score_correction_bias
                                             is a buffer: no optimizer); shared experts (n_shared_experts x
                                             moe_intermediate_size, or shared_expert_intermediate_size with
                                             its 1 x hidden shared_expert_gate) used by every token
      which layers are MoE                   deepseek_v3: i >= first_k_dense_replace and i %
                                             moe_layer_freq == 0; qwen*_moe: not in mlp_only_layers and
                                             (i+1) % decoder_sparse_step == 0; mixtral: all
    final norm, lm_head (vocab x hidden)     AdamW, one layer after the last block
    MTP modules (num_nextn_predict_layers)   deepseek_v3 only: per module enorm, hnorm, eh_proj
                                             (hidden x 2 hidden, Muon), one MoE decoder layer and its
                                             shared_head norm, one layer each after the head; embedding and
                                             head are shared with the main model (not counted twice; the
                                             head's matmul is charged once more per module)

Attention FLOPs use each q projection's `attn_width`: heads*head_dim for GQA, heads*(qk_head + v_head)/2
for MLA (scores use the qk width, the value product the v width). Sliding windows are not modelled.
Configs are validated: an unknown model_type or a missing key is one InputError naming the supported
families and the key. The workload is cached per (path, modification time).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .workload_spec import MAX_COUNT, MAX_DIM, ParamSpec, Workload, WorkloadError

MODELS_DIR = Path(__file__).resolve().parent.parent / "experiments" / "models"
FAMILIES = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3",
            "gemma", "phi3", "gpt2")
ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi K2's config names its own type; the architecture is DeepSeek-V3's
_TIED_DEFAULT = {"gemma": True}  # transformers' defaults for tie_word_embeddings (others: false)
_COMMON = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_MOE_KEYS = {"qwen2_moe": "num_experts", "qwen3_moe": "num_experts", "mixtral": "num_local_experts",
             "deepseek_v3": "n_routed_experts"}
_MLA = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
COMPONENT = "model"


def model_names() -> tuple[str, ...]:
    """Models shipped in experiments/models/ (folders holding a config.json)."""
    if not MODELS_DIR.is_dir():
        return ()
    return tuple(sorted(p.parent.name for p in MODELS_DIR.glob("*/config.json")))


def model_path(text: str | Path) -> Path | None:
    """The config.json that `text` names (a .json file, a folder holding config.json, or a shipped model's
    name), or None when it names none of these."""
    p = Path(text)
    if p.suffix.lower() == ".json":
        return p
    if p.is_dir() and (p / "config.json").is_file():
        return p / "config.json"
    if str(text) in model_names():
        return MODELS_DIR / str(text) / "config.json"
    return None


def load_model(text: str | Path, per_head: bool = False) -> Workload:
    """The Workload of a Hugging Face config.json (see the module docstring); per_head: attention matrices
    cut per head, as `DMuon(model, per_head=True)` runs them."""
    path = model_path(text)
    if path is None:
        raise WorkloadError(f"model {str(text)!r} is not a config.json, a folder holding one, or a shipped "
                            f"model; shipped: {', '.join(model_names()) or 'none'}")
    if not path.is_file():
        raise WorkloadError(f"model config {str(path)!r} does not exist")
    return _load_cached(str(path.resolve()), path.stat().st_mtime_ns, bool(per_head))


@lru_cache(maxsize=8)
def _load_cached(path: str, _mtime_ns: int, per_head: bool = False) -> Workload:
    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise WorkloadError(f"{path}: a config.json must hold one JSON object, got {type(cfg).__name__}")
    p = Path(path)
    name = p.parent.name if p.name == "config.json" else p.stem
    return workload_from_config(cfg, name=name, source=path, per_head=per_head)


# ---- reading keys ----------------------------------------------------------------------------------
class _Cfg:
    """Typed access to a config dict; every error names the file, the key and the supported families."""

    def __init__(self, raw: dict, where: str, family: str):
        self.raw, self.where, self.family = raw, where, family

    def _fail(self, msg: str) -> WorkloadError:
        return WorkloadError(f"{self.where}: {msg} (model_type {self.family}; supported families: "
                             f"{', '.join(FAMILIES)})")

    def int(self, key: str, default=None, *, minimum: int = 1, none_ok: bool = False):
        v = self.raw.get(key, default)
        if v is None and key in self.raw and default is not None:
            v = default  # null means "the default" in transformers' configs
        if v is None:
            if none_ok:
                return None
            raise self._fail(f"missing key {key!r}")
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum or v > MAX_DIM:
            raise self._fail(f"{key} must be an integer in [{minimum}, {MAX_DIM}], got {v!r}")
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._fail(f"{key} must be true or false, got {v!r}")
        return v

    def int_list(self, key: str) -> tuple[int, ...]:
        v = self.raw.get(key) or []
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self._fail(f"{key} must be a list of layer indices, got {v!r}")
        return tuple(v)


@dataclass
class _Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int | None  # dense MLP width (None: no dense layer needs it)


# ---- building ----------------------------------------------------------------------------------------
class _Builder:
    """Adds the model's parameters by their transformers 5 names and shapes; each becomes one ParamSpec as
    the one routing rule (`dmuon.params.decide`) routes it: Muon or AdamW, and as which matrices (a fused
    expert parameter is E (or 2E: gate, up) matrices owned together, as the runtime owns it)."""

    def __init__(self, per_head: bool = False, attention=None):
        self.params: list[ParamSpec] = []
        self.layer = 0
        self.per_head, self.attention = per_head, attention

    def param(self, name: str, shape: tuple, matrix: str, *, kind: str | None = None,
              block: int | None = None, uses: float = 1.0, attn: float = 0.0, note: str = "") -> None:
        """A parameter named `name` (transformers' name less '.weight'), routed by `decide`."""
        from dmuon.params import decide

        full = name if len(shape) > 2 or name.endswith(".bias") else f"{name}.weight"
        use_muon, reason, layout = decide(full, shape, kind, per_head=self.per_head, attention=self.attention)
        if use_muon and not layout.uniform:
            shapes = ", ".join(f"{a}x{b}" for a, b in sorted(set(layout.shapes)))
            raise WorkloadError(f"{full}: its matrices have different shapes ({shapes}; {reason}); the "
                                "runtime owns a parameter's matrices as one stack, so it takes only "
                                "parameters whose matrices share one shape: accepted: per_head (--per-head)")
        if use_muon:
            (rows, cols), count = layout.piece_shape(0), layout.count
            pieces = tuple(layout.matrix_names(full)) if count > 1 else ()
        else:
            rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
            count, pieces = 1, ()
            if kind is None and len(shape) >= 2 and "router" in reason:
                note = note or "MoE router: AdamW"
        self.params.append(ParamSpec(name, COMPONENT, matrix, rows, cols, self.layer,
                                     "muon" if use_muon else "adamw", block, note, uses, attn, count, pieces))

    def add(self, name: str, matrix: str, rows: int, cols: int, optimizer: str, *, block: int | None = None,
            uses: float = 1.0, attn: float = 0.0, note: str = "", kind: str | None = None) -> None:
        """A 2-D weight (rows x cols); `optimizer` is what the rule must say (checked)."""
        self.param(name, (rows, cols), matrix, kind=kind, block=block, uses=uses, attn=attn, note=note)
        got = self.params[-1].optimizer
        if got != optimizer:
            raise AssertionError(f"{name}: the routing rule says {got}, the reader expected {optimizer}")

    def vector(self, name: str, matrix: str, n: int, block: int | None = None) -> None:
        """A norm weight or a bias: AdamW, not a matmul."""
        self.param(name, (n,), matrix, block=block, uses=0.0)

    def mlp(self, prefix: str, inter: int, hidden: int, block: int, *, uses: float = 1.0,
            names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), kind: str = "mlp") -> None:
        gate, up, down = names
        self.add(f"{prefix}.{gate}", f"{kind}.{gate}", inter, hidden, "muon", block=block, uses=uses)
        self.add(f"{prefix}.{up}", f"{kind}.{up}", inter, hidden, "muon", block=block, uses=uses)
        self.add(f"{prefix}.{down}", f"{kind}.{down}", hidden, inter, "muon", block=block, uses=uses)

    def experts(self, prefix: str, n: int, inter: int, hidden: int, block: int, uses: float) -> None:
        """transformers 5's fused experts: gate_up_proj (E, 2I, H), down_proj (E, H, I)."""
        self.param(f"{prefix}.gate_up_proj", (n, 2 * inter, hidden), "experts.gate_up_proj", block=block,
                   uses=uses)
        self.param(f"{prefix}.down_proj", (n, hidden, inter), "experts.down_proj", block=block, uses=uses)


def _family(raw: dict, where: str) -> str:
    mt = raw.get("model_type")
    if mt is None:
        raise WorkloadError(f"{where}: missing key 'model_type'; supported families: {', '.join(FAMILIES)}")
    family = ALIASES.get(mt, mt)
    if family not in FAMILIES:
        raise WorkloadError(f"{where}: model_type {mt!r} is not supported; supported families: "
                            f"{', '.join(FAMILIES)} (and {', '.join(ALIASES)} as deepseek_v3)")
    return family


def _dims(c: _Cfg, needs_dense: bool) -> _Dims:
    for key in _COMMON:
        c.int(key)
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    kv = c.int("num_key_value_heads", heads)
    if heads % kv:
        raise c._fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = c.int("head_dim", none_ok=True)
    if head_dim is None:
        if hidden % heads:
            raise c._fail(f"missing key 'head_dim' (hidden_size {hidden} is not a multiple of "
                          f"num_attention_heads {heads})")
        head_dim = hidden // heads
    return _Dims(hidden, c.int("num_hidden_layers"), heads, kv, head_dim, c.int("vocab_size"),
                 c.int("intermediate_size") if needs_dense else None)


def _expert_key(c: _Cfg, family: str) -> str:
    """The key holding the routed-expert count: the family's, or transformers 5's `num_local_experts` (what
    its Qwen3-MoE config writes for `num_experts`)."""
    key = _MOE_KEYS[family]
    return key if key in c.raw or "num_local_experts" not in c.raw else "num_local_experts"


def _moe_layers(c: _Cfg, family: str, n_layers: int) -> list[bool]:
    if family not in _MOE_KEYS:
        return [False] * n_layers
    experts = c.int(_expert_key(c, family), minimum=0)
    if experts == 0:
        return [False] * n_layers
    if family == "mixtral":
        return [True] * n_layers
    if family == "deepseek_v3":
        k, freq = c.int("first_k_dense_replace", 0, minimum=0), c.int("moe_layer_freq", 1)
        return [i >= k and i % freq == 0 for i in range(n_layers)]
    skip, step = set(c.int_list("mlp_only_layers")), c.int("decoder_sparse_step", 1)
    return [i not in skip and (i + 1) % step == 0 for i in range(n_layers)]


def _attention(b: _Builder, c: _Cfg, family: str, d: _Dims, i: int, prefix: str) -> None:
    h = d.hidden
    if family == "deepseek_v3":
        rank_kv = c.int("kv_lora_rank")
        nope, rope, v = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim")
        q_rank = c.int("q_lora_rank", none_ok=True)
        bias = c.bool("attention_bias", False)
        qk = d.heads * (nope + rope)
        attn = d.heads * (nope + rope + v) / 2  # QK^T on the qk width, PV on the v width
        if q_rank is None:
            b.add(f"{prefix}.q_proj", "q_proj", qk, h, "muon", block=i, attn=attn)
        else:
            b.add(f"{prefix}.q_a_proj", "q_a_proj", q_rank, h, "muon", block=i)
            if bias:
                b.vector(f"{prefix}.q_a_proj.bias", "q_a_proj.bias", q_rank, i)
            b.vector(f"{prefix}.q_a_layernorm", "q_a_layernorm", q_rank, i)
            b.add(f"{prefix}.q_b_proj", "q_b_proj", qk, q_rank, "muon", block=i, attn=attn)
        b.add(f"{prefix}.kv_a_proj_with_mqa", "kv_a_proj_with_mqa", rank_kv + rope, h, "muon", block=i)
        if bias:
            b.vector(f"{prefix}.kv_a_proj_with_mqa.bias", "kv_a_proj_with_mqa.bias", rank_kv + rope, i)
        b.vector(f"{prefix}.kv_a_layernorm", "kv_a_layernorm", rank_kv, i)
        b.add(f"{prefix}.kv_b_proj", "kv_b_proj", d.heads * (nope + v), rank_kv, "muon", block=i)
        b.add(f"{prefix}.o_proj", "o_proj", h, d.heads * v, "muon", block=i)
        if bias:
            b.vector(f"{prefix}.o_proj.bias", "o_proj.bias", h, i)
        return
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    if family == "phi3":  # fused qkv_proj: rows [q | k | v], cut into its matrices by the routing rule
        b.add(f"{prefix}.qkv_proj", "qkv_proj", q + 2 * kv, h, "muon", block=i, attn=q)
        b.add(f"{prefix}.o_proj", "o_proj", h, q, "muon", block=i)
        return
    b.add(f"{prefix}.q_proj", "q_proj", q, h, "muon", block=i, attn=q)
    b.add(f"{prefix}.k_proj", "k_proj", kv, h, "muon", block=i)
    b.add(f"{prefix}.v_proj", "v_proj", kv, h, "muon", block=i)
    b.add(f"{prefix}.o_proj", "o_proj", h, q, "muon", block=i)
    qkv_bias = family in ("qwen2", "qwen2_moe") or c.bool("attention_bias", False)
    if qkv_bias:
        for proj, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            b.vector(f"{prefix}.{proj}.bias", f"{proj}.bias", n, i)
    if family not in ("qwen2", "qwen2_moe") and c.bool("attention_bias", False):
        b.vector(f"{prefix}.o_proj.bias", "o_proj.bias", h, i)
    if family in ("qwen3", "qwen3_moe"):
        b.vector(f"{prefix}.q_norm", "q_norm", d.head_dim, i)
        b.vector(f"{prefix}.k_norm", "k_norm", d.head_dim, i)


def _moe(b: _Builder, c: _Cfg, family: str, d: _Dims, i: int, prefix: str) -> None:
    h = d.hidden
    n = c.int(_expert_key(c, family))
    top_k = c.int("num_experts_per_tok")
    if top_k > n:
        raise c._fail(f"num_experts_per_tok {top_k} exceeds the {n} experts")
    if n > MAX_COUNT:
        raise c._fail(f"{_expert_key(c, family)} must be <= {MAX_COUNT}, got {n}")
    share = top_k / n
    inter = c.int("intermediate_size" if family == "mixtral" else "moe_intermediate_size")
    mod = "mlp"  # transformers 5 names every family's MoE block `mlp` (Mixtral's was block_sparse_moe)
    # the router; DeepSeek-V3's e_score_correction_bias is a buffer (no optimizer updates it)
    b.add(f"{prefix}.{mod}.gate", "router", n, h, "adamw", block=i, note="MoE router: AdamW")
    b.experts(f"{prefix}.{mod}.experts", n, inter, h, i, share)
    if family == "deepseek_v3":
        shared = c.int("n_shared_experts", 0, minimum=0)
        if shared:
            b.mlp(f"{prefix}.mlp.shared_experts", inter * shared, h, i, kind="shared_experts")
    elif family == "qwen2_moe":
        width = c.int("shared_expert_intermediate_size", 0, minimum=0)
        if width:
            b.mlp(f"{prefix}.mlp.shared_expert", width, h, i, kind="shared_expert")
            b.add(f"{prefix}.mlp.shared_expert_gate", "shared_expert_gate", 1, h, "adamw", block=i)


def _decoder_layer(b: _Builder, c: _Cfg, family: str, d: _Dims, i: int, moe: bool) -> None:
    prefix = f"model.layers.{i}"
    b.vector(f"{prefix}.input_layernorm", "input_layernorm", d.hidden, i)
    _attention(b, c, family, d, i, f"{prefix}.self_attn")
    b.vector(f"{prefix}.post_attention_layernorm", "post_attention_layernorm", d.hidden, i)
    if moe:
        _moe(b, c, family, d, i, prefix)
    elif family == "phi3":  # fused gate_up_proj: rows [gate | up]
        b.add(f"{prefix}.mlp.gate_up_proj", "mlp.gate_up_proj", 2 * d.intermediate, d.hidden, "muon", block=i)
        b.add(f"{prefix}.mlp.down_proj", "mlp.down_proj", d.hidden, d.intermediate, "muon", block=i)
    else:
        b.mlp(f"{prefix}.mlp", d.intermediate, d.hidden, i)
        if family == "llama" and c.bool("mlp_bias", False):
            widths = (("gate_proj", d.intermediate), ("up_proj", d.intermediate), ("down_proj", d.hidden))
            for proj, n in widths:
                b.vector(f"{prefix}.mlp.{proj}.bias", f"mlp.{proj}.bias", n, i)


def _gpt2(b: _Builder, c: _Cfg) -> int:
    """GPT-2: Conv1D weights stored (in, out); c_attn a fused QKV (column blocks q, k, v); tied head."""
    h, n, heads, vocab = c.int("n_embd"), c.int("n_layer"), c.int("n_head"), c.int("vocab_size")
    if h % heads:
        raise c._fail(f"n_embd {h} is not a multiple of n_head {heads}")
    inner = c.int("n_inner", 4 * h)
    tied = c.bool("tie_word_embeddings", True)
    b.param("transformer.wte", (vocab, h), "embed_tokens", kind="embedding",
            note="tied with lm_head" if tied else "untied")  # tied: simulator.compute charges the head
    b.param("transformer.wpe", (c.int("n_positions", 1024), h), "embed_positions", kind="embedding", uses=0.0)
    for i in range(n):
        b.layer += 1
        p = f"transformer.h.{i}"
        for ln in ("ln_1", "ln_2"):
            b.vector(f"{p}.{ln}", ln, h, i)
            b.vector(f"{p}.{ln}.bias", f"{ln}.bias", h, i)
        for mod, (rows, cols), attn in (("attn.c_attn", (h, 3 * h), h), ("attn.c_proj", (h, h), 0.0),
                                        ("mlp.c_fc", (h, inner), 0.0), ("mlp.c_proj", (inner, h), 0.0)):
            b.param(f"{p}.{mod}", (rows, cols), mod, kind="conv1d", block=i, attn=attn)
            b.vector(f"{p}.{mod}.bias", f"{mod}.bias", cols, i)
    b.layer += 1
    b.vector("transformer.ln_f", "norm", h)
    b.vector("transformer.ln_f.bias", "norm.bias", h)
    if not tied:
        b.param("lm_head", (vocab, h), "lm_head", kind="head")
    return n


def workload_from_config(raw: dict, *, name: str = "model", source: str = "config.json",
                         per_head: bool = False) -> Workload:
    """The Workload of a parsed config.json dict (see the module docstring); per_head: attention matrices
    cut per head (`dmuon.params.decide`, as DMuon(model, per_head=True) runs them)."""
    from dmuon.params import attention_shape

    family = _family(raw, source)
    c = _Cfg(raw, source, family)
    if family == "gpt2":
        b = _Builder(per_head, attention_shape(raw))
        _gpt2(b, c)
        params = tuple(b.params)
        n_all = sum(p.numel for p in params)
        return Workload(name=name, params=params, notes=(_summary(family, params, n_all, 0, True),),
                        source=source)
    mtp = c.int("num_nextn_predict_layers", 0, minimum=0) if family == "deepseek_v3" else 0
    moe = _moe_layers(c, family, c.int("num_hidden_layers") + mtp)  # MTP layers follow the same rule
    d = _dims(c, needs_dense=not all(moe))
    if family == "deepseek_v3":
        for key in _MLA:
            c.int(key)
    tied = c.bool("tie_word_embeddings", _TIED_DEFAULT.get(family, False))
    b = _Builder(per_head, attention_shape(raw))
    b.add("model.embed_tokens", "embed_tokens", d.vocab, d.hidden, "adamw",
          note="tied with lm_head" if tied else "untied")
    for i in range(d.layers):
        b.layer += 1
        _decoder_layer(b, c, family, d, i, moe[i])
    b.layer += 1
    b.vector("model.norm", "norm", d.hidden)
    if not tied:
        b.add("lm_head", "lm_head", d.vocab, d.hidden, "adamw", uses=1.0 + mtp, note="untied")
    n_main = sum(p.numel for p in b.params)
    for k in range(mtp):  # DeepSeek-V3's multi-token prediction modules, after the head
        b.layer += 1
        i = d.layers + k
        prefix = f"model.layers.{i}"
        b.vector(f"{prefix}.enorm", "mtp.enorm", d.hidden, i)
        b.vector(f"{prefix}.hnorm", "mtp.hnorm", d.hidden, i)
        b.add(f"{prefix}.eh_proj", "mtp.eh_proj", d.hidden, 2 * d.hidden, "muon", block=i)
        _decoder_layer(b, c, family, d, i, moe[i])
        b.vector(f"{prefix}.shared_head.norm", "mtp.final_norm", d.hidden, i)
    params = tuple(b.params)
    names = set()
    for p in params:
        if p.name in names:
            raise WorkloadError(f"{source}: duplicate parameter name {p.name!r}")
        names.add(p.name)
    return Workload(name=name, params=params, notes=(_summary(family, params, n_main, mtp, tied),),
                    source=source)


def _summary(family: str, params: tuple[ParamSpec, ...], n_main: int, mtp: int, tied: bool) -> str:
    total = sum(p.numel for p in params)
    active = active_params(Workload("summary", params))
    muon = [p for p in params if p.optimizer == "muon"]
    shapes = len({(p.rows, p.cols) for p in muon})
    n_matrices = sum(p.count for p in muon)
    fused = sum(1 for p in muon if p.count > 1)
    extra = (f" + {total - n_main:,} in {mtp} MTP module(s) (num_nextn_predict_layers; set it to 0 in "
             "the file to leave them out)") if mtp else ""
    return (f"from a Hugging Face config.json ({family}): {n_main:,} parameters{extra}; {active:,.0f} "
            f"active per token (embedding and head included, as model cards count them); {n_matrices:,} "
            f"Muon matrices in {shapes} shapes ({fused:,} parameters hold several, each owned whole); "
            f"embeddings, {'tied ' if tied else ''}head, norms, biases "
            "and routers: AdamW")


from .hf_summary import active_params, flops_per_token, matrix_table, n_params  # noqa: E402 (re-exported)

__all__ = ["FAMILIES", "MODELS_DIR", "active_params", "flops_per_token", "load_model", "matrix_table",
           "model_names", "model_path", "n_params", "workload_from_config"]
