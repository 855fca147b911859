"""Tiny real base models wrapped by real PEFT LoRA adapters, saved as PEFT saves them (the LoRA tests).

PEFT initialises every B to zero (an untrained adapter changes nothing), so every A and B is
redrawn from a seeded generator: the deltas are non-zero and the same on every run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from engine.lora import BASE_SLOT, LoRABatchInfo, LoRAPool, apply_lora
from engine.lora.projections import PROJECTIONS
from engine.model_config import ModelConfig

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

# name -> LoraConfig: different ranks and targets, rsLoRA, rank/alpha patterns, a regex target
LLAMA_ADAPTERS = {
    "all": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "patterns": dict(
        r=2,
        lora_alpha=4,
        target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
        rank_pattern={"model.layers.1.self_attn.k_proj": 6, "up_proj": 3},
        alpha_pattern={"o_proj": 10},
    ),
    "regex": dict(r=3, lora_alpha=5, target_modules=r".*\.layers\.1\.(self_attn\.q_proj|mlp\.gate_proj)"),
}  # fmt: skip
PHI3_ADAPTERS = {
    "fused": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "qkv_only": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["qkv_proj"]),
}


@dataclass
class AdapterSet:
    cfg: ModelConfig
    peft: dict[str, PeftModel]  # name -> the PEFT-wrapped model (fp32, eval)
    paths: dict[str, Path]


def llama_base(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()


def phi3_base(seed: int = 0) -> Phi3ForCausalLM:
    torch.manual_seed(seed)
    hf = Phi3Config(**SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return Phi3ForCausalLM(hf).eval()


def wrap(base, name: str, lora_kwargs: dict, seed: int, scale: float = 0.3) -> PeftModel:
    """`base` (copied) with one LoRA adapter whose A and B are seeded random draws (std `scale`)."""
    model = get_peft_model(copy.deepcopy(base), LoraConfig(lora_dropout=0.0, **lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if ".lora_A." in pname or ".lora_B." in pname:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return model.eval()


def build_set(base, adapters: dict[str, dict], root: Path, architecture: str) -> AdapterSet:
    peft, paths = {}, {}
    for i, (name, kwargs) in enumerate(adapters.items()):
        peft[name] = wrap(base, name, kwargs, seed=100 + i)
        paths[name] = root / name
        peft[name].save_pretrained(str(paths[name]))
    return AdapterSet(ModelConfig.from_hf(base.config, architecture), peft, paths)


def peft_delta(model: PeftModel, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's output of `module` in `layer` minus its base layer's: the adapter's delta on `x`."""
    decoder = model.base_model.model.model.layers[layer]
    parent = decoder.self_attn if hasattr(decoder.self_attn, module) else decoder.mlp
    lora_layer = getattr(parent, module)
    if not hasattr(lora_layer, "base_layer"):  # not targeted in this layer
        return torch.zeros(x.shape[0], lora_layer.out_features)
    with torch.no_grad():
        return lora_layer(x) - lora_layer.base_layer(x)


def mixed_batch(names: list[str | None], pool: LoRAPool, rows: list[int]) -> LoRABatchInfo:
    slots = [BASE_SLOT if n is None else pool.slot_of(n) for n in names]
    return LoRABatchInfo.build(pool, slots, rows)


def our_delta(pool: LoRAPool, info: LoRABatchInfo, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
    out_features = sum(pool.weights(layer, projection).out_sizes)
    out = torch.zeros(x.shape[0], out_features, dtype=x.dtype)
    return apply_lora(x, out, layer, projection, info)


def projection_inputs(cfg: ModelConfig, rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    q = cfg.num_heads * cfg.head_dim
    dims = {
        "qkv_proj": cfg.hidden_size,
        "o_proj": q,
        "gate_up_proj": cfg.hidden_size,
        "down_proj": cfg.intermediate_size,
    }
    return {p: torch.randn(rows, dims[p], generator=gen) for p in PROJECTIONS}
