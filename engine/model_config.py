"""The few facts about a model the engine needs, read once from its transformers config.

One decoder family (engine/models/llama.py) serves every supported architecture; what tells
them apart is here, as plain switches read from the config:
- Qwen2: q/k/v biases; Qwen3: per-head q/k RMSNorm;
- Granite: `embedding_multiplier`, `residual_multiplier`, `attention_multiplier` (the softmax
  scale), `logits_scaling` (the logits are divided by it);
- OLMo 2: post-norms (each sublayer's output normalised before the residual add, no pre-norm),
  q/k RMSNorm over the whole projected q and k, RMSNorm's weight applied before the cast and
  RoPE computed in fp32;
- Phi-3: fused q|k|v and gate|up checkpoint tensors (split at load), partial rotary, longrope;
- Mistral (and Phi-3, Qwen2 with `use_sliding_window`): sliding-window attention per layer;
- Gemma 2/3: sandwich norms scaling by `1 + weight`, GeGLU, the embedding scaled by
  sqrt(hidden), `query_pre_attn_scalar`, local/global layers; Gemma 2's attention and final logit
  soft-caps; Gemma 3's per-head q/k norm and RoPE per layer type;
- Qwen3-MoE, Mixtral: a mixture-of-experts MLP on some or all layers (engine/layers/moe.py).

One limit keeps outputs exact where RoPE would otherwise differ from transformers': a longrope
scaling whose long factors differ from its short ones bounds the context length (`_context_len`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

QK_NORM_HEAD = "head"  # Qwen3: RMSNorm over each head of q and k (one [head_dim] weight each)
QK_NORM_WHOLE = "whole"  # OLMo 2: RMSNorm over all of q and all of k ([H * head_dim], [KVH * head_dim])


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama when configured)
    o_bias: bool  # the output projection carries a bias (Llama attention_bias)
    mlp_bias: bool
    qk_norm: str  # "" (none), QK_NORM_HEAD (Qwen3) or QK_NORM_WHOLE (OLMo 2), before RoPE
    hidden_act: str
    context_len: int
    # Token ids that end a generation (unless ignore_eos): the config's eos_token_id plus
    # generation_config.json's, i.e. what transformers' generate stops on.
    eos_token_ids: frozenset[int] = frozenset()
    # Granite's multipliers (1.0 / None elsewhere)
    embedding_multiplier: float = 1.0  # the embeddings are scaled by it
    residual_multiplier: float = 1.0  # each sublayer's output is scaled by it before the residual add
    attention_multiplier: float | None = None  # the softmax scale, instead of 1/sqrt(head_dim)
    logits_scaling: float = 1.0  # the logits are divided by it
    # OLMo 2: norms after each sublayer (post_attention_layernorm, post_feedforward_layernorm)
    post_norms: bool = False
    # OLMo 2's RMSNorm: `(weight * normalized).to(dtype)` (transformers' Llama: `weight * normalized.to(dtype)`)
    norm_weight_before_cast: bool = False
    # OLMo 2's RoPE: cos/sin stay fp32 (not cast to the model dtype), the rotation is cast once
    rotary_fp32: bool = False
    # Phi-3: q|k|v and gate|up stored as one tensor each (`qkv_proj`, `gate_up_proj`)
    fused_checkpoint: bool = False
    # Sliding-window attention (Mistral, Phi-3, Qwen2 with `use_sliding_window`, Gemma 2/3's local
    # layers): each layer's window (0 = full causal attention); () when no layer has one
    layer_windows: tuple[int, ...] = ()
    # Gemma 2: attention scores and final logits squashed through `cap * tanh(x / cap)`
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Gemma 2/3: a norm before and after each sublayer; RMSNorm scales by `1 + weight` in fp32;
    # the embedding scale (`embedding_multiplier`) is rounded to the model dtype before it scales
    sandwich_norms: bool = False
    unit_offset_norms: bool = False
    embedding_scale_in_dtype: bool = False
    # Gemma 3: RoPE parameters per layer type (`rope_parameters[type]`); () = one RoPE for all layers
    rope_layer_types: tuple[str, ...] = ()
    # Mixture of experts (Qwen3-MoE, Mixtral; engine/layers/moe.py): 0 experts = a dense model.
    # `moe_layers` are the layers whose MLP is the experts (Qwen3-MoE: `decoder_sparse_step` and
    # `mlp_only_layers` leave some dense; Mixtral: all); `norm_topk_prob` renormalises the top-k
    # routing weights; `moe_fp32_weights` (Mixtral) keeps them fp32 where Qwen3-MoE casts them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False
    moe_fp32_weights: bool = False

    @property
    def max_window(self) -> int:
        """The largest sliding window of any layer (0: none); past it, windows change results."""
        return max(self.layer_windows, default=0)

    @property
    def min_window(self) -> int:
        """The smallest sliding window of any layer (0: none); within it, every layer is full attention."""
        return min((w for w in self.layer_windows if w), default=0)

    @property
    def softmax_scale(self) -> float:
        """The attention's score scale: Granite's `attention_multiplier`, else 1/sqrt(head_dim)."""
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim**-0.5

    @classmethod
    def from_hf(cls, hf_config, architecture: str, generation_eos: tuple[int, ...] = ()) -> ModelConfig:
        c = hf_config
        eos = getattr(c, "eos_token_id", None)
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []) | set(generation_eos)
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        is_olmo2 = architecture == "Olmo2ForCausalLM"
        is_granite = architecture == "GraniteForCausalLM"
        attn_bias = bool(getattr(c, "attention_bias", False))
        qk_norm = QK_NORM_HEAD if architecture == "Qwen3ForCausalLM" else QK_NORM_WHOLE if is_olmo2 else ""
        fields = dict(
            architecture=architecture,
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=c.vocab_size,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=is_qwen2 or attn_bias,
            o_bias=attn_bias and not is_qwen2,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            qk_norm=qk_norm,
            hidden_act=getattr(c, "hidden_act", "silu"),
            context_len=_context_len(c, architecture),
            eos_token_ids=frozenset(eos),
            embedding_multiplier=float(getattr(c, "embedding_multiplier", 1.0)) if is_granite else 1.0,
            residual_multiplier=float(getattr(c, "residual_multiplier", 1.0)) if is_granite else 1.0,
            attention_multiplier=float(getattr(c, "attention_multiplier", 1.0)) if is_granite else None,
            logits_scaling=float(getattr(c, "logits_scaling", 1.0)) if is_granite else 1.0,
            post_norms=is_olmo2,
            norm_weight_before_cast=is_olmo2,
            rotary_fp32=is_olmo2,
            fused_checkpoint=architecture == "Phi3ForCausalLM",
            layer_windows=_layer_windows(c),
        )
        if architecture in GEMMA_ARCHITECTURES:
            fields.update(_gemma_fields(c, architecture))
        if architecture in MOE_ARCHITECTURES:
            fields.update(_moe_fields(c, architecture))
        return cls(**fields)


GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


def _moe_fields(c, architecture: str) -> dict:
    """Qwen3-MoE (`Qwen3MoeDecoderLayer`: layer i is sparse unless listed in `mlp_only_layers`,
    when `(i + 1) % decoder_sparse_step == 0`; Qwen3's per-head q/k norm) and Mixtral (every layer
    sparse, `intermediate_size` is each expert's width, the top-k always renormalised and kept fp32)."""
    if architecture == "MixtralForCausalLM":
        return dict(
            num_experts=c.num_local_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.intermediate_size,
            moe_layers=tuple(range(c.num_hidden_layers)),
            norm_topk_prob=True,
            moe_fp32_weights=True,
        )
    step, dense = getattr(c, "decoder_sparse_step", 1) or 1, set(getattr(c, "mlp_only_layers", None) or ())
    sparse = tuple(i for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return dict(
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        moe_layers=sparse if c.num_experts > 0 else (),
        norm_topk_prob=bool(c.norm_topk_prob),
        qk_norm=QK_NORM_HEAD,
    )


def _layer_windows(c) -> tuple[int, ...]:
    """Each layer's sliding window, as transformers applies it: `layer_types` names the windowed
    layers where the config has them (Gemma 2/3, Qwen2/3's `use_sliding_window`), else a
    `sliding_window` applies to every layer (Mistral, Phi-3)."""
    window = getattr(c, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return ()
    types = getattr(c, "layer_types", None)
    if types is None:
        return (window,) * c.num_hidden_layers
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _gemma_fields(c, architecture: str) -> dict:
    """Gemma 2/3 (transformers' `Gemma2ForCausalLM`, `Gemma3ForCausalLM`): see the class fields."""
    scalar = getattr(c, "query_pre_attn_scalar", None)
    rope = getattr(c, "rope_parameters", None) or {}
    types = tuple(getattr(c, "layer_types", None) or ())
    per_type = bool(types) and all(t in rope for t in set(types))
    return dict(
        hidden_act=getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None) or "gelu_pytorch_tanh",
        attention_multiplier=float(scalar) ** -0.5 if scalar else None,
        attn_logit_softcap=getattr(c, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(c, "final_logit_softcapping", None),
        embedding_multiplier=float(c.hidden_size) ** 0.5,
        embedding_scale_in_dtype=True,
        sandwich_norms=True,
        unit_offset_norms=True,
        qk_norm=QK_NORM_HEAD if architecture == "Gemma3ForCausalLM" else "",
        rope_layer_types=types if per_type else (),
    )


def _context_len(c, architecture: str) -> int:
    """The positions the engine serves exactly as transformers computes them.

    - longrope (Phi-3-128k, Phi-3.5, Phi-4-mini): transformers rotates a sequence with the short
      factors while it fits `original_max_position_embeddings` and, past it, recomputes the whole
      sequence with the long factors (its `prepare_inputs_for_generation` drops the KV cache at
      the switch). A paged, prefix-shared KV cache cannot re-rotate a request's keys yet, so the
      context stops at `original_max_position_embeddings` (unless the two factor lists are equal).
    """
    context = int(getattr(c, "max_position_embeddings", 2048))
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type")) == "longrope" and params.get("long_factor") != params.get(
        "short_factor"
    ):
        original = params.get("original_max_position_embeddings") or getattr(c, "original_max_position_embeddings", 0)
        if original and original < context:
            log.info(
                "%s: longrope's long factors are not served yet: the context is bounded by "
                "original_max_position_embeddings (%d)",
                architecture,
                original,
            )
            context = int(original)
    return context
