"""A Hugging Face causal LM built from a local config.json, shrunk when asked: what `harness bench step
--model` and examples/train_hf.py train. `transformers` is imported only here and only when a model is
built or checked (it is an optional dependency: `pip install transformers`); nothing is downloaded.

    raw = shrunk_config("experiments/models/llama-3.1-70b/config.json", layers=2, hidden=256, vocab=1024)
    model = build_model(raw, seed=0)              # same seed, same weights on every rank

What the shrink changes (`shrink`; every other key is kept, including the head and expert counts):
  --layers N  num_hidden_layers (gpt2: n_layer) = N; the per-layer keys follow: first_k_dense_replace
              (DeepSeek's dense first layers) is capped at N-1 so that one MoE layer remains,
              num_nextn_predict_layers (MTP; transformers builds no MTP module) at N, max_window_layers
              at N, mlp_only_layers keeps the indices < N, layer_types its first N entries.
  --hidden H  hidden_size (gpt2: n_embd) = H, and with f = H / hidden_size: every intermediate size
              (intermediate_size, moe_intermediate_size, shared_expert_intermediate_size, n_inner) x f,
              rounded to a multiple of 8 (at least 8: fused experts run grouped GEMMs, which want
              16-byte aligned rows), DeepSeek's MLA ranks (q_lora_rank, kv_lora_rank) x f, rounded
              (at least 1). The attention head counts are kept: a config without head_dim gets
              head_dim = H / num_attention_heads, so H must be a multiple of 2 x num_attention_heads
              (an even head_dim for the rotary embeddings); an explicit head_dim and DeepSeek's
              qk_nope_head_dim, qk_rope_head_dim, v_head_dim are scaled by f and rounded to an even
              number (at least 2).
  --vocab V   vocab_size = V; special token ids (bos / eos / pad) outside [0, V) become None.
The KV cache is switched off (use_cache = False: training only).
"""

from __future__ import annotations

import json
from pathlib import Path

from dmuon.errors import InputError

ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi K2 names its own type; its architecture is DeepSeek-V3's
INTERMEDIATE = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "n_inner")
MLA_RANKS = ("q_lora_rank", "kv_lora_rank")
HEAD_DIMS = ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _key(raw: dict, *names: str) -> str | None:
    return next((n for n in names if n in raw), None)


def read_config(text) -> tuple[Path, dict]:
    """The config.json `text` names (a .json file, a folder holding config.json, or a model shipped in
    experiments/models/) and its contents; InputError if it cannot be read."""
    from simulator.models.hf_config import model_names, model_path

    path = model_path(text)
    if path is None:
        raise InputError(f"model {str(text)!r} is not a config.json, a folder holding one, or a shipped "
                         f"model; shipped: {', '.join(model_names()) or 'none'}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"model config {str(path)!r} does not exist; give a path to a config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"model config {str(path)!r} cannot be read as JSON ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise InputError(f"model config {str(path)!r} has no model_type; a Hugging Face config.json names "
                         "one (e.g. \"model_type\": \"llama\")")
    return path, raw


def _positive(name: str, v) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise InputError(f"{name} must be a positive integer, got {v!r}")


def _even(x: float) -> int:
    return max(2, 2 * round(x / 2))


