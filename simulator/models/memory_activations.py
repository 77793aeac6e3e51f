"""Activation memory of a training step: the published formulas and a per-tensor count for any workload.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), section 4, for a GPT block (16-bit activations, 1-byte dropout masks, hidden h, heads
a, sequence s, micro-batch b, tensor parallel t), bytes per layer:

    no recompute, no TP                 sbh (34 + 5as/h)                       (eq. 1)
    TP, no sequence parallelism         sbh (10 + 24/t + 5as/(ht))             (eq. 2)
    TP + sequence parallelism           sbh/t (34 + 5as/h)                     (eq. 3)
    selective recompute (+ TP + SP)     sbh/t 34                               (eq. 6; no SP: 10 + 24/t)
    full recompute                      2 sbh (/ t with SP): the block's input only
    pipeline (1F1B)                     the first stage holds L/p layers x p micro-batches in flight = L
                                        layers' worth; interleaved with v model chunks x (1 + (p-1)/(p v))
    embedding + output layer + loss     sbhp/t (embedding dropout) + 4 sbh/t (1 + v/h)   (section 4.3)

`korthikanti_*` implement these as printed (the tests check them by hand). `block_bytes_per_token`
counts the saved tensors of any decoder block of a workload the way the paper counts them (every saved
input of a matmul once, a norm's input, the attention core's Q, K, V and output, the MLP's nonlinearity
inputs), so that a GPT block gives 34 h bytes per token (the paper's eq. 1 without the s^2 term) and a
LLaMA / Qwen block (RMSNorm, GQA, SwiGLU, no dropout) gives what its eager PyTorch code saves:
    h (q/k/v input) + 3 d_q (Q, K, V: GQA_REPEAT) + d_q (attention output) + h (MLP input) + 4f (SwiGLU)
    + 2h (norm inputs)
elements per token (`_elements`).
Attention: "flash" (default: SDPA / FlashAttention, no s x s tensor; its log-sum-exp, heads x s fp32,
under 2% of one of Q / K / V for head_dim >= 64, is left out) or "eager" (the paper's 5as^2b bytes).
"""

from __future__ import annotations

import re

from .workload_spec import ParamSpec, Workload

RECOMPUTE = ("none", "selective", "full")
# K and V are expanded to the query heads before attention (repeat_kv / repeat_interleave in torchtitan's
# Llama, HF Llama / Qwen2 and simulator.models.benchmodel): the attention saves the expanded tensors (d_q wide)
GQA_REPEAT = True
ATTENTION = ("flash", "eager")
_ATTN_IN = re.compile(r"^(q_proj|k_proj|v_proj|qkv_proj|q|k|v|wq|wk|wv|wqkv|c_attn|query_key_value|query|key|"
                      r"value|q_a_proj|kv_a_proj_with_mqa)(_qkvo)?$")
_Q = re.compile(r"^(q_proj|q|wq|query|q_b_proj)$")
_KV = re.compile(r"^(k_proj|v_proj|k|v|wk|wv|key|value|kv_b_proj)$")
_QKV = re.compile(r"^(qkv|qkv_proj|wqkv|c_attn|query_key_value)$")
_O = re.compile(r"^(o_proj|wo|dense|out_proj)$")
_GATE = re.compile(r"^(gate_proj|w1|gate_up_proj)$")
_UP = re.compile(r"^(up_proj|w3|c_fc|fc1|dense_h_to_4h)$")
_DOWN = re.compile(r"^(down_proj|w2|fc2|dense_4h_to_h|c_proj)$")


