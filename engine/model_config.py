"""The few facts about a model the engine needs, read once from its transformers config.

One decoder family (engine/models/llama.py) serves every supported architecture; what tells
them apart is here, as plain switches read from the config:
- Qwen2: q/k/v biases; Qwen3: per-head q/k RMSNorm;
- Granite: `embedding_multiplier`, `residual_multiplier`, `attention_multiplier` (the softmax
  scale), `logits_scaling` (the logits are divided by it);
- OLMo 2: post-norms (each sublayer's output normalised before the residual add, no pre-norm),
  q/k RMSNorm over the whole projected q and k, RMSNorm's weight applied before the cast and
  RoPE computed in fp32;
- Phi-3: fused q|k|v and gate|up checkpoint tensors (split at load), partial rotary, longrope.

Two limits keep outputs exact where the attention or RoPE would otherwise differ from
transformers': a sliding window (Phi-3) and a longrope scaling whose long factors differ from its
short ones both bound the context length (see `_context_len`).
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
        return cls(
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
        )


def _context_len(c, architecture: str) -> int:
    """The positions the engine serves exactly as transformers computes them.

    - Phi-3's sliding window (`sliding_window`, e.g. 2047 for Phi-3-mini-4k): the attention is not
      windowed here, and a sequence within the window never sees the window, so the context stops
      there.
    - longrope (Phi-3-128k, Phi-3.5, Phi-4-mini): transformers rotates a sequence with the short
      factors while it fits `original_max_position_embeddings` and, past it, recomputes the whole
      sequence with the long factors (its `prepare_inputs_for_generation` drops the KV cache at
      the switch). A paged, prefix-shared KV cache cannot re-rotate a request's keys yet, so the
      context stops at `original_max_position_embeddings` (unless the two factor lists are equal).
    """
    context = int(getattr(c, "max_position_embeddings", 2048))
    window = getattr(c, "sliding_window", None) if architecture == "Phi3ForCausalLM" else None
    if isinstance(window, int) and 0 < window < context:
        log.info("%s: sliding window of %d positions: the context is bounded by it", architecture, window)
        context = window
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
