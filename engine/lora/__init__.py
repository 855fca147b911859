"""Multi-LoRA serving: many PEFT LoRA adapters, and the base model, in one forward (SGLang's design).

- `adapter.py`: read a PEFT adapter folder into (layer, module) -> (A, B, scaling), checked
  against the base model (`load_adapter`);
- `projections.py`: where each adapter module lands in our fused projections, and the part a
  tensor-parallel rank holds (`shard_lora`);
- `registry.py`: `LoRARegistry`, the registered adapters on the host (`--max-loaded-loras`);
- `pool.py`: `LoRAPool`, the resident adapters in stacked per-slot buffers (LRU, pinned while used);
- `batch.py`: `LoRABatchInfo`, one forward's rows grouped into one segment per adapter;
- `ops.py`: `apply_lora(x, out, layer, projection, info)`, the one call a projection makes;
- `triton_ops.py`: the SGMV shrink / expand kernels of the GPU path (imported only there).
"""

from __future__ import annotations

from engine.lora.adapter import AdapterConfig, LoRAAdapter, LoRAModule, adapter_from_tensors, load_adapter
from engine.lora.batch import LoRABatchInfo
from engine.lora.errors import LoRAError, LoRAPoolFullError
from engine.lora.ops import add_lora_deltas, apply_lora
from engine.lora.pool import BASE_SLOT, LoRAPool, LoRAWeights, resolve_target_modules
from engine.lora.projections import PROJECTIONS, shard_lora
from engine.lora.registry import LoRARegistry, parse_lora_paths

__all__ = [
    "BASE_SLOT",
    "PROJECTIONS",
    "AdapterConfig",
    "LoRAAdapter",
    "LoRABatchInfo",
    "LoRAError",
    "LoRAModule",
    "LoRAPool",
    "LoRAPoolFullError",
    "LoRARegistry",
    "LoRAWeights",
    "adapter_from_tensors",
    "add_lora_deltas",
    "apply_lora",
    "load_adapter",
    "parse_lora_paths",
    "resolve_target_modules",
    "shard_lora",
]
