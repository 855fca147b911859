"""Seeded random LoRA adapters on a small hand-made model config (no PEFT): the pool, TP and
Triton checks, which need shapes and numbers but not PEFT's file format."""

from __future__ import annotations

import dataclasses

import torch

from engine.lora import AdapterConfig, LoRAAdapter, LoRAModule
from engine.lora.projections import MODULES, module_shape
from engine.model_config import ModelConfig

CFG = ModelConfig(
    architecture="LlamaForCausalLM",
    num_layers=2,
    hidden_size=24,
    intermediate_size=36,
    num_heads=6,
    num_kv_heads=3,
    head_dim=4,
    vocab_size=32,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    o_bias=False,
    mlp_bias=False,
    qk_norm="",
    hidden_act="silu",
    context_len=64,
)


def tiny_config(**overrides) -> ModelConfig:
    return dataclasses.replace(CFG, **overrides)


def random_adapter(
    cfg: ModelConfig, rank: int, modules=MODULES, seed: int = 0, scaling: float = 0.5, layers=None
) -> LoRAAdapter:
    """Every module of `modules` in every layer (or `layers`), ranks `rank` and `rank - 1` in turn."""
    gen = torch.Generator().manual_seed(seed)
    found = {}
    for layer in range(cfg.num_layers) if layers is None else layers:
        for i, module in enumerate(modules):
            in_f, out_f = module_shape(cfg, module)
            r = max(1, rank - (i + layer) % 2)
            a, b = torch.randn(r, in_f, generator=gen), torch.randn(out_f, r, generator=gen)
            found[(layer, module)] = LoRAModule(a, b, scaling + i)
    return LoRAAdapter(found, AdapterConfig(r=rank, lora_alpha=rank))
