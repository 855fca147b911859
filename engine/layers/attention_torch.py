"""Attention over the token-level KV pool on CPU (and the reference for the Triton kernels).

- decode on CPU (fp32/bf16, head_dim 64 or 128): the C++ kernel of kernels/cpu_attention.py
  reads each request's K/V rows in place, once, with an online softmax: 3x faster than the torch
  path below in bf16 and 10x in fp32 (batch 64 x 450 tokens, 2 cores), whose cost was moving the
  KV cache through memory three times (gather, copy, read).
- decode, torch path (other devices, other head sizes, or the kernel unavailable): two batched
  matmuls for the whole batch over a head-major `index_select` gather of each request's slots
  (padded to the longest, masked), grouped-query heads folded into the query axis
  (`[KVH, B, G, D] @ [KVH, B, D, L]`) so K/V are never repeated per head. The softmax runs in fp32
  whatever the KV dtype. No Python loop over requests per layer.
- decode with shared prefixes (cascade): when requests of the batch share a long run of KV slots
  (the radix cache hands every request that matched a prefix the same slots), each shared prefix
  is attended once for all its requests and each request's own suffix separately; the two
  softmax partials are merged exactly from their log-sum-exps (`shared_prefix.py` plans it once
  per forward; the suffixes go through the kernel when it runs). This cuts the KV rows a step
  reads by up to the group size (W2 of bench.offline: 8 groups of 8).
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

from engine.kernels import cpu_attention
from engine.layers.shared_prefix import SharedPrefixPlan, plan_shared_prefix

if TYPE_CHECKING:
    from engine.model_executor.forward_batch_info import ForwardBatch


@dataclass
class _DecodeMeta:
    rows: torch.Tensor  # [B, max_len] int64 slot ids (past a request's length: whatever the table holds)
    max_len: int
    use_kernel: bool
    lens: torch.Tensor | None = None  # kernel: [B] int64 on the host
    masked_out: torch.Tensor | None = None  # torch path: [B, 1, 1, max_len] bool, True = padding
    shared: SharedPrefixPlan | None = None  # set: cascade decode (rows/lens/masked_out unused)


@dataclass
class _ExtendMeta:
    use_kernel: bool
    # kernel: [R, max seq] slot rows and host length tensors
    rows: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    extend_lens: torch.Tensor | None = None
    # torch path, per request: slots of the whole sequence and [extend, seq] causal mask (None
    # without a prefix), and where its queries start
    kv_indices: list[torch.Tensor | None] | None = None
    masks: list[torch.Tensor | None] | None = None
    q_starts: list[int] | None = None


class TorchAttnBackend:
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, cascade: bool = True,
        cpu_kernel: bool = True,
    ) -> None:  # fmt: skip
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.cascade = cascade  # decode shared prefixes once per group (ServerArgs.disable_cascade_attention)
        # The C++ kernels (kernels/cpu_attention.py), built at start-up (`prepare`) when wanted.
        self.cpu_kernel = cpu_kernel
        self.meta: _DecodeMeta | _ExtendMeta | None = None

    def prepare(self, device: torch.device) -> None:
        """Build the CPU kernels now (start-up), not inside the first request's forward."""
        if self.cpu_kernel and cpu_attention.supports(device, torch.float32, self.head_dim):
            cpu_attention.load()

    def _kernel_ok(self, fb: ForwardBatch) -> bool:
        """Whether this forward's attention runs in the C++ kernels (decided once per forward)."""
        pool = fb.token_to_kv_pool
        return (
            self.cpu_kernel
            and cpu_attention.supports(pool.device, pool.dtype, self.head_dim)
            and cpu_attention.load() is not None
        )

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        table = fb.req_to_token_pool.req_to_token
        use_kernel = self._kernel_ok(fb)
        if fb.forward_mode.is_decode():
            max_len = max(fb.seq_lens_cpu)
            rows = table[fb.req_pool_indices, :max_len].to(torch.int64)
            meta = _DecodeMeta(rows, max_len, use_kernel)
            meta.shared = plan_shared_prefix(rows, fb.seq_lens_cpu) if self.cascade else None
            if meta.shared is None and use_kernel:
                meta.lens = torch.tensor(fb.seq_lens_cpu, dtype=torch.int64)
            elif meta.shared is None and min(fb.seq_lens_cpu) < max_len:
                ar = torch.arange(max_len, device=rows.device)
                meta.masked_out = (ar[None, :] >= fb.seq_lens[:, None])[:, None, None, :]
            self.meta = meta
            return
        if use_kernel:
            max_seq = max(p + e for p, e in zip(fb.extend_prefix_lens, fb.extend_seq_lens))
            self.meta = _ExtendMeta(True, table[fb.req_pool_indices, :max_seq].to(torch.int64),
                                    torch.tensor(fb.extend_prefix_lens, dtype=torch.int64),
                                    torch.tensor(fb.extend_seq_lens, dtype=torch.int64))  # fmt: skip
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
        self.meta = _ExtendMeta(False, kv_indices=kv_indices, masks=masks, q_starts=q_starts)

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
        b = q.shape[0]
        if meta.shared is not None:
            out = self._decode_cascade(q, layer_id, fb, meta.shared, meta.use_kernel)
        elif meta.use_kernel:
            pool = fb.token_to_kv_pool
            out, _ = cpu_attention.decode_attention(
                q, pool.k_buffer[layer_id], pool.v_buffer[layer_id], meta.rows, meta.lens, self.scaling
            )
        else:
            out, _ = self._attend_rows(q, layer_id, fb, meta.rows.reshape(-1), meta.max_len, meta.masked_out, False)
        return out.to(q.dtype).reshape(b, self.num_heads * self.head_dim)

    def _attend_rows(
        self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, slots: torch.Tensor, n: int, pad: torch.Tensor | None,
        want_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Torch decode attention over `n` slots per request: (out [B, H, D], lse [B, H] fp32 or None)."""
        pool = fb.token_to_kv_pool
        b, kvh, d = q.shape[0], self.num_kv_heads, self.head_dim
        k = self._gather_heads(pool.k_buffer[layer_id], slots).view(kvh, b, n, d)
        v = self._gather_heads(pool.v_buffer[layer_id], slots).view(kvh, b, n, d)
        qg = q.view(b, kvh, self.num_heads // kvh, d).transpose(0, 1)  # [KVH, B, G, D]: heads grouped by KV head
        scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(self.scaling)  # [KVH, B, G, L]
        if pad is not None:
            scores.masked_fill_(pad.view(1, b, 1, n), float("-inf"))
        out, lse = _softmax_attend(scores, v, want_lse)  # [KVH, B, G, *]
        out = out.transpose(0, 1).reshape(b, self.num_heads, d)
        return out, None if lse is None else lse.transpose(0, 1).reshape(b, self.num_heads)

    def _decode_cascade(
        self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, plan: SharedPrefixPlan, use_kernel: bool
    ) -> torch.Tensor:
        """Decode attention split into shared prefixes (one GEMM per group) and own suffixes: [B, H, D]."""
        pool = fb.token_to_kv_pool
        kb, vb = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        b, kvh, d = q.shape[0], self.num_kv_heads, self.head_dim
        g = self.num_heads // kvh
        n, p, m, s = plan.num_groups, plan.max_prefix, plan.max_members, plan.max_suffix
        # Shared prefixes: all query rows of a group's members against its prefix at once.
        kp = self._gather_heads(kb, plan.prefix_slots).view(kvh, n, p, d)
        vp = self._gather_heads(vb, plan.prefix_slots).view(kvh, n, p, d)
        qm = q.view(b, kvh, g, d).index_select(0, plan.member_rows)
        qm = qm.view(n, m, kvh, g, d).permute(2, 0, 1, 3, 4).reshape(kvh, n, m * g, d)
        scores = torch.matmul(qm, kp.transpose(-1, -2)).float().mul_(self.scaling)  # [KVH, n, M*G, P]
        if plan.prefix_pad is not None:
            scores.masked_fill_(plan.prefix_pad.view(1, n, 1, p), float("-inf"))
        o1, lse1 = _softmax_attend(scores, vp)
        o1, lse1 = o1.reshape(kvh, n * m, g, d), lse1.reshape(kvh, n * m, g)
        if plan.has_ungrouped:  # a null member slot: no prefix keys (weight exp(-inf) = 0)
            o1 = torch.cat([o1, o1.new_zeros(kvh, 1, g, d)], 1)
            lse1 = torch.cat([lse1, lse1.new_full((kvh, 1, g), float("-inf"))], 1)
        o1 = o1.index_select(1, plan.member_slot).transpose(0, 1).reshape(b, self.num_heads, d)
        lse1 = lse1.index_select(1, plan.member_slot).transpose(0, 1).reshape(b, self.num_heads)
        # Own suffixes (the whole sequence for requests in no group).
        if use_kernel:
            o2, lse2 = cpu_attention.decode_attention(
                q, kb, vb, plan.suffix_slots.view(b, s), plan.suffix_lens, self.scaling
            )
        else:
            o2, lse2 = self._attend_rows(q, layer_id, fb, plan.suffix_slots, s, plan.suffix_pad)
        # Exact merge of two softmaxes over disjoint keys, from their outputs and log-sum-exps.
        top = torch.maximum(lse1, lse2)
        w1, w2 = (lse1 - top).exp_().unsqueeze(-1), (lse2 - top).exp_().unsqueeze(-1)
        return (o1 * w1 + o2.float() * w2) / (w1 + w2)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        meta = self.meta
        assert isinstance(meta, _ExtendMeta)
        pool = fb.token_to_kv_pool
        if meta.use_kernel:
            out = cpu_attention.extend_attention(q, pool.k_buffer[layer_id], pool.v_buffer[layer_id], meta.rows,
                                                 meta.prefix_lens, meta.extend_lens, self.scaling)  # fmt: skip
            return out.view(q.shape[0], self.num_heads * self.head_dim)
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



def _softmax_attend(scores: torch.Tensor, v: torch.Tensor, want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(softmax(scores) @ v as fp32, logsumexp(scores)) for fp32 scores `[..., L]` (no all -inf row)."""
    lse = torch.logsumexp(scores, -1) if want_lse else None
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).float(), lse
