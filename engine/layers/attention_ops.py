"""What the CPU-kernel and torch attention backends share: head layout, the per-forward plan
interface, and the torch building blocks of decode attention over the paged KV pool.

A backend's `init_forward_metadata` builds one plan per forward (decode, cascade decode or
extend), holding the index tensors every layer reuses; `forward` stores the new K/V and runs
`plan.forward` for that layer. A plan does one thing, so no layer re-dispatches on metadata types.

The torch decode path (`attend_rows`): two batched matmuls for the whole batch over a head-major
`index_select` gather of each request's slots (padded to the longest, masked), grouped-query
heads folded into the query axis (`[KVH, B, G, D] @ [KVH, B, D, L]`) so K/V are never repeated
per head. The softmax runs in fp32 whatever the KV dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.layers import shared_prefix
from engine.model_executor.forward_batch_info import ForwardBatch


@dataclass(frozen=True)
class HeadLayout:
    """Query/KV head counts, head size and softmax scale of one model's attention."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


class AttentionPlan(Protocol):
    """One forward's attention for one layer, the new K/V already in the pool: `[T, H*D]`."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor: ...


class PlannedAttnBackend(ABC):
    """Base of the backends that write K/V through the pool and attend through a per-forward plan."""

    def __init__(self, layout: HeadLayout, cascade: bool = True) -> None:
        self.layout = layout
        self.cascade = cascade  # decode shared prefixes once per group (ServerArgs.disable_cascade_attention)
        self.plan: AttentionPlan | None = None

    def shared_prefix_plan(self, rows: torch.Tensor, fb: ForwardBatch) -> shared_prefix.SharedPrefixPlan | None:
        """The cascade plan for a decode batch's slot rows, or None (off, or not worth it)."""
        return shared_prefix.plan_shared_prefix(rows, fb.seq_lens_cpu) if self.cascade else None

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build this forward's plan (`self.plan`), shared by every layer."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens. Returns [T, H*D]."""
        fb.token_to_kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        assert self.plan is not None, "init_forward_metadata was not called for this forward"
        return self.plan.forward(q, k, v, layer_id)


def gather_heads(buffer: torch.Tensor, slots: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    """Rows `slots` of one layer's K or V buffer, head-major: `[KVH, len(slots), D]`.

    One `index_select` per KV head on the strided `[slots, D]` view of that head writes straight
    into the head-major result, so the batched matmuls read it without the transposing copy a
    `[len, KVH, D]` gather would need (that copy cost as much as the gather).
    """
    out = torch.empty(layout.num_kv_heads, slots.numel(), layout.head_dim, dtype=buffer.dtype, device=buffer.device)
    for h in range(layout.num_kv_heads):
        torch.index_select(buffer[:, h, :], 0, slots, out=out[h])
    return out


def softmax_attend(
    scores: torch.Tensor, v: torch.Tensor, want_lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(softmax(scores) @ v as fp32, logsumexp(scores)) for fp32 scores `[..., L]` (no all -inf row)."""
    lse = torch.logsumexp(scores, -1) if want_lse else None
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).float(), lse


def attend_rows(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    n: int,
    pad: torch.Tensor | None,
    layout: HeadLayout,
    want_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention of `q [B, H, D]` over `n` slots per request (`slots`: `[B * n]`, `pad`:
    `[B, n]` True = padding, or None): (out [B, H, D] fp32, lse [B, H] fp32 or None)."""
    b, kvh, d = q.shape[0], layout.num_kv_heads, layout.head_dim
    k = gather_heads(k_buffer, slots, layout).view(kvh, b, n, d)
    v = gather_heads(v_buffer, slots, layout).view(kvh, b, n, d)
    qg = q.view(b, kvh, layout.q_per_kv, d).transpose(0, 1)  # [KVH, B, G, D]: heads grouped by KV head
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(layout.scaling)  # [KVH, B, G, L]
    if pad is not None:
        scores.masked_fill_(pad.view(1, b, 1, n), float("-inf"))
    out, lse = softmax_attend(scores, v, want_lse)  # [KVH, B, G, *]
    out = out.transpose(0, 1).reshape(b, layout.num_heads, d)
    return out, None if lse is None else lse.transpose(0, 1).reshape(b, layout.num_heads)


def decode_rows(fb: ForwardBatch) -> tuple[torch.Tensor, int]:
    """The decode batch's slot table rows, `[B, max_len]` int64 (past a request's length: whatever
    the table holds), and max_len."""
    max_len = max(fb.seq_lens_cpu)
    return fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].to(torch.int64), max_len
