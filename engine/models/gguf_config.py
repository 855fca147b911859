"""A GGUF's config, completed: what llama.cpp stores (or implies) that transformers' GGUF config
reader leaves out or gets wrong, per architecture.

transformers builds the config from the keys it maps and its class defaults for the rest. Where
llama.cpp's converter writes a value under another key, as a tensor, or not at all (llama.cpp then
derives it from the model's size), the default is another model's value and the served model would
be silently wrong. Each `_complete_*` fixes one family from the file's own metadata, mirroring what
llama.cpp's loader does with the same file.
"""

from __future__ import annotations

from transformers import MixtralConfig, PretrainedConfig

from engine.errors import ModelLoadError
from engine.models.gguf_weights import GGUFIndex, read_gguf_tensor

# Gemma's query scale: llama.cpp's loader takes 1/sqrt(head_dim), except for the 27B models (known
# by their layer count), whose `query_pre_attn_scalar` is hidden_size / num_heads; the file has no key.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's Gemma 3 local (sliding-window) layers: RoPE base 10000, never scaled.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def complete_gguf_config(hf_config: PretrainedConfig, index: GGUFIndex) -> None:
    """Fix `hf_config` (transformers' reading of the GGUF at `index`) in place."""
    _complete_head_dim(hf_config, index)
    _complete_experts(hf_config, index)
    _complete_phi3(hf_config, index)
    _complete_gemma(hf_config, index)


def _complete_head_dim(hf_config: PretrainedConfig, index: GGUFIndex) -> None:
    """Take head_dim from `<arch>.attention.key_length` when the file states it.

    transformers maps that key for some architectures but not for qwen3, whose config then keeps
    its class default (128) — wrong for any Qwen3 GGUF with another head size.
    """
    key_length = index.metadata.get(f"{index.architecture}.attention.key_length")
    has_head_dim = hasattr(hf_config, "head_dim")  # Llama/Qwen3 configs have one; Qwen2 derives it
    if has_head_dim and isinstance(key_length, int) and key_length > 0 and hf_config.head_dim != key_length:
        hf_config.head_dim = key_length


def _complete_experts(hf_config: PretrainedConfig, index: GGUFIndex) -> None:
    """A Qwen3-MoE GGUF: each expert's width from `<arch>.expert_feed_forward_length` (transformers
    does not map it, and its class default is another model's), and the top-k weights renormalised,
    as llama.cpp's Qwen3-MoE graph always does (the file has no flag for it; every released
    Qwen3-MoE sets `norm_topk_prob`)."""
    if index.architecture != "qwen3moe":
        return
    width = index.metadata.get("qwen3moe.expert_feed_forward_length")
    if not (isinstance(width, int) and width > 0):
        raise ModelLoadError(f"GGUF file {index.path}: no qwen3moe.expert_feed_forward_length")
    hf_config.moe_intermediate_size = width
    hf_config.norm_topk_prob = True


def _complete_phi3(hf_config: PretrainedConfig, index: GGUFIndex) -> None:
    """A Phi-3 GGUF: what llama.cpp stores and transformers' GGUF config leaves out: a partial
    rotary (`phi3.rope.dimension_count` below the head size: Phi-4-mini), a sliding window, and
    longrope (Phi-3-128k, Phi-3.5, Phi-4-mini), whose factors llama.cpp keeps as the tensors
    `rope_factors_long` / `rope_factors_short` and whose trained context as
    `phi3.rope.scaling.original_context_length`."""
    if index.architecture != "phi3":
        return
    meta = index.metadata
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    rope_dim = meta.get("phi3.rope.dimension_count")
    if isinstance(rope_dim, int) and 0 < rope_dim < head_dim:
        params["partial_rotary_factor"] = hf_config.partial_rotary_factor = rope_dim / head_dim
    window = meta.get("phi3.attention.sliding_window")
    if isinstance(window, int) and window > 0:
        hf_config.sliding_window = window
    long, short = (
        read_gguf_tensor(index, "rope_factors_long.weight"),
        read_gguf_tensor(index, "rope_factors_short.weight"),
    )
    if long is not None and short is not None:
        original = meta.get("phi3.rope.scaling.original_context_length")
        if not (isinstance(original, int) and original > 0):
            raise ModelLoadError(
                f"GGUF file {index.path}: longrope factors without phi3.rope.scaling.original_context_length"
            )
        params.update(rope_type="longrope", long_factor=long.tolist(), short_factor=short.tolist())
        params["original_max_position_embeddings"] = hf_config.original_max_position_embeddings = original
    if params:
        hf_config.rope_parameters = params


