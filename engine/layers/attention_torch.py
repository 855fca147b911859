"""Attention over the token-level KV pool with torch's scaled_dot_product_attention.

The reference backend (CPU, and the ground truth for the Triton kernels):

- decode: two batched matmuls for the whole batch. The per-request KV slot lists are gathered once
  per forward into a flat padded `[B * max_len]` index plus a length mask (`init_forward_metadata`)
  that every layer reuses; each layer gathers its K/V rows head-major with `index_select` (4-8x
  faster on CPU than advanced indexing). Grouped-query heads are folded into the query axis
  (`[KVH, B, G, D] @ [KVH, B, D, L]`), so K/V are never repeated per head. On CPU this is 5-10x faster than SDPA with a mask, whose flash kernel is built for
  long query blocks, not one query row (measured: bench.one_batch, docs/PERFORMANCE.md). The
  softmax runs in fp32 whatever the KV dtype. No Python loop over requests per layer.
- extend: a loop over requests (prefill is compute-bound, so the loop's overhead is small next to
  the matmuls, and no work is wasted on padding mixed lengths), one 4-D SDPA each (flash kernel). New tokens attend to the cached
  prefix read from the pool plus themselves, causally. Without a prefix the fresh K/V are used
  directly (no gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


@dataclass
class _DecodeMeta:
    kv_indices: torch.Tensor  # [B * max_len] int64 slot ids (padding -> whatever the table holds)
    max_len: int
    masked_out: torch.Tensor | None  # [B, 1, 1, max_len] bool, True = padding; None if no padding


@dataclass
class _ExtendMeta:
    kv_indices: list[torch.Tensor | None]  # per request: slots of the whole sequence, None if no prefix
    q_starts: list[int]
    masks: list[torch.Tensor | None]  # per request: [extend, seq] bool when there is a prefix


class TorchAttnBackend:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.meta: _DecodeMeta | _ExtendMeta | None = None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        table = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            max_len = max(fb.seq_lens_cpu)
            kv_indices = table[fb.req_pool_indices, :max_len].to(torch.int64).reshape(-1)
            masked_out = None
            if min(fb.seq_lens_cpu) < max_len:
                ar = torch.arange(max_len, device=kv_indices.device)
                masked_out = (ar[None, :] >= fb.seq_lens[:, None])[:, None, None, :]
            self.meta = _DecodeMeta(kv_indices, max_len, masked_out)
            return
        kv_indices, masks, q_starts, start = [], [], [], 0
        for row, prefix, ext in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens, fb.extend_seq_lens):
            q_starts.append(start)
            start += ext
            if prefix == 0:
                kv_indices.append(None)
                masks.append(None)
                continue
            seq = prefix + ext
            kv_indices.append(table[row, :seq].to(torch.int64))
            q_pos = torch.arange(prefix, seq)[:, None]
            masks.append(torch.arange(seq)[None, :] <= q_pos)
        self.meta = _ExtendMeta(kv_indices, q_starts, masks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens. Returns [T, H*D]."""
        pool = fb.token_to_kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        if fb.forward_mode.is_decode():
            return self._decode(q, layer_id, fb)
        return self._extend(q, k, v, layer_id, fb)

    def _gather_heads(self, buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Rows `slots` of one layer's K or V buffer, head-major: `[KVH, len(slots), D]`.

        One `index_select` per KV head on the strided `[slots, D]` view of that head writes
        straight into the head-major result, so the batched matmuls below read it without the
        transposing copy a `[len, KVH, D]` gather would need (that copy cost as much as the gather).
        """
        out = torch.empty(self.num_kv_heads, slots.numel(), self.head_dim, dtype=buffer.dtype, device=buffer.device)
        for h in range(self.num_kv_heads):
            torch.index_select(buffer[:, h, :], 0, slots, out=out[h])
        return out

    def _decode(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        meta = self.meta
        assert isinstance(meta, _DecodeMeta)
        pool = fb.token_to_kv_pool
        b, n, kvh, d = q.shape[0], meta.max_len, self.num_kv_heads, self.head_dim
        k = self._gather_heads(pool.k_buffer[layer_id], meta.kv_indices).view(kvh, b, n, d)
        v = self._gather_heads(pool.v_buffer[layer_id], meta.kv_indices).view(kvh, b, n, d)
        qg = q.view(b, kvh, self.num_heads // kvh, d).transpose(0, 1)  # [KVH, B, G, D]: heads grouped by KV head
        scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(self.scaling)  # [KVH, B, G, L]
        if meta.masked_out is not None:
            scores.masked_fill_(meta.masked_out.view(1, b, 1, n), float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [KVH, B, G, D]
        return out.transpose(0, 1).reshape(b, self.num_heads * d)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        meta = self.meta
        assert isinstance(meta, _ExtendMeta)
        pool = fb.token_to_kv_pool
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        for i, ext in enumerate(fb.extend_seq_lens):
            s = meta.q_starts[i]
            # 4-D [1, heads, len, D] operands: torch's CPU flash kernel takes those; 3-D ones fall
            # back to the math path, 3x (256 tokens) to 6x (2048) slower in bf16.
            qi = q[s : s + ext].transpose(0, 1)[None]
            idx = meta.kv_indices[i]
            if idx is None:
                ki, vi = k[s : s + ext].transpose(0, 1)[None], v[s : s + ext].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scaling, enable_gqa=True)
            else:
                ki = self._gather_heads(pool.k_buffer[layer_id], idx)[None]
                vi = self._gather_heads(pool.v_buffer[layer_id], idx)[None]
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=meta.masks[i], scale=self.scaling, enable_gqa=True
                )
            out[s : s + ext] = o[0].transpose(0, 1).reshape(ext, -1)
        return out
