"""Attention over the token-level KV pool with Triton kernels (the GPU backend).

- `init_forward_metadata(fb)` runs once per forward and builds the plan every layer shares: for
  decode the split-KV scratch buffers; for extend the ForwardBatch's device index vectors (extend
  lengths, start offsets, prefix lengths; moved to the device by `ForwardBatch.init_new`) plus the
  host-side max extend length, so no layer needs a device sync.
- `forward(q, k, v, layer_id, fb)` writes the new K/V into the pool with the `store_kv` kernel, then
  runs the plan: the split-KV decode kernel or the extend kernel. Returns `[T, H*D]`.
- Sliding windows (`windows`, one per layer, 0 = none) and Gemma 2's attention-logit soft-cap
  (`softcap`) are applied inside both kernels (`applies_windows`), so the `WindowedAttnBackend`
  around it plans nothing of its own: no torch fallback for any layer or forward.

Triton is imported lazily (on the first `forward`), so importing this module never needs triton or
a GPU. Launching needs CUDA tensors or `TRITON_INTERPRET=1` set before the kernels are first
imported; otherwise a RuntimeError says so.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from engine.cache.memory_pool import KVCache, ReqToTokenPool
from engine.layers.attention_ops import AttentionPlan, HeadLayout
from engine.model_executor.forward_batch_info import ForwardBatch


@functools.cache
def triton_kernels() -> ModuleType:
    """engine.kernels.triton_attention, imported on first use."""
    try:
        from engine.kernels import triton_attention
    except ImportError as e:  # no triton in this environment
        raise RuntimeError(
            f"TritonAttnBackend needs the triton package ({e}); use the torch attention backend instead"
        ) from e
    return triton_attention


class TritonDecodePlan:
    """Split-KV decode of one query per request; `mid_o`/`mid_lse` are the stage-1 scratch."""

    def __init__(
        self,
        backend: TritonAttnBackend,
        fb: ForwardBatch,
        mid_o: torch.Tensor,
        mid_lse: torch.Tensor,
    ):
        self.backend, self.layout, self.num_kv_splits = backend, backend.layout, backend.num_kv_splits
        self.mid_o, self.mid_lse = mid_o, mid_lse
        self.pool: KVCache = fb.token_to_kv_pool
        self.table: ReqToTokenPool = fb.req_to_token_pool
        self.req_pool_indices, self.seq_lens = fb.req_pool_indices, fb.seq_lens

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        triton_kernels().decode_attention_fwd(
            q,
            self.pool.k_buffer[layer_id],
            self.pool.v_buffer[layer_id],
            o,
            self.table.req_to_token,
            self.req_pool_indices,
            self.seq_lens,
            self.num_kv_splits,
            self.layout.scaling,
            mid_o=self.mid_o,
            mid_lse=self.mid_lse,
            window=self.backend.window(layer_id),
            softcap=self.backend.softcap,
        )
        return o.view(q.shape[0], -1)


class TritonExtendPlan:
    """Extend over each request's cached prefix plus its new tokens (causal)."""

    def __init__(self, backend: TritonAttnBackend, fb: ForwardBatch) -> None:
        assert fb.extend_seq_lens is not None and fb.extend_start_loc is not None and fb.extend_prefix_lens is not None
        self.backend, self.layout, self.fb = backend, backend.layout, fb
        self.max_len_extend = max(fb.extend_seq_lens_cpu, default=0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        fb, pool = self.fb, self.fb.token_to_kv_pool
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        triton_kernels().extend_attention_fwd(
            q,
            k,
            v,
            o,
            pool.k_buffer[layer_id],
            pool.v_buffer[layer_id],
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            fb.extend_seq_lens,
            fb.extend_start_loc,
            fb.extend_prefix_lens,
            self.layout.scaling,
            max_len_extend=self.max_len_extend,
            window=self.backend.window(layer_id),
            softcap=self.backend.softcap,
        )
        return o.view(q.shape[0], -1)


class TritonAttnBackend:
    applies_windows = True  # per-layer sliding windows and the soft-cap inside the kernels

    def __init__(
        self,
        layout: HeadLayout,
        num_kv_splits: int = 8,
        windows: tuple[int, ...] = (),
        softcap: float | None = None,
    ) -> None:
        if layout.num_heads % layout.num_kv_heads:
            raise ValueError(
                f"num_heads ({layout.num_heads}) must be a multiple of num_kv_heads ({layout.num_kv_heads})"
            )
        if num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        self.layout = layout
        self.num_kv_splits = num_kv_splits
        self.windows = windows  # one per layer, 0 = full causal attention; () = none anywhere
        self.softcap = softcap or 0.0  # 0: no cap
        self.plan: AttentionPlan | None = None
        # fixed [max_bs, ...] decode scratch (init_cuda_graph_state): (mid_o, mid_lse)
        self._decode_scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_cuda_graph_state(self, max_bs: int, device: torch.device) -> None:
        """Allocate the decode split-KV scratch once, for up to `max_bs` requests.

        Why: a CUDA graph bakes in every buffer address it touches, so decode metadata must not be
        allocated per forward. After this call every decode batch of <= max_bs requests (captured
        or eager) uses rows [:B] of these buffers, and building its metadata is only slicing: no
        allocation, no host<->device traffic, nothing that reads a sequence length on the host.
        The scratch does not depend on the context length: each request's sequence is split into
        `num_kv_splits` parts of ceil(seq_len / splits) positions, computed inside the kernel.
        """
        shape = (max_bs, self.layout.num_heads, self.num_kv_splits)
        self._decode_scratch = (
            torch.empty((*shape, self.layout.head_dim), dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
        )

    def window(self, layer_id: int) -> int:
        """Layer `layer_id`'s sliding window (0: none)."""
        return self.windows[layer_id] if self.windows else 0

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if not fb.forward_mode.is_decode():
            self.plan = TritonExtendPlan(self, fb)
            return
        b = fb.batch_size
        fixed = self._decode_scratch
        if fixed is not None and b <= fixed[0].shape[0]:  # graph-safe: views of fixed buffers
            mid_o, mid_lse = fixed[0][:b], fixed[1][:b]
        else:
            shape = (b, self.layout.num_heads, self.num_kv_splits)
            device = fb.seq_lens.device
            mid_o = torch.empty((*shape, self.layout.head_dim), dtype=torch.float32, device=device)
            mid_lse = torch.empty(shape, dtype=torch.float32, device=device)
        self.plan = TritonDecodePlan(self, fb, mid_o, mid_lse)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens. Returns [T, H*D]."""
        pool = fb.token_to_kv_pool
        triton_kernels().store_kv(pool.k_buffer[layer_id], pool.v_buffer[layer_id], fb.out_cache_loc, k, v)
        assert self.plan is not None, "init_forward_metadata was not called for this forward"
        return self.plan.forward(q, k, v, layer_id)