def _complete_gemma(hf_config: PretrainedConfig, index: GGUFIndex) -> None:
    """A Gemma 2 / Gemma 3 GGUF. transformers leaves `query_pre_attn_scalar` at its class default
    (256: wrong for Gemma 2 27B, Gemma 3 27B and any other head size), drops Gemma 3's linear RoPE
    scaling of the global layers (factor 8 on the 4B, 12B and 27B models: every position rotated
    wrongly), and does not read the soft-caps. llama.cpp's converter writes the soft-caps and the
    window; its loader derives the query scale and keeps the local layers' RoPE at base 10000,
    unscaled; a Gemma 3 file without a window has no local layers."""
    arch = index.architecture
    if arch not in _GEMMA_27B_LAYERS:
        return
    meta = index.metadata
    heads, layers = hf_config.num_attention_heads, hf_config.num_hidden_layers
    big = layers == _GEMMA_27B_LAYERS[arch]
    hf_config.query_pre_attn_scalar = hf_config.hidden_size // heads if big else hf_config.head_dim
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.get(f"{arch}.{key}")
        if arch == "gemma3" or isinstance(value, float):  # Gemma 3: none unless the file has one
            setattr(hf_config, key, float(value) if isinstance(value, float) and value > 0 else None)
    window = meta.get(f"{arch}.attention.sliding_window")
    if isinstance(window, int) and window > 0:
        hf_config.sliding_window = window
    elif arch == "gemma3":
        hf_config.sliding_window = None
        hf_config.layer_types = ["full_attention"] * layers
    if arch != "gemma3":
        return
    full = {"rope_type": "default", "rope_theta": float(meta.get("gemma3.rope.freq_base", 1_000_000.0))}
    kind, factor = meta.get("gemma3.rope.scaling.type"), meta.get("gemma3.rope.scaling.factor")
    if kind == "linear" and isinstance(factor, float) and factor != 1.0:
        full.update(rope_type="linear", factor=factor)
    elif kind not in (None, "none", "linear"):
        raise ModelLoadError(f"GGUF file {index.path}: Gemma 3 with {kind!r} RoPE scaling is not supported")
    local = {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA}
    hf_config.rope_parameters = {"full_attention": full, "sliding_attention": local}


def mixtral_of_llama(hf_config: PretrainedConfig, index: GGUFIndex) -> PretrainedConfig | None:
    """A "llama" GGUF with experts is a Mixtral (llama.cpp's converter writes Mixtral so: the
    router as `ffn_gate_inp`, the experts stacked in `ffn_{gate,up,down}_exps`); transformers
    reads it as a dense Llama. Its MixtralConfig: transformers' Llama fields (each expert's width
    is the file's `feed_forward_length`) plus `llama.expert_count` and `expert_used_count`; None
    for a dense Llama. No sliding window: llama.cpp stores none for Mixtral."""
    if index.architecture != "llama":
        return None
    experts = index.metadata.get("llama.expert_count")
    if not (isinstance(experts, int) and experts > 0):
        return None
    used = index.metadata.get("llama.expert_used_count")
    if not (isinstance(used, int) and 0 < used <= experts):
        raise ModelLoadError(f"GGUF file {index.path}: llama.expert_used_count {used!r} is not 1..{experts}")
    fields = {k: v for k, v in hf_config.to_dict().items() if k not in ("model_type", "architectures")}
    return MixtralConfig(**fields, num_local_experts=experts, num_experts_per_tok=used, sliding_window=None)
