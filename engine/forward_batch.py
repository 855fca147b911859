"""`ForwardBatch`: the model-side view of one forward (seed 000's lowest layer).

Built from a `ModelWorkerBatch` by the model runner: adds token positions, the KV cache and the
attention backend whose per-forward metadata (gather indices, masks) is computed once here and
shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.cache.memory_pool import KVCache, ReqToTokenPool
from engine.host_transfer import host_to_device
from engine.schedule_batch import ForwardMode, ModelWorkerBatch

if TYPE_CHECKING:
    from engine.layers.attention_torch import TorchAttnBackend


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] lengths after this forward
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slots this forward writes
    extend_seq_lens: list[int]
    extend_prefix_lens: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVCache
    attn_backend: TorchAttnBackend
    return_prompt_logits: bool = False

    @classmethod
    def init_new(
        cls,
        batch: ModelWorkerBatch,
        input_ids: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: KVCache,
        attn_backend: TorchAttnBackend,
    ) -> ForwardBatch:
        device = token_to_kv_pool.device
        if batch.forward_mode.is_extend():
            positions = torch.cat(
                [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(batch.extend_prefix_lens, batch.extend_seq_lens)]
            )
        else:
            positions = batch.seq_lens - 1
        # On CUDA the host-built ones travel in one pinned, non-blocking copy (host_transfer.py).
        input_ids, positions, req_pool_indices, seq_lens, out_cache_loc = host_to_device(
            [input_ids, positions, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc], device
        )
        fb = cls(
            forward_mode=batch.forward_mode,
            batch_size=len(batch.seq_lens_cpu),
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu,
            out_cache_loc=out_cache_loc,
            extend_seq_lens=batch.extend_seq_lens,
            extend_prefix_lens=batch.extend_prefix_lens,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            return_prompt_logits=batch.return_prompt_logits,
        )
        attn_backend.init_forward_metadata(fb)
        return fb
