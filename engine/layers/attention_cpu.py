"""Attention on CPUs through the C++ paged attention kernels (engine/kernels/cpu_attention.py).

Chosen at start-up (attention_backend.py) when the device is a CPU, the KV dtype is fp32 or bf16,
the head size is 64, 128 or 256 and the kernels' extension built. Gemma 2's attention-logit
soft-cap runs inside the kernels (`softcap`), so its layers keep them; a soft-capped model's decode
has no cascade (the shared-prefix GEMM would not cap). The kernels read each request's K/V
rows in place, once, with an online softmax: 3x faster than the torch backend's decode in bf16 and
10x in fp32 (batch 64 x 450 tokens, 2 cores), whose cost is moving the KV cache through memory
three times (gather, copy, read). Extend runs the kernel's causal attention over prefix + new tokens.

Decode batches whose requests share a radix prefix use cascade attention (cascade.py): the shared
prefix once per group (the kernel reading it in place for all the group's queries, or a GEMM), the
own suffixes through the kernel.
"""

from __future__ import annotations

import torch

from engine.cache.memory_pool import KVCache
from engine.kernels import cpu_attention
from engine.layers.attention_ops import HeadLayout, PlannedAttnBackend, decode_rows
from engine.layers.cascade import CascadeDecodePlan
from engine.layers.shared_prefix import SharedPrefixPlan, grouped_queries
from engine.model_executor.forward_batch_info import ForwardBatch


class KernelDecodePlan:
    """Decode: query b over its slot row's first `lens[b]` slots in the kernel; one query per
    request, or (`query_starts`) several per request's row, as a speculative verify has."""

    def __init__(
        self,
        layout: HeadLayout,
        pool: KVCache,
        slots: torch.Tensor,
        lens: torch.Tensor,
        query_starts: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> None:
        self.layout, self.pool, self.slots, self.lens = layout, pool, slots, lens
        self.query_starts, self.softcap = query_starts, softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        kb, vb = self.pool.k_buffer[layer_id], self.pool.v_buffer[layer_id]
        scaling = self.layout.scaling
        out, _ = cpu_attention.decode_attention(
            q, kb, vb, self.slots, self.lens, scaling, self.query_starts, self.softcap
        )
        return out.view(q.shape[0], -1)


class KernelCascadePlan(CascadeDecodePlan):
    """Cascade decode whose own suffixes go through the kernel, and its shared prefixes too where
    the kernel reads a row once for all its queries (bf16 on AVX512-BF16): each group's prefix is
    read in place, with no gathered copy per layer (on W2's shape the gather and the GEMM's softmax
    steps cost more than the arithmetic; docs/PERFORMANCE.md)."""

    def __init__(self, layout: HeadLayout, pool: KVCache, shared: SharedPrefixPlan) -> None:
        super().__init__(layout, pool, shared)
        self.suffix_slots = shared.suffix_slots.view(shared.suffix_lens.numel(), shared.max_suffix)
        self.grouped = grouped_queries(shared) if cpu_attention.shares_rows(pool.dtype) else None

    def attend_prefix(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grouped = self.grouped
        if grouped is None:  # the kernel would read the prefix once per query: the GEMM instead
            return super().attend_prefix(q, k_buffer, v_buffer)
        queries = q.index_select(0, grouped.order)
        out, lse = cpu_attention.decode_attention(
            queries, k_buffer, v_buffer, grouped.rows, grouped.lens, self.layout.scaling, grouped.starts
        )
        b, h, d = q.shape
        o1 = out.new_zeros(b, h, d, dtype=torch.float32).index_copy_(0, grouped.order, out.float())
        lse1 = lse.new_full((b, h), float("-inf")).index_copy_(0, grouped.order, lse)
        return o1, lse1

    def attend_suffix(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scaling = self.layout.scaling
        return cpu_attention.decode_attention(
            q, k_buffer, v_buffer, self.suffix_slots, self.shared.suffix_lens, scaling
        )


class KernelExtendPlan:
    """Extend: each request's new tokens over its prefix and themselves, causally, in the kernel."""

    def __init__(
        self,
        layout: HeadLayout,
        pool: KVCache,
        slots: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        softcap: float | None = None,
    ) -> None:
        self.layout, self.pool, self.slots = layout, pool, slots
        self.prefix_lens, self.extend_lens, self.softcap = prefix_lens, extend_lens, softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        kb, vb = self.pool.k_buffer[layer_id], self.pool.v_buffer[layer_id]
        scaling, prefix, ext = self.layout.scaling, self.prefix_lens, self.extend_lens
        out = cpu_attention.extend_attention(q, kb, vb, self.slots, prefix, ext, scaling, self.softcap)
        return out.view(q.shape[0], -1)


class CpuAttnBackend(PlannedAttnBackend):
    """The C++ kernel backend (`--attention-backend cpu`); see the module docstring."""

    def __init__(self, layout: HeadLayout, cascade: bool = True, softcap: float | None = None) -> None:
        super().__init__(layout, cascade=cascade and softcap is None)
        self.softcap = softcap

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        pool, cap = fb.token_to_kv_pool, self.softcap
        if fb.forward_mode.is_decode():
            rows, _ = decode_rows(fb)
            shared = self.shared_prefix_plan(rows, fb)
            if shared is not None:
                self.plan = KernelCascadePlan(self.layout, pool, shared)
            else:  # on a CPU fb.seq_lens is the host int64 tensor the kernel takes
                self.plan = KernelDecodePlan(self.layout, pool, rows, fb.seq_lens, softcap=cap)
            return
        assert fb.extend_prefix_lens is not None and fb.extend_seq_lens is not None
        max_seq = max(p + e for p, e in zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu))
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_seq].to(torch.int64)
        if fb.forward_mode.is_verify():
            self.plan = per_token_decode_plan(self.layout, pool, rows, fb, cap)
            return
        self.plan = KernelExtendPlan(self.layout, pool, rows, fb.extend_prefix_lens, fb.extend_seq_lens, cap)


def per_token_decode_plan(
    layout: HeadLayout, pool: KVCache, rows: torch.Tensor, fb: ForwardBatch, softcap: float | None = None
) -> KernelDecodePlan:
    """A speculative verify's causal attention as one decode query per token: token i of a
    request attends its row's first prefix + i + 1 slots through the decode kernel, so each
    verified position's logits are bit-identical to what a plain decode step computes there (the
    extend kernel sums in another order, and a near-tie could then pick another token: greedy
    output must not change with speculation). The kernel reads each request's K/V once for all
    its positions (`query_starts`)."""
    prefix, new = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
    lens = [p + i + 1 for p, n in zip(prefix, new) for i in range(n)]
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    return KernelDecodePlan(
        layout,
        pool,
        rows.contiguous(),
        torch.tensor(lens, dtype=torch.int64),
        torch.tensor(starts, dtype=torch.int64),
        softcap,
    )
