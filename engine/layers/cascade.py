"""Cascade decode attention: shared KV prefixes attended once per group, own suffixes per request.

When requests of a decode batch share a long run of KV slots (the radix cache hands every request
that matched a prefix the same slots), each shared prefix is attended once for all its requests
(one GEMM with all their query rows) and each request's own suffix separately; the two softmax
partials are merged exactly from their log-sum-exps. `shared_prefix.py` plans it once per forward;
this cuts the KV rows a step reads by up to the group size (W2 of bench.offline: 8 groups of 8).

The prefix half is torch by default (a GEMM on the prefix's gathered K/V), or the C++ decode kernel
reading each prefix in place once for all its group's queries where it can (`attend_prefix`); the
suffix half is each backend's own decode (`attend_suffix`: the C++ kernel, or the torch gather +
matmuls).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.cache.memory_pool import KVCache
from engine.layers.attention_ops import HeadLayout, gather_heads, softmax_attend
from engine.layers.shared_prefix import SharedPrefixPlan


class CascadeDecodePlan(ABC):
    """A decode forward split into shared prefixes and own suffixes (see the module docstring)."""

    def __init__(self, layout: HeadLayout, pool: KVCache, shared: SharedPrefixPlan) -> None:
        self.layout = layout
        self.pool = pool
        self.shared = shared

    @abstractmethod
    def attend_suffix(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, D], lse [B, H] fp32) of each request over its own suffix slots."""

    def attend_prefix(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, D] fp32, lse [B, H] fp32) of each request over its group's shared prefix
        (zeros and -inf for a request in no group): all query rows of a group against its prefix
        at once, as a GEMM on the prefix's K/V gathered from the pool."""
        layout, plan = self.layout, self.shared
        b, kvh, d, g = q.shape[0], layout.num_kv_heads, layout.head_dim, layout.q_per_kv
        n, p, m = plan.num_groups, plan.max_prefix, plan.max_members
        kp = gather_heads(k_buffer, plan.prefix_slots, layout).view(kvh, n, p, d)
        vp = gather_heads(v_buffer, plan.prefix_slots, layout).view(kvh, n, p, d)
        qm = q.view(b, kvh, g, d).index_select(0, plan.member_rows)
        qm = qm.view(n, m, kvh, g, d).permute(2, 0, 1, 3, 4).reshape(kvh, n, m * g, d)
        scores = torch.matmul(qm, kp.transpose(-1, -2)).float().mul_(layout.scaling)  # [KVH, n, M*G, P]
        if plan.prefix_pad is not None:
            scores.masked_fill_(plan.prefix_pad.view(1, n, 1, p), float("-inf"))
        o1, lse1 = softmax_attend(scores, vp)
        assert lse1 is not None
        o1, lse1 = o1.reshape(kvh, n * m, g, d), lse1.reshape(kvh, n * m, g)
        if plan.has_ungrouped:  # a null member slot: no prefix keys (weight exp(-inf) = 0)
            o1 = torch.cat([o1, o1.new_zeros(kvh, 1, g, d)], 1)
            lse1 = torch.cat([lse1, lse1.new_full((kvh, 1, g), float("-inf"))], 1)
        o1 = o1.index_select(1, plan.member_slot).transpose(0, 1).reshape(b, layout.num_heads, d)
        lse1 = lse1.index_select(1, plan.member_slot).transpose(0, 1).reshape(b, layout.num_heads)
        return o1, lse1

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """`[B, H*D]` for the decode queries `q [B, H, D]` (k, v: already in the pool)."""
        layout = self.layout
        kb, vb = self.pool.k_buffer[layer_id], self.pool.v_buffer[layer_id]
        b, d = q.shape[0], layout.head_dim
        o1, lse1 = self.attend_prefix(q, kb, vb)
        # Own suffixes (the whole sequence for requests in no group).
        o2, lse2 = self.attend_suffix(q, kb, vb)
        # Exact merge of two softmaxes over disjoint keys, from their outputs and log-sum-exps.
        top = torch.maximum(lse1, lse2)
        w1, w2 = (lse1 - top).exp_().unsqueeze(-1), (lse2 - top).exp_().unsqueeze(-1)
        out = (o1 * w1 + o2.float() * w2) / (w1 + w2)
        return out.to(q.dtype).reshape(b, layout.num_heads * d)
