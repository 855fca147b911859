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
import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.cache.memory_pool import KVCache, ReqToTokenPool
from engine.lora.batch import LoRABatchInfo
from engine.model_executor.host_transfer import host_to_device
from engine.sampling import SamplingBatchInfo


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill, possibly on top of a cached prefix, possibly one chunk of a prompt
    DECODE = 2  # one new token per request
    MIXED = 3  # extend chunk(s) and decodes in one forward
    IDLE = 4  # nothing to run
    # Speculative decoding: each running request's last token and its drafts, an extend over its
    # KV whose logits are kept at every position (engine/speculative/verify.py)
    TARGET_VERIFY = 5

    def is_extend(self) -> bool:
        """Runs as an extend (new tokens over cached KV): the attention and position logic."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_prefill(self) -> bool:
        """Computes some request's prompt (the scheduler caches it and merges the batch)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class PromptLogprobPlan:
    """Prompt log-probs one extend computes (engine/model_executor/prompt_logprobs.py): the flat
    rows (new-token indices) whose logits score the next prompt token, that token per row, how
    many rows each request of the batch has (in batch order), and the batch's top-N."""

    rows: list[int]
    targets: list[int]
    counts: list[int]
    top_n: int = 0


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
    mixed_decode_rows: int = 0  # MIXED: the last rows decode; their input ids are last sampled ids
    sampling_info: SamplingBatchInfo | None = None
    return_prompt_logits: bool = False  # logits at every new position (tests)
    prompt_logprobs: PromptLogprobPlan | None = None  # extend rows whose prompt token is scored
    # Embedding requests: the extend rows whose final hidden states are pooled, and how many
    # rows each request of the batch has (batch order); empty when none
    embed_rows: list[int] = field(default_factory=list)
    embed_counts: list[int] = field(default_factory=list)
    # Multi-LoRA: each request's adapter slot in the LoRA pool (engine/lora/pool.py; BASE_SLOT -1:
    # the base model), in batch order; None when no request of the batch uses an adapter
    lora_slots: list[int] | None = None

    def lora_rows(self) -> list[int]:
        """The forward's rows of each request, in batch order (what `lora_slots` applies to):
        an extend's new tokens (MIXED: then 1 per decode row; verify: its drafts + 1), 1 per decode."""
        return list(self.extend_seq_lens) if self.forward_mode.is_extend() else [1] * len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    """Attention over the paged KV pool, as the model sees it (one object serves every layer).

    Chosen once, when the model runner starts (engine/layers/attention_backend.py):
    - `init_forward_metadata(fb)`: once per forward, before the layers run: the plan every layer
      shares (gather rows, masks, split-KV scratch);
    - `forward(q, k, v, layer_id, fb)`: store the new tokens' K/V in the pool, attend, and return
      `[T, H*D]` for `q: [T, H, D]`, `k, v: [T, KVH, D]`.
    """

    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """One forward's tensors on the model's device, plus the host-side lengths the backends need.

    `init_new` is the one place a forward's host-built tensors move to the device: on CUDA in one
    pinned, non-blocking copy per dtype (host_transfer.py); on a CPU they stay what they are.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] int64, lengths after this forward
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slots this forward writes
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVCache
    attn_backend: AttentionBackend
    # Extend only: new and cached tokens per request and where each request's new tokens start in
    # the flattened batch ([B] int64 on the device), and the same lengths on the host.
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    return_prompt_logits: bool = False
    # Prompt log-probs: the rows the model keeps (their final hidden states, pre-norm, land in
    # `prompt_hidden` during the forward; the logits are computed from them slice by slice).
    prompt_logprob_rows: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None
    # Embeddings: the rows whose final hidden states (after the last norm, float32) the model
    # leaves in `embed_hidden`
    embed_rows: torch.Tensor | None = None
    embed_hidden: torch.Tensor | None = None
    # The LoRA view of this forward (set by the runner's LoRAManager); None: no adapter rows, the
    # projections run exactly as without LoRA
    lora: LoRABatchInfo | None = None

    @classmethod
    def init_new(
        cls,
        batch: ModelWorkerBatch,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: KVCache,
        attn_backend: AttentionBackend,
        last_token_ids: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """The device view of `batch`. A decode batch without input ids (overlap scheduling) reads
        them from `last_token_ids[req_pool_indices]`, on the device. The caller then runs
        `attn_backend.init_forward_metadata` (or a graph replay that does it)."""
        device = token_to_kv_pool.device
        extend_host = None
        if batch.forward_mode.is_extend():
            ext, prefix = batch.extend_seq_lens, batch.extend_prefix_lens
            positions = torch.cat([torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix, ext)])
            extend_host = torch.tensor([ext, prefix, [0, *itertools.accumulate(ext)][:-1]], dtype=torch.int64)
        else:
            positions = batch.seq_lens - 1
        input_ids, positions, req_pool_indices, seq_lens, out_cache_loc, extend = host_to_device(
            [batch.input_ids, positions, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, extend_host],
            device,
        )
        if input_ids is None or batch.mixed_decode_rows:
            if last_token_ids is None:
                raise ValueError("decode rows without input ids need last_token_ids")
            if input_ids is None:  # decode under overlap: last sampled ids, gathered on the device
                input_ids = last_token_ids[req_pool_indices]
            else:  # MIXED: each decode row's one token (the last of the flat batch) likewise
                m = batch.mixed_decode_rows
                input_ids = torch.cat([input_ids[:-m], last_token_ids[req_pool_indices[-m:]]])
        return cls(
            forward_mode=batch.forward_mode,
            batch_size=len(batch.seq_lens_cpu),
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu,
            out_cache_loc=out_cache_loc,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            extend_seq_lens=None if extend is None else extend[0],
            extend_prefix_lens=None if extend is None else extend[1],
            extend_start_loc=None if extend is None else extend[2],
            extend_seq_lens_cpu=batch.extend_seq_lens,
            extend_prefix_lens_cpu=batch.extend_prefix_lens,
            return_prompt_logits=batch.return_prompt_logits,
            prompt_logprob_rows=(
                None
                if batch.prompt_logprobs is None
                else torch.tensor(batch.prompt_logprobs.rows, dtype=torch.int64, device=device)
            ),
            embed_rows=torch.tensor(batch.embed_rows, dtype=torch.int64, device=device) if batch.embed_rows else None,
        )
