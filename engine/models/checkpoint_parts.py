"""Checkpoint tensors whose layout is not Llama's, turned into Llama's before the model loads them.

- Phi-3 stores q|k|v as one `self_attn.qkv_proj` tensor and gate|up as one `mlp.gate_up_proj`:
  each is cut into the `q_proj`/`k_proj`/`v_proj` (`gate_proj`/`up_proj`) tensors a Llama
  checkpoint has, so everything after (the fused projections' row ranges, 4-bit blocks, the
  loader's checks) is the Llama path. Under tensor parallelism the sharding rules name no slice
  of a fused tensor, so each rank reads it whole and keeps, of each part, the slice the part's own
  rule gives (`TPShard.weight_slice`): its q heads, its KV heads, its MLP columns.
- OLMo 2's `q_norm`/`k_norm` weights span all heads (`[H * D]`, `[KVH * D]`): a rank keeps the
  slice of its heads (the norm's statistics are all-reduced, engine/layers/qk_norm.py).
- Mixtral names its MoE block `block_sparse_moe` and its experts' projections `w1` (gate), `w3`
  (up), `w2` (down): renamed to Qwen3-MoE's `mlp.gate`, `mlp.experts.<e>.{gate,up,down}_proj`
  (already sliced per rank: the sharding rules know both names).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.distributed.sharding import TPShard
from engine.errors import ModelLoadError
from engine.layers.int4 import Q4Blocks
from engine.layers.q8 import Q8Blocks
from engine.model_config import QK_NORM_WHOLE, ModelConfig

WeightItem = tuple[str, torch.Tensor, Q4Blocks | Q8Blocks | None]

_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}  # fmt: skip
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def llama_layout(weights: Iterable[WeightItem], cfg: ModelConfig, shard: TPShard) -> Iterator[WeightItem]:
    """`weights` with the tensors above replaced by Llama's (see the module docstring)."""
    whole_norm = cfg.qk_norm == QK_NORM_WHOLE and shard.size > 1
    q_rows = (shard.q_head_start * cfg.head_dim, shard.num_heads * cfg.head_dim)
    kv_rows = (shard.kv_head_start * cfg.head_dim, shard.num_kv_heads * cfg.head_dim)
    for name, tensor, blocks in weights:
        parts = name.split(".", 3)  # model.layers.<i>.<module inside the layer>.<kind>
        prefix, (local, _, kind) = ".".join(parts[:3]), parts[-1].rpartition(".")
        if not name.startswith("model.layers.") or len(parts) < 4:
            yield name, tensor, blocks
        elif cfg.fused_checkpoint and local in _FUSED:
            yield from _split(name, tensor, blocks, prefix, local, kind, cfg, shard)
        elif whole_norm and local in ("self_attn.q_norm", "self_attn.k_norm") and kind == "weight":
            first, rows = q_rows if local == "self_attn.q_norm" else kv_rows
            yield name, tensor.narrow(0, first, rows), blocks
        elif local.startswith("block_sparse_moe."):
            yield f"{prefix}.{_mixtral_renamed(local)}.{kind}", tensor, blocks
        else:
            yield name, tensor, blocks


def _split(
    name: str,
    tensor: torch.Tensor,
    blocks: Q4Blocks | Q8Blocks | None,
    prefix: str,
    local: str,
    kind: str,
    cfg: ModelConfig,
    shard: TPShard,
) -> Iterator[WeightItem]:
    """The parts of a fused tensor, each with its rows of the tensor's blocks: a block never spans
    two rows, so a part's blocks are the whole tensor's, cut where its rows are (the parts then
    fuse back into the one projection they came from, in blocks only)."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    sizes = (q, kv, kv) if local == "self_attn.qkv_proj" else (inter, inter)
    if tensor.shape[0] != sum(sizes):
        raise ModelLoadError(f"weight {name} has {tensor.shape[0]} rows, expected {sum(sizes)} ({sizes})")
    first = 0
    for part_module, part, rows in zip(_FUSED[local], tensor.split(sizes, dim=0), sizes):
        part_name = f"{prefix}.{part_module}.{kind}"
        part_blocks = None if blocks is None else blocks.map_rows(lambda t, a=first, n=rows: t.narrow(0, a, n))
        first += rows
        select = shard.weight_slice(part_name)
        if select is not None:  # a rank's slice: no blocks (blocks run on one rank only)
            dim, start, stop = select
            part, part_blocks = part.narrow(dim, start, stop - start), None
        yield part_name, part, part_blocks


def _mixtral_renamed(local: str) -> str:
    """`block_sparse_moe.gate` -> `mlp.gate`; `block_sparse_moe.experts.<e>.w1` -> `mlp.experts.<e>.gate_proj`."""
    parts = local.split(".")[1:]
    if len(parts) == 3 and parts[0] == "experts" and parts[2] in _MIXTRAL_EXPERT:
        parts[2] = _MIXTRAL_EXPERT[parts[2]]
    return ".".join(["mlp", *parts])
