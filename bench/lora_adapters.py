"""Random PEFT LoRA adapters of a model, for the benchmarks and the soak run (`bench.lora`,
`bench.soak --num-lora-adapters`): every projection of every layer adapted, seeded A and B."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, hf_config, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of every projection of `hf_config`'s layers (A and B random)."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, (c.num_key_value_heads or c.num_attention_heads) * head_dim
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (c.hidden_size, q),
        "self_attn.k_proj": (c.hidden_size, kv),
        "self_attn.v_proj": (c.hidden_size, kv),
        "self_attn.o_proj": (q, c.hidden_size),
        "mlp.gate_proj": (c.hidden_size, c.intermediate_size),
        "mlp.up_proj": (c.hidden_size, c.intermediate_size),
        "mlp.down_proj": (c.intermediate_size, c.hidden_size),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0)
    config.update(target_modules=list(TARGETS), bias="none", base_model_name_or_path="smollm2-135m")
    (folder / "adapter_config.json").write_text(json.dumps(config))


__all__ = ["TARGETS", "write_adapter"]
