"""Sliding-window layers and attention-logit soft-capping, over any attention backend.

Mistral, Phi-3, Qwen2 (with `use_sliding_window`) and Gemma 2/3's local layers attend only the
last `window` positions (transformers: key `k` is visible to query `q` when `q - window < k <= q`);
Gemma 2 also squashes every attention score through `cap * tanh(score / cap)` before the softmax.

`WindowedAttnBackend` wraps the backend chosen at start-up (C++ kernels, torch or Triton):
- a backend that applies windows and the soft-cap in its own kernels (Triton: `applies_windows`)
  runs every layer of every forward; the wrapper only routes the local layers under hybrid SWA
  memory (below);
- otherwise, a forward where no sequence is longer than the smallest window, and the model has no soft-cap
  or the wrapped backend caps itself (the C++ kernels do), is exactly full causal attention: every
  layer runs the wrapped backend's plan (its kernels, its cascade decode), so a short conversation
  on Mistral costs nothing extra;
- otherwise the layers that need it (the windowed ones whose window binds; every layer under a
  soft-cap the wrapped backend does not apply) run `WindowPlan`. Decode (and a speculative
  verify, one decode query per token, as the CPU backend does, so speculation never changes a
  greedy token) reads each query's last `window` slots: through the C++ decode kernel over those
  slots when the wrapped backend is the kernels' (the soft-cap inside it), else as one batched
  pair of matmuls over them. Extend runs the C++ extend kernel with the window there, else one
  SDPA per request with a window mask (explicit scores when soft-capped: SDPA has no cap).

With hybrid SWA memory (engine/cache/swa_pool.py) the local layers' buffers are indexed by SWA
slots: they run on a view of the forward (`swa_view`) whose request table and output slots are in
that space, with a backend object of their own (`swa_inner`, a second instance of the wrapped
kind: a backend's plan belongs to one table). Positions whose SWA slots were released are never
read: they are older than every window of a request longer than the smallest one, and a forward
where no request is longer than that releases nothing.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.cache.memory_pool import KVCache
from engine.kernels import cpu_attention
from engine.layers.attention_cpu import CpuAttnBackend
from engine.layers.attention_ops import HeadLayout, gather_heads, softmax_attend
from engine.model_executor.forward_batch_info import AttentionBackend, ForwardBatch

GLOBAL = 0  # a layer's window: 0 = full causal attention


def attend_window_rows(
    q: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    slots: torch.Tensor,
    pad: torch.Tensor,
    layout: HeadLayout,
    softcap: float | None,
) -> torch.Tensor:
    """Decode-style attention of `q [B, H, D]` over `slots [B, n]` (`pad` True = not visible):
    `[B, H*D]` in q's dtype."""
    b, n = slots.shape
    kvh, d = layout.num_kv_heads, layout.head_dim
    flat = slots.reshape(-1)
    k = gather_heads(kb, flat, layout).view(kvh, b, n, d)
    v = gather_heads(vb, flat, layout).view(kvh, b, n, d)
    qg = q.view(b, kvh, layout.q_per_kv, d).transpose(0, 1)  # [KVH, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(layout.scaling)
    if softcap is not None:  # transformers' order: scale, cap, then the mask
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(pad.view(1, b, 1, n), float("-inf"))
    out, _ = softmax_attend(scores, v, want_lse=False)
    return out.transpose(0, 1).reshape(b, -1).to(q.dtype)


