"""What rank 0 broadcasts to the other tensor-parallel ranks before each forward (msgpack).

A worker rank has no scheduler: it needs the forward's shape (mode, lengths, KV slots) and the
writes rank 0's scheduler made to the request table since the previous step (prefixes matched in
the radix cache, new slots, rows rewritten when the cache deduplicates), so that its own copy of
the table, and so its attention, read the same slots as rank 0's. Sampling happens on rank 0
only; `sampled` tells the worker to expect the sampled ids afterwards (an overlapped decode reads
its input ids from them on every rank).
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from engine.cache.memory_pool import TableWrite
from engine.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch, PromptLogprobPlan


class TPStep(msgspec.Struct, tag="step", array_like=True):
    forward_mode: int
    input_ids: list[int] | None
    req_pool_indices: list[int]
    seq_lens: list[int]
    out_cache_loc: list[int]
    extend_seq_lens: list[int]
    extend_prefix_lens: list[int]
    mixed_decode_rows: int
    return_prompt_logits: bool
    prompt_logprob_rows: list[int]  # rows rank 0 scores (engine/model_executor/prompt_logprobs.py)
    sampled: bool  # rank 0 samples and broadcasts the ids after this forward
    writes: list[TableWrite]
    lora_slots: list[int] | None = None  # each request's LoRA pool slot (ModelWorkerBatch.lora_slots)

    @classmethod
    def of(cls, batch: ModelWorkerBatch, writes: list[TableWrite], sampled: bool) -> TPStep:
        return cls(
            forward_mode=int(batch.forward_mode),
            input_ids=None if batch.input_ids is None else batch.input_ids.tolist(),
            req_pool_indices=batch.req_pool_indices.tolist(),
            seq_lens=batch.seq_lens.tolist(),
            out_cache_loc=batch.out_cache_loc.tolist(),
            extend_seq_lens=batch.extend_seq_lens,
            extend_prefix_lens=batch.extend_prefix_lens,
            mixed_decode_rows=batch.mixed_decode_rows,
            return_prompt_logits=batch.return_prompt_logits,
            prompt_logprob_rows=batch.prompt_logprobs.rows if batch.prompt_logprobs is not None else [],
            sampled=sampled,
            writes=writes,
            lora_slots=batch.lora_slots,
        )

    def worker_batch(self) -> ModelWorkerBatch:
        """The forward as a `ModelWorkerBatch` (no sampling info: workers do not sample)."""

        def ids(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        return ModelWorkerBatch(
            forward_mode=ForwardMode(self.forward_mode),
            input_ids=None if self.input_ids is None else ids(self.input_ids),
            req_pool_indices=ids(self.req_pool_indices),
            seq_lens=ids(self.seq_lens),
            out_cache_loc=ids(self.out_cache_loc),
            seq_lens_cpu=list(self.seq_lens),
            extend_seq_lens=self.extend_seq_lens,
            extend_prefix_lens=self.extend_prefix_lens,
            mixed_decode_rows=self.mixed_decode_rows,
            return_prompt_logits=self.return_prompt_logits,
            prompt_logprobs=(PromptLogprobPlan(self.prompt_logprob_rows, [], []) if self.prompt_logprob_rows else None),
            lora_slots=self.lora_slots,
        )


class TPStop(msgspec.Struct, tag="stop", array_like=True):
    """The engine is stopping: leave the loop and the group."""

    reason: str = "engine stopped"


class TPUpdateWeights(msgspec.Struct, tag="update_weights", array_like=True):
    """Load this checkpoint (each rank its own shard); every rank swaps to it, or none does."""

    model_path: str


class TPUpdateTensors(msgspec.Struct, tag="update_tensors", array_like=True):
    """New weights by name; each tensor follows, whole, by `TPGroup.broadcast_tensor`."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


class TPRunnerCall(msgspec.Struct, tag="call", array_like=True):
    """Rank 0 makes this ModelRunner call between forwards: every rank makes it (one of
    `RANK_CALLS`: memory release / resume, a trainer's weight-update group, LoRA adapters and
    pool slots)."""

    method: str
    kwargs: dict[str, Any]


RANK_CALLS = (
    "release_memory_occupation",
    "resume_memory_occupation",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "load_lora_adapter",
    "apply_lora_changes",
)

TPMessage = TPStep | TPStop | TPUpdateWeights | TPUpdateTensors | TPRunnerCall

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TPMessage)


def encode(msg: TPMessage) -> bytes:
    return _encoder.encode(msg)


def decode(payload: bytes) -> TPMessage:
    return _decoder.decode(payload)
