"""What one forward pass is made of, on the model side (SGLang's `forward_batch_info`).

- `ForwardMode`: extend (prefill, possibly a chunk or on top of a cached prefix), decode, mixed.
- `ModelWorkerBatch`: the slice of a scheduler batch the model worker needs (host tensors,
  lengths, sampling info); the scheduler builds it (`ScheduleBatch.get_model_worker_batch`).
- `ForwardBatch`: the device-side view of one forward, built from a `ModelWorkerBatch` by the
  model runner: positions, the KV cache and the attention backend, whose per-forward metadata is
  computed once and shared by every layer.
- `AttentionBackend`: the interface every attention implementation offers the model.

The scheduler imports these types downward; nothing here knows about requests or the scheduler.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.cache.memory_pool import KVCache, ReqToTokenPool
from engine.model_executor.host_transfer import host_to_device
from engine.sampling import SamplingBatchInfo


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill, possibly on top of a cached prefix, possibly one chunk of a prompt
    DECODE = 2  # one new token per request
    MIXED = 3  # extend chunk(s) and decodes in one forward
    IDLE = 4  # nothing to run

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ModelWorkerBatch:
    """What the model worker needs to run one forward and sample (no scheduler state)."""

    forward_mode: ForwardMode
    # None for decode under overlap: the runner gathers last sampled ids by req_pool_indices.
    input_ids: torch.Tensor | None
    req_pool_indices: torch.Tensor  # int64 [B]
    seq_lens: torch.Tensor  # int64 [B], lengths after this forward
    out_cache_loc: torch.Tensor  # int64 [num_new_tokens], KV slots written by this forward
    seq_lens_cpu: list[int]
    extend_seq_lens: list[int] = field(default_factory=list)  # new tokens per request (extend)
    extend_prefix_lens: list[int] = field(default_factory=list)  # cached tokens per request
    sampling_info: SamplingBatchInfo | None = None
    return_prompt_logits: bool = False  # logits at every new position (prompt logprobs, tests)


class AttentionBackend(Protocol):
    """Attention over the paged KV pool, as the model sees it (one object serves every layer).

    - `prepare(device)`: start-up work (build or load kernels) so no request pays for it;
    - `init_forward_metadata(fb)`: once per forward, before the layers run: whatever index
      tensors every layer shares (gather rows, masks, split-KV scratch);
    - `forward(q, k, v, layer_id, fb)`: store the new tokens' K/V in the pool, attend, and return
      `[T, H*D]` for `q: [T, H, D]`, `k, v: [T, KVH, D]`.
    """

    def prepare(self, device: torch.device) -> None: ...

    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor: ...


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
    attn_backend: AttentionBackend
    return_prompt_logits: bool = False

    @classmethod
    def init_new(
        cls,
        batch: ModelWorkerBatch,
        input_ids: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: KVCache,
        attn_backend: AttentionBackend,
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
