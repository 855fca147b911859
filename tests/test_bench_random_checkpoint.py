"""bench.random_checkpoint: every preset is a shape the engine serves, and a (shrunk) checkpoint of
each loads as its architecture with SmolLM2's tokenizer beside it."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from bench.random_checkpoint import COMMON, PRESETS, VOCAB, make_checkpoint
from engine import resolve_model
from engine.model_config import ModelConfig

# a few hundred thousand parameters besides the embedding, whatever the preset's real size
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32)  # fmt: skip


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_is_a_model_we_serve(preset, tmp_path):
    model_type, fields = PRESETS[preset]
    full = AutoConfig.for_model(model_type, **(COMMON | fields))
    cfg = ModelConfig.from_hf(full, _arch(model_type))
    assert cfg.hidden_size == fields["hidden_size"] and cfg.num_layers == fields["num_hidden_layers"]
    overrides = SMALL | (
        {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2} if "moe" in preset else {}
    )
    make_checkpoint(preset, tmp_path, **overrides)
    src = resolve_model(str(tmp_path))
    assert src.architecture == _arch(model_type)
    assert src.hf_config.vocab_size == VOCAB and len(src.load_tokenizer()) <= VOCAB  # SmolLM2's tokenizer


def _arch(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
    }[model_type]
