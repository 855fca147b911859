"""Where an adapter's modules land in our projections, and which part of them a TP rank holds.

The model fuses q|k|v into one `qkv_proj` matmul and gate|up into one `gate_up_proj`
(engine/models/decoder_layers.py); a PEFT adapter names the Hugging Face modules (`q_proj`, ...,
or Phi-3's fused `qkv_proj` / `gate_up_proj`, which the adapter loader cuts into parts). So an
adapter module is a *part* of one of our four projections, and its LoRA delta must land in that
part's column slice of the fused output.

Tensor parallelism follows the base weights' own rules (`TPShard.weight_slice`), read for the
module's base weight name:
- column-parallel (q/k/v, gate/up: the layer's output rows are split): B's rows are cut exactly
  like the base weight's rows, A stays whole (every rank needs the whole shrink of its whole input);
- row-parallel (o, down: the layer's input columns are split): A's input columns are cut like the
  base weight's columns, B stays whole. Each rank's delta is then a partial sum over its input
  columns, and the layer's existing all-reduce adds them up with the base partial sums (the
  expand is linear, so summing after it equals expanding the summed shrink).
"""

from __future__ import annotations

import torch

from engine.distributed.sharding import TPShard
from engine.model_config import ModelConfig

# our projection -> the Hugging Face modules it fuses, in the order of its output columns
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# Hugging Face module -> the sub-module of the decoder layer that holds it
MODULE_PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# Phi-3's checkpoint names for two fused projections: one A, and a B whose rows are the parts'
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED_PARENT = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}
MODULES = tuple(MODULE_PARENT)


def projection_of(module: str) -> tuple[str, int]:
    """(our projection, part index) of Hugging Face module `module` (e.g. k_proj -> qkv_proj, 1)."""
    for projection, parts in PROJECTIONS.items():
        if module in parts:
            return projection, parts.index(module)
    raise KeyError(module)


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of the whole (unsharded) base module: what A and B must fit."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def projection_sizes(cfg: ModelConfig, shard: TPShard, projection: str) -> tuple[int, tuple[int, ...]]:
    """(in_features, output sizes of the parts) of this rank's `projection`, as the model builds it."""
    q, kv = shard.num_heads * cfg.head_dim, shard.num_kv_heads * cfg.head_dim
    inter = shard.intermediate_size
    return {
        "qkv_proj": (cfg.hidden_size, (q, kv, kv)),
        "o_proj": (q, (cfg.hidden_size,)),
        "gate_up_proj": (cfg.hidden_size, (inter, inter)),
        "down_proj": (inter, (cfg.hidden_size,)),
    }[projection]


def base_weight_name(layer: int, module: str) -> str:
    """The checkpoint name of the base weight `module` adapts, as the sharding rules know it."""
    return f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}.weight"


def shard_lora(
    a: torch.Tensor, b: torch.Tensor, layer: int, module: str, shard: TPShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A [r, in'], B [out', r]) of one adapter module (see the module docstring)."""
    select = shard.weight_slice(base_weight_name(layer, module))
    if select is None:
        return a, b
    dim, start, stop = select
    if dim == 0:  # column-parallel: the base weight's output rows are B's rows
        return a, b.narrow(0, start, stop - start)
    return a.narrow(1, start, stop - start), b  # row-parallel: its input columns are A's columns
