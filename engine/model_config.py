"""The few facts about a model the engine needs, read once from its transformers config."""

from __future__ import annotations

from dataclasses import dataclass


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
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    hidden_act: str
    context_len: int
    # Token ids that end a generation (unless ignore_eos): the config's eos_token_id plus
    # generation_config.json's, i.e. what transformers' generate stops on.
    eos_token_ids: frozenset[int] = frozenset()

    @classmethod
    def from_hf(cls, hf_config, architecture: str, generation_eos: tuple[int, ...] = ()) -> ModelConfig:
        c = hf_config
        eos = getattr(c, "eos_token_id", None)
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []) | set(generation_eos)
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attn_bias = bool(getattr(c, "attention_bias", False))
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
            qk_norm=architecture == "Qwen3ForCausalLM",
            hidden_act=getattr(c, "hidden_act", "silu"),
            context_len=getattr(c, "max_position_embeddings", 2048),
            eos_token_ids=frozenset(eos),
        )
