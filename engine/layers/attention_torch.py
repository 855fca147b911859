"""Attention over the token-level KV pool in plain torch: the reference backend.

It runs where the C++ kernels do not (other devices, head sizes, dtypes, or a machine that could
not build them), and it is what the Triton kernels are tested against.

- decode: two batched matmuls for the whole batch over a head-major gather of each request's
  slots, padded to the longest and masked (`attention_ops.attend_rows`). No Python loop over
  requests per layer.
- decode with shared prefixes: cascade attention (cascade.py), the suffixes through the same
  torch path.
- extend: a loop over requests (prefill is compute-bound, so the loop's overhead is small next to
  the matmuls, and no work is wasted on padding mixed lengths), one 4-D SDPA each (flash kernel).
  New tokens attend to the cached prefix read from the pool plus themselves, causally. Without a
  prefix the fresh K/V are used directly (no gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cache.memory_pool import KVCache
from engine.layers.attention_ops import HeadLayout, PlannedAttnBackend, attend_rows, decode_rows, gather_heads
from engine.layers.cascade import CascadeDecodePlan
from engine.model_executor.forward_batch_info import ForwardBatch


class TorchDecodePlan:
    """Decode over `[B, n]` padded slot rows (`pad`: True = padding, None when no row is short)."""

    def __init__(self, layout: HeadLayout, pool: KVCache, slots: torch.Tensor, n: int, pad: torch.Tensor | None):
        self.layout, self.pool, self.slots, self.n, self.pad = layout, pool, slots, n, pad

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        kb, vb = self.pool.k_buffer[layer_id], self.pool.v_buffer[layer_id]
        out, _ = attend_rows(q, kb, vb, self.slots, self.n, self.pad, self.layout, want_lse=False)
        return out.to(q.dtype).reshape(q.shape[0], -1)


class TorchCascadePlan(CascadeDecodePlan):
    """Cascade decode whose own suffixes go through the torch decode path."""

    def attend_suffix(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.shared
        out, lse = attend_rows(q, k_buffer, v_buffer, plan.suffix_slots, plan.max_suffix, plan.suffix_pad, self.layout)
        assert lse is not None
        return out, lse


class TorchExtendPlan:
    """Extend, one SDPA per request. Per request: the slots of its whole sequence and its
    `[extend, seq]` causal mask (both None without a prefix), and where its queries start."""

    def __init__(
        self,
        layout: HeadLayout,
        pool: KVCache,
        extend_lens: list[int],
        kv_indices: list[torch.Tensor | None],
        masks: list[torch.Tensor | None],
        q_starts: list[int],
    ) -> None:
        self.layout, self.pool, self.extend_lens = layout, pool, extend_lens
        self.kv_indices, self.masks, self.q_starts = kv_indices, masks, q_starts

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        layout = self.layout
        kb, vb = self.pool.k_buffer[layer_id], self.pool.v_buffer[layer_id]
        out = torch.empty(q.shape[0], layout.num_heads * layout.head_dim, dtype=q.dtype, device=q.device)
        for i, ext in enumerate(self.extend_lens):
            s = self.q_starts[i]
            # 4-D [1, heads, len, D] operands: torch's CPU flash kernel takes those; 3-D ones fall
            # back to the math path, 3x (256 tokens) to 6x (2048) slower in bf16.
            qi = q[s : s + ext].transpose(0, 1)[None]
            idx = self.kv_indices[i]
            if idx is None:
                ki, vi = k[s : s + ext].transpose(0, 1)[None], v[s : s + ext].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layout.scaling, enable_gqa=True)
            else:
                ki, vi = gather_heads(kb, idx, layout)[None], gather_heads(vb, idx, layout)[None]
                mask = self.masks[i]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layout.scaling, enable_gqa=True)
            out[s : s + ext] = o[0].transpose(0, 1).reshape(ext, -1)
        return out


class TorchAttnBackend(PlannedAttnBackend):
    """The pure-torch backend (`--attention-backend torch`); see the module docstring."""

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        pool = fb.token_to_kv_pool
        if fb.forward_mode.is_decode():
            rows, max_len = decode_rows(fb)
            shared = self.shared_prefix_plan(rows, fb)
            if shared is not None:
                self.plan = TorchCascadePlan(self.layout, pool, shared)
                return
            pad = None
            if min(fb.seq_lens_cpu) < max_len:
                pad = torch.arange(max_len, device=rows.device)[None, :] >= fb.seq_lens[:, None]
            self.plan = TorchDecodePlan(self.layout, pool, rows.reshape(-1), max_len, pad)
            return
        table = fb.req_to_token_pool.req_to_token
        kv_indices: list[torch.Tensor | None] = []
        masks: list[torch.Tensor | None] = []
        q_starts, start = [], 0
        for row, prefix, ext in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            q_starts.append(start)
            start += ext
            if prefix == 0:
                kv_indices.append(None)
                masks.append(None)
                continue
            seq = prefix + ext
            kv_indices.append(table[row, :seq].to(torch.int64))
            q_pos = torch.arange(prefix, seq, device=table.device)[:, None]
            masks.append(torch.arange(seq, device=table.device)[None, :] <= q_pos)
        self.plan = TorchExtendPlan(self.layout, pool, fb.extend_seq_lens_cpu, kv_indices, masks, q_starts)