def shrink(raw: dict, *, layers: int | None = None, hidden: int | None = None,
           vocab: int | None = None) -> dict:
    """A copy of `raw` (a config.json's dict) shrunk as the module docstring says; InputError when the
    result would not be a valid model."""
    for name, v in (("layers", layers), ("hidden", hidden), ("vocab", vocab)):
        _positive(name, v)
    out = dict(raw, use_cache=False)
    if layers is not None:
        key = _key(out, "num_hidden_layers", "n_layer")
        if key is None:
            raise InputError("layers: the config has no num_hidden_layers (or n_layer) key to set")
        out[key] = layers
        if out.get("first_k_dense_replace"):
            out["first_k_dense_replace"] = min(out["first_k_dense_replace"], layers - 1)
        for k in ("num_nextn_predict_layers", "max_window_layers"):
            if isinstance(out.get(k), int):
                out[k] = min(out[k], layers)
        if isinstance(out.get("mlp_only_layers"), list):
            out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
        if isinstance(out.get("layer_types"), list):
            out["layer_types"] = out["layer_types"][:layers]
    if hidden is not None:
        key = _key(out, "hidden_size", "n_embd", "d_model")
        heads = out.get(_key(out, "num_attention_heads", "n_head") or "", None)
        if key is None or not isinstance(out[key], int) or not isinstance(heads, int):
            raise InputError("hidden: the config has no hidden_size and num_attention_heads to rescale")
        f = hidden / out[key]
        out[key] = hidden
        for k in INTERMEDIATE:  # multiples of 8: fused experts run grouped GEMMs (16-byte aligned rows)
            if isinstance(out.get(k), int) and not isinstance(out[k], bool):
                out[k] = max(8, 8 * round(out[k] * f / 8))
        for k in MLA_RANKS:
            if isinstance(out.get(k), int) and not isinstance(out[k], bool):
                out[k] = max(1, round(out[k] * f))
        explicit = [k for k in HEAD_DIMS if isinstance(out.get(k), int)]
        for k in explicit:
            out[k] = _even(out[k] * f)
        mla = "qk_rope_head_dim" in explicit or "kv_lora_rank" in out
        if not explicit and not mla and (hidden % heads or (hidden // heads) % 2):
            raise InputError(f"hidden={hidden} does not divide into the {heads} attention heads (kept): "
                             f"head_dim = {hidden}/{heads} must be an even integer (rotary embeddings); "
                             f"give a multiple of {2 * heads}")
    if vocab is not None:
        out["vocab_size"] = vocab
        for k in TOKEN_IDS:
            v = out.get(k)
            if isinstance(v, list):
                out[k] = [i for i in v if isinstance(i, int) and 0 <= i < vocab] or None
            elif isinstance(v, int) and not 0 <= v < vocab:
                out[k] = None
    return out


def _transformers():
    try:
        import transformers
    except ImportError:
        raise InputError("a Hugging Face model needs the transformers package (not installed here): "
                         "pip install transformers") from None
    return transformers


def hf_config(raw: dict):
    """The transformers config object of `raw` (no weights); InputError for an unknown model_type, one
    without a causal-LM class, or a config transformers refuses."""
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version")}
    model_type = ALIASES.get(raw["model_type"], raw["model_type"])
    if model_type not in CONFIG_MAPPING_NAMES:
        raise InputError(f"unknown model_type {raw['model_type']!r}: transformers {transformers.__version__} "
                         "has no such model; accepted: a causal LM it knows, e.g. llama, qwen2, qwen3, "
                         "qwen3_moe, mixtral, deepseek_v3, gemma, gpt2, phi3")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise InputError(f"model_type {raw['model_type']!r} has no causal-LM class in transformers "
                         "(AutoModelForCausalLM); accepted: a decoder LM such as llama, qwen3_moe, gpt2")
    try:
        return transformers.AutoConfig.for_model(model_type, **kw)
    except (ValueError, TypeError, KeyError) as e:
        raise InputError(f"transformers refuses this {model_type} config: {e}") from None


def shrunk_config(text, *, layers: int | None = None, hidden: int | None = None,
                  vocab: int | None = None) -> tuple[Path, dict]:
    """read_config + shrink + the checks hf_config makes: (path, the shrunk dict). Every InputError a
    build of this model could raise, without allocating its weights."""
    for name, v in (("layers", layers), ("hidden", hidden), ("vocab", vocab)):
        _positive(name, v)
    path, raw = read_config(text)
    raw = shrink(raw, layers=layers, hidden=hidden, vocab=vocab)
    hf_config(raw)
    return path, raw


def build_model(raw: dict, *, seed: int = 0, device="cpu", dtype=None):
    """The causal LM of a (shrunk) config dict, in training mode, with seeded weights (same seed: same
    weights on every rank), on `device` in `dtype` (default float32)."""
    import torch

    config = hf_config(raw)
    dtype = dtype or torch.float32
    torch.manual_seed(seed)
    model = _transformers().AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device=device, dtype=dtype).train()


def vocab_size(raw: dict) -> int:
    return int(raw.get("vocab_size") or 0)


def causal_lm_loss(model, tokens):
    """The model's next-token loss on `tokens` (labels = input_ids; the model shifts them)."""
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def model_name(path: Path) -> str:
    """'llama-3.1-70b' for experiments/models/llama-3.1-70b/config.json (the folder's name), else the
    file's stem."""
    return path.parent.name if path.name == "config.json" and path.parent.name else path.stem


__all__ = ["ALIASES", "build_model", "causal_lm_loss", "hf_config", "model_name", "n_params", "read_config",
           "shrink", "shrunk_config", "vocab_size"]