def _window_rows(
    table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's visible slots `[B, n]` (its row's last `window` positions before `lens`, all of
    them for GLOBAL) and the padding mask (True past the visible ones)."""
    starts = (lens - window).clamp_(min=0) if window else torch.zeros_like(lens)
    n = int((lens - starts).max())
    cols = starts[:, None] + torch.arange(n, device=lens.device)[None, :]
    pad = cols >= lens[:, None]
    cols = cols.clamp_(max=table.shape[1] - 1)
    return table[rows[:, None], cols].to(torch.int64), pad


class WindowPlan:
    """One forward's windowed / soft-capped attention (see the module docstring); `kernel`: through
    the C++ kernels."""

    def __init__(
        self, layout: HeadLayout, softcap: float | None, windows: set[int], fb: ForwardBatch, kernel: bool = False
    ) -> None:
        self.layout, self.softcap, self.pool, self.kernel = layout, softcap, fb.token_to_kv_pool, kernel
        table, device = fb.req_to_token_pool.req_to_token, fb.seq_lens.device
        self.decode_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.extend: list[tuple[int, int, int, int]] = []  # (q start, ext, prefix, table row)
        self.table = table
        self.per_query = fb.forward_mode.is_decode() or fb.forward_mode.is_verify()
        if self.per_query:
            rows, lens = fb.req_pool_indices, fb.seq_lens
            if fb.forward_mode.is_verify():  # one query per token: token i sees prefix + i + 1
                per = zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)
                pairs = [(row, p + i + 1) for row, p, n in per for i in range(n)]
                rows = torch.tensor([r for r, _ in pairs], dtype=torch.int64, device=device)
                lens = torch.tensor([n for _, n in pairs], dtype=torch.int64, device=device)
            for w in windows:
                self.decode_rows[w] = _window_rows(table, rows.to(torch.int64), lens.to(torch.int64), w)
            # the kernel's lengths: each query's visible count (its padding trails its slots)
            self.kernel_lens = {w: (~pad).sum(1) for w, (_, pad) in self.decode_rows.items()} if kernel else {}
        elif kernel:  # every request's row of the table (in this view's slots), as CpuAttnBackend reads it
            assert fb.extend_prefix_lens is not None and fb.extend_seq_lens is not None
            max_seq = max(p + e for p, e in zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu))
            self.extend_rows = table[fb.req_pool_indices, :max_seq].to(torch.int64)
            self.prefix_lens, self.extend_lens = fb.extend_prefix_lens, fb.extend_seq_lens
        else:
            start = 0
            per = zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)
            for row, prefix, ext in per:
                self.extend.append((start, ext, prefix, row))
                start += ext

    def forward(self, q: torch.Tensor, layer_id: int, window: int) -> torch.Tensor:
        kb, vb = self.pool.k_buffer[layer_id], self.pool.v_buffer[layer_id]
        if self.per_query:
            slots, pad = self.decode_rows[window]
            if self.kernel:  # each query's visible slots lead its row: the kernel reads the first `lens`
                layout, lens = self.layout, self.kernel_lens[window]
                q3 = q.view(slots.shape[0], layout.num_heads, layout.head_dim)
                out, _ = cpu_attention.decode_attention(q3, kb, vb, slots, lens, layout.scaling, softcap=self.softcap)
                return out.view(slots.shape[0], -1)
            return attend_window_rows(q, kb, vb, slots, pad, self.layout, self.softcap)
        layout = self.layout
        if self.kernel:
            q3 = q.view(q.shape[0], layout.num_heads, layout.head_dim)
            rows, prefix, ext = self.extend_rows, self.prefix_lens, self.extend_lens
            out = cpu_attention.extend_attention(q3, kb, vb, rows, prefix, ext, layout.scaling, self.softcap, window)
            return out.view(q.shape[0], -1)
        out = torch.empty(q.shape[0], layout.num_heads * layout.head_dim, dtype=q.dtype, device=q.device)
        for s, ext, prefix, row in self.extend:
            seq = prefix + ext
            first = max(0, prefix - window + 1) if window else 0  # no query of this chunk sees before
            idx = self.table[row, first:seq].to(torch.int64)
            k, v = gather_heads(kb, idx, layout), gather_heads(vb, idx, layout)  # [KVH, L, D]
            q_pos = torch.arange(prefix, seq, device=q.device)[:, None]
            k_pos = torch.arange(first, seq, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if window:
                visible &= k_pos > q_pos - window
            qi = q[s : s + ext].transpose(0, 1)  # [H, ext, D]
            out[s : s + ext] = self._attend(qi, k, v, visible).transpose(0, 1).reshape(ext, -1)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        if self.softcap is None:  # [1, H, ext, D] operands, the boolean mask broadcast over heads
            o = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=visible, scale=layout.scaling, enable_gqa=True
            )
            return o[0]
        g = layout.q_per_kv
        qg = q.reshape(layout.num_kv_heads, g * q.shape[1], layout.head_dim)  # heads grouped by KV head
        scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(layout.scaling)
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.view(layout.num_kv_heads, g, q.shape[1], -1).masked_fill_(~visible, float("-inf"))
        out, _ = softmax_attend(scores.view(layout.num_kv_heads, g * q.shape[1], -1), v, want_lse=False)
        return out.view(layout.num_heads, q.shape[1], layout.head_dim).to(q.dtype)


class SWATable:
    """The request table in SWA slots, where a backend looks for `req_to_token`."""

    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token


def swa_view(fb: ForwardBatch) -> ForwardBatch:
    """`fb` as the local layers see it under hybrid SWA memory: SWA slots throughout."""
    pool = fb.req_to_token_pool
    assert pool.req_to_swa_token is not None and pool.full_to_swa is not None
    table = SWATable(pool.req_to_swa_token)
    return replace(fb, req_to_token_pool=table, out_cache_loc=pool.full_to_swa[fb.out_cache_loc])  # type: ignore[arg-type]


class WindowedAttnBackend:
    """`inner` for the layers and forwards full attention serves exactly; `WindowPlan` for the rest.

    With `swa_inner` (hybrid SWA memory) the local layers run on `swa_view(fb)` through
    `swa_inner` or a plan of their own; the global layers on `fb` as before.
    """

    def __init__(
        self,
        inner: AttentionBackend,
        layout: HeadLayout,
        windows: tuple[int, ...],
        softcap: float | None,
        swa_inner: AttentionBackend | None = None,
    ):
        self.inner, self.layout, self.windows, self.softcap = inner, layout, windows, softcap
        self.swa_inner = swa_inner
        # the C++ kernels: they cap scores themselves and serve a window's decode over its slots
        self.kernels = isinstance(inner, CpuAttnBackend)
        # windows and the cap inside the backend's own kernels (Triton): nothing to plan here
        self.native = bool(getattr(inner, "applies_windows", False))
        self.min_window = min((w for w in windows if w), default=0)
        self.plan: WindowPlan | None = None
        self.swa_plan: WindowPlan | None = None
        self.swa_fb: ForwardBatch | None = None  # this forward's SWA view (hybrid SWA memory)
        self.own_layers: frozenset[int] = frozenset()  # layers this forward runs through a plan
        self.binding: tuple[int, ...] = windows  # this forward's window per layer (GLOBAL where none binds)

    def binds(self, fb: ForwardBatch) -> bool:
        """Whether some sequence of this forward is longer than the smallest window."""
        return bool(self.min_window) and max(fb.seq_lens_cpu) > self.min_window

    def _local(self, layer_id: int) -> bool:
        """Whether this layer reads the SWA view (hybrid SWA memory, a windowed layer)."""
        return self.swa_inner is not None and self.windows[layer_id] != GLOBAL

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        binds = self.binds(fb)
        if self.native:
            self.own_layers = frozenset()
        elif self.softcap is not None and not self.kernels:
            self.own_layers = frozenset(range(len(self.windows)))
        elif binds:
            self.own_layers = frozenset(i for i, w in enumerate(self.windows) if w)
        else:
            self.own_layers = frozenset()
        self.binding = self.windows if binds else (GLOBAL,) * len(self.windows)
        self.swa_fb = swa_view(fb) if self.swa_inner is not None else None
        views = {False: fb, True: self.swa_fb}
        inners = {False: self.inner, True: self.swa_inner}
        plans: dict[bool, WindowPlan | None] = {False: None, True: None}
        for local in (False, True):
            layers = [i for i in range(len(self.windows)) if self._local(i) == local]
            if any(i not in self.own_layers for i in layers):
                inners[local].init_forward_metadata(views[local])  # type: ignore[union-attr,arg-type]
            needed = {self.binding[i] for i in layers if i in self.own_layers}
            if needed:
                view: ForwardBatch = views[local]  # type: ignore[assignment]
                plans[local] = WindowPlan(self.layout, self.softcap, needed, view, self.kernels)
        self.plan, self.swa_plan = plans[False], plans[True]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        local = self._local(layer_id)
        view = self.swa_fb if local else fb
        assert view is not None
        if layer_id not in self.own_layers:
            inner = self.swa_inner if local else self.inner
            assert inner is not None
            return inner.forward(q, k, v, layer_id, view)
        pool: KVCache = view.token_to_kv_pool
        pool.set_kv(layer_id, view.out_cache_loc, k, v)
        plan = self.swa_plan if local else self.plan
        assert plan is not None
        return plan.forward(q, layer_id, self.binding[layer_id])