# ---- the paper's formulas, as printed ----------------------------------------------------------------
def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, *, tp: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Bytes of activations one transformer layer stores (Korthikanti et al. 2022, eqs. 1-3, 6)."""
    _check_recompute(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh / (tp if sp else 1)
    attn = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sp or tp == 1:
        return sbh / tp * (34.0 + attn)
    return sbh * (10.0 + 24.0 / tp + attn / tp)


def korthikanti_total_bytes(s: int, b: int, h: int, a: int, layers: int, vocab: int, *, tp: int = 1,
                            sp: bool = False, pp: int = 1, virtual: int = 1, recompute: str = "none") -> float:
    """Activation bytes on the busiest (first) pipeline stage: L layers' worth under 1F1B (interleaved: x
    (1 + (p-1)/(p v))), plus the embedding dropout (sbhp/t) and, with one stage, the output layer and loss
    4 sbh/t (1 + v/h) (the paper's section 4.3; with p > 1 the output layer sits on the last stage)."""
    per = korthikanti_layer_bytes(s, b, h, a, tp=tp, sp=sp, recompute=recompute)
    inflight = 1.0 + (pp - 1) / (pp * virtual) if virtual > 1 else 1.0
    total = per * layers * inflight + s * b * h * pp / tp
    if pp == 1:
        total += 4.0 * s * b * h / tp * (1.0 + vocab / h)
    return total


def pipeline_inflight(pp: int, micro_batches: int, virtual: int = 1) -> float:
    """Micro-batches whose activations the first stage of a 1F1B schedule holds at once, in units of its
    own layers' activations: min(p, m), x (1 + (p-1)/(p v)) interleaved (Korthikanti section 4.2.3)."""
    inflight = float(min(pp, micro_batches))
    if virtual > 1:
        inflight *= 1.0 + (pp - 1) / (pp * virtual)
    return inflight


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        from dmuon.errors import choice_error

        raise choice_error("recompute", recompute, RECOMPUTE)


# ---- any workload: saved tensors per block, per token ------------------------------------------------
def _elements(params: list[ParamSpec]) -> tuple[float, float, float]:
    """(replicated, tensor-parallel-sharded, dropout-mask) elements one token stores in one layer
    (no recompute), per the paper's count:
      attention  input of q/k/v once (h), Q K V (d_q + 2 d_kv; 3 d_q with GQA_REPEAT), attention output
                 = o_proj input (d_q)
      MLP        input of the first matmuls once (h); gated (SwiGLU): gate and up outputs (2f), silu
                 output (f), their product = down input (f); ungated (GeLU): fc1 output (f) and its
                 activation = fc2 input (f); routed experts x (top_k uses) the same per expert, plus the
                 token's copy of h per use
      norms      input of each norm (h per vector parameter of width h: RMSNorm / LayerNorm weights)
      other      any other matmul: its input (cols) x its uses per token."""
    rep = shard = dq = 0.0
    norms = 0
    in_groups: set[tuple[str, int]] = set()
    kinds: dict[str, tuple] = {}  # matrix kind -> `_kind` (a MoE layer repeats a few kinds ~1,000 times)
    for p in params:
        kind = kinds.get(p.matrix)
        if kind is None:
            kind = kinds[p.matrix] = _kind(p.matrix)
        name, is_norm, is_embed, is_attn, qkv, attn_in, q, kv, o, gate_up, down = kind
        uses = p.matmuls_per_token * p.count if p.matmuls_per_token else 0.0
        expert = ".experts." in p.name or "experts" in p.matrix
        if p.rows == 1 or p.cols == 1:  # a norm weight or a bias: the norm saves its input
            if is_norm and max(p.rows, p.cols) > 1:
                rep += max(p.rows, p.cols)
                norms += 1
            continue
        if is_embed or not uses:
            continue
        if qkv:
            rep += p.cols if ("attn", p.layer) not in in_groups else 0.0
            in_groups.add(("attn", p.layer))
            shard += p.rows * uses  # Q, K, V
        elif attn_in or q or kv:
            if ("attn", p.layer) not in in_groups:
                rep += p.cols
                in_groups.add(("attn", p.layer))
            if q:
                dq = max(dq, p.rows)
                shard += p.rows * uses
            elif kv:  # expanded to the query heads first (GQA_REPEAT)
                shard += max(p.rows, dq if GQA_REPEAT else 0) * uses
        elif o or (name == "c_proj" and is_attn):
            shard += p.cols * uses  # attention output
        elif gate_up:
            fused = name == "gate_up_proj"
            # a fused gate_up holding separate pieces (experts: 2 per expert) has f = rows and two
            # matrices per routed use; one fused dense matrix has rows = 2f
            f, per_use = (p.rows, uses / 2) if fused and p.count > 1 else (p.rows / (2 if fused else 1), uses)
            in_groups.add(("mlp", p.layer))
            key = ("mlp-e" if expert else "mlp-in", p.layer)
            if key not in in_groups:
                in_groups.add(key)
                if expert:
                    shard += p.cols * per_use  # each routed copy of the token's h
                else:
                    rep += p.cols  # the MLP's input, read by gate and up (and a router)
            # gated: gate output + silu output (gate), up output + the product (up) = 2f each;
            # ungated: fc1 output + its activation = 2f; fused gate_up: all four
            shard += (4 if fused else 2) * f * per_use
        elif name in ("router", "gate") and expert is False:
            in_groups.add(("mlp", p.layer))  # reads the MLP's input: counted once with gate / up
            if ("mlp-in", p.layer) not in in_groups:
                in_groups.add(("mlp-in", p.layer))
                rep += p.cols
        elif down:
            continue  # its input was counted with the MLP's nonlinearity
        else:
            rep += p.cols * uses
    if not norms:  # a catalog block lists no norm vectors: one pre-norm (its input, h) per sub-block
        rep += _width(params) * sum(1 for g in ("attn", "mlp") if (g, params[0].layer) in in_groups)
    return rep, shard, 0.0


def _kind(matrix: str) -> tuple:
    """What `_elements` reads from a matrix kind: its last name part lowered, whether the kind names a norm /
    an embedding / attention, and which of the name patterns (qkv, attention input, q, kv, o, gate or up,
    down) its last part matches."""
    name, low = matrix.split(".")[-1].lower(), matrix.lower()
    return (name, "norm" in low, "embed" in low, "attn" in low, bool(_QKV.match(name)), bool(_ATTN_IN.match(name)),
            bool(_Q.match(name)), bool(_KV.match(name)), bool(_O.match(name)),
            bool(_GATE.match(name) or _UP.match(name)), bool(_DOWN.match(name)))


def block_bytes_per_token(params, act_bytes: int, *, tp: int = 1, sp: bool = False,
                          recompute: str = "none", dropout: bool = False) -> float:
    """Activation bytes one token leaves in one layer (`_elements`), in `act_bytes`-wide activations;
    dropout=True adds the paper's two 1-byte masks of h (attention and MLP outputs); recompute 'full':
    the layer's input only (h wide); 'selective' = 'none' with flash attention (the recomputed part is
    the s x s attention core, `attention_s2_bytes`)."""
    _check_recompute(recompute)
    params = list(params)
    h = _width(params)
    if recompute == "full":
        return act_bytes * h / (tp if sp else 1)
    rep, shard, _ = _elements(params)
    masks = 2.0 * h if dropout else 0.0
    return (act_bytes * rep + masks) / (tp if sp else 1) + act_bytes * shard / tp


def op_sac_bytes_per_token(params, act_bytes: int, *, tp: int = 1, sp: bool = False) -> float:
    """torchtitan's selective per-op activation checkpointing ('selective', 'op': its
    `_apply_ac_to_transformer_block` policy saves the outputs of every other mm in forward order, the
    first, third, ..., and of the SDPA kernels, and recomputes the rest): per token and block, the block's
    input (h) + those matmul outputs (rows x uses) + each attention's output (d_q). Matmul outputs and the
    attention output are TP-sharded, the block input with SP."""
    params = list(params)
    mm = [p for p in params if p.rows > 1 and p.cols > 1 and p.matmuls_per_token
          and "embed" not in p.matrix.lower()]
    saved = sum(p.rows * p.matmuls_per_token * p.count for p in mm[0::2])
    attn = sum(p.rows for p in mm if _Q.match(p.matrix.split(".")[-1].lower()))
    return act_bytes * (_width(params) / (tp if sp else 1) + (saved + attn) / tp)


def attention_s2_bytes(s: int, b: int, heads: int, tp: int = 1) -> float:
    """The paper's eager attention core: 5 a s^2 b bytes per layer (softmax 2, its dropout mask 1, the
    dropout output 2), / t under TP."""
    return 5.0 * heads * s * s * b / tp


def _width(params) -> int:
    """The model width h of a layer: the cols of its first matmul (q / gate / fc1 read the residual)."""
    for p in params:
        if p.rows > 1 and p.cols > 1 and "embed" not in p.matrix.lower():
            return p.cols
    return max((p.cols for p in params), default=0)


def head_bytes(tokens: int, hidden: int, vocab: int, act_bytes: int, *, tp: int = 1,
               loss_fp32: bool = True) -> float:
    """Peak bytes of the output layer and the loss, at the loss's backward, per token x tokens: the
    head's input (h, saved by its matmul) and, loss_fp32 (torchtitan, HF, the bench model:
    `cross_entropy(logits.float(), ...)`), three fp32 V-wide tensors live at once: the log-softmax output
    cross-entropy saves, its incoming gradient and the gradient log_softmax_backward writes (12 V bytes;
    the forward's peak, bf16 logits + fp32 copy + log-softmax output, is 10 V at most); without the fp32
    copy the same three in act_bytes. Vocabulary / tp (vocab-parallel loss)."""
    v = vocab / tp
    return tokens * (act_bytes * hidden + (12.0 if loss_fp32 else 3.0 * act_bytes) * v)


def activation_bytes(workload: Workload, seq_len: int, micro_batch: int, act_bytes: int, *, tp: int = 1,
                     sp: bool = False, pp: int = 1, micro_batches: int = 1, virtual: int = 1,
                     recompute: str = "none", attention: str = "flash", loss_fp32: bool = True,
                     dropout: bool = False) -> dict[str, float]:
    """{'layers', 'recompute_layer', 'head'}: bytes one rank holds at the end of its forward (the peak of
    activations): every layer's saved tensors (the busiest pipeline stage: its L/p layers x in-flight
    micro-batches), one layer's full activations while it is recomputed (recompute 'full'), the output
    layer and loss (on the last stage; with pp = 1 the same rank). Computed once per distinct input in a
    process (a layout search asks again for every strategy and data-parallel layout)."""
    key = (workload, seq_len, micro_batch, act_bytes, tp, sp, pp, micro_batches, virtual, recompute, attention,
           loss_fp32, dropout)
    h = hash(key)  # once: it hashes every parameter of the workload (~70,000 for Kimi-K2-like, experts apart)
    same = _ACTIVATIONS.get(h, ())
    got = next((v for k, v in same if k == key), None)
    if got is None:
        if len(_ACTIVATIONS) >= 4096:
            _ACTIVATIONS.clear()
        got = _activation_bytes(*key)
        _ACTIVATIONS.setdefault(h, []).append((key, got))
    return dict(got)


# activation_bytes by its inputs (the workload by value): hash of the inputs -> [(inputs, result)]
_ACTIVATIONS: dict[int, list[tuple[tuple, dict[str, float]]]] = {}


def _activation_bytes(workload: Workload, seq_len: int, micro_batch: int, act_bytes: int, tp: int, sp: bool,
                      pp: int, micro_batches: int, virtual: int, recompute: str, attention: str,
                      loss_fp32: bool, dropout: bool) -> dict[str, float]:
    if attention not in ATTENTION:
        from dmuon.errors import choice_error

        raise choice_error("attention", attention, ATTENTION)
    tokens = seq_len * micro_batch
    layers = [list(g) for g in workload.layer_params()]
    blocks = [g for g in layers if any(p.block is not None for p in g)] or layers
    per_layer = []
    for g in blocks:
        if recompute == "op":  # torchtitan's per-op policy (validation of its published rows)
            per_layer.append(op_sac_bytes_per_token(g, act_bytes, tp=tp, sp=sp) * tokens)
            continue
        b = block_bytes_per_token(g, act_bytes, tp=tp, sp=sp, recompute=recompute, dropout=dropout) * tokens
        if attention == "eager" and recompute == "none":
            heads = sum(round((p.attn_width or p.rows) / 128) for p in g if _Q.match(p.matrix.lower()))
            b += attention_s2_bytes(seq_len, micro_batch, max(heads, 1), tp)
        per_layer.append(b)
    stage = per_layer[: -(-len(per_layer) // pp)]  # the first stage's layers
    inflight = pipeline_inflight(pp, micro_batches, virtual)
    full_one = 0.0
    if recompute in ("full", "op") and blocks:  # one block recomputed at a time in backward
        full_one = max(block_bytes_per_token(g, act_bytes, tp=tp, sp=sp, dropout=dropout) for g in blocks) * tokens
    embed = next((p for p in workload.params if "embed" in p.matrix.lower()), None)
    head = next((p for p in workload.params if "head" in p.matrix.lower() and p.rows > 1), embed)
    head_b = 0.0
    if head is not None:
        vocab, hidden = (head.rows, head.cols) if head.rows >= head.cols else (head.cols, head.rows)
        head_b = head_bytes(tokens, hidden, vocab, act_bytes, tp=tp, loss_fp32=loss_fp32)
    return {"layers": sum(stage) * inflight, "recompute_layer": full_one, "head": head_b if pp == 1 else 0.0}


__all__ = ["RECOMPUTE", "ATTENTION", "korthikanti_layer_bytes", "op_sac_bytes_per_token", "korthikanti_total_bytes", "pipeline_inflight",
           "block_bytes_per_token", "attention_s2_bytes", "head_bytes", "activation_bytes"]
