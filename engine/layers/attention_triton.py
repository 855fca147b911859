"""Attention over the token-level KV pool with Triton kernels (the GPU backend).

Same interface as `TorchAttnBackend` (engine/layers/attention_torch.py):

- `init_forward_metadata(fb)` runs once per forward and builds the small index tensors every layer
  shares: for decode the split-KV scratch buffers; for extend the per-request extend lengths, start
  offsets into the flattened new tokens and prefix lengths (plus the host-side max extend length,
  so no layer needs a device sync).
- `forward(q, k, v, layer_id, fb)` writes the new K/V into the pool with the `store_kv` kernel, then
  runs the split-KV decode kernel or the extend kernel. Returns `[T, H*D]`.

Triton is imported lazily (on the first `init_forward_metadata` / `forward`), so importing this
module never needs triton or a GPU. Launching needs CUDA tensors or `TRITON_INTERPRET=1` set before
the kernels are first imported; otherwise a RuntimeError says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.model_executor.host_transfer import host_to_device

if TYPE_CHECKING:
    from engine.model_executor.forward_batch_info import ForwardBatch

_kernels_module = None


def _kernels():
    """engine.kernels.triton_attention, imported on first use."""
    global _kernels_module
    if _kernels_module is None:
        try:
            from engine.kernels import triton_attention
        except ImportError as e:  # no triton in this environment
            raise RuntimeError(
                f"TritonAttnBackend needs the triton package ({e}); use the torch attention backend instead"
            ) from e
        _kernels_module = triton_attention
    return _kernels_module


@dataclass
class _DecodeMeta:
    mid_o: torch.Tensor  # [B, H, splits, D] fp32 stage-1 partial outputs, shared by all layers
    mid_lse: torch.Tensor  # [B, H, splits] fp32 stage-1 log-sum-exp


@dataclass
class _ExtendMeta:
    extend_seq_lens: torch.Tensor  # [B] int32
    extend_start_loc: torch.Tensor  # [B] int32, exclusive prefix sum of extend_seq_lens
    prefix_lens: torch.Tensor  # [B] int32
    max_len_extend: int


class TritonAttnBackend:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, num_kv_splits: int = 8) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_splits = num_kv_splits
        self.meta: _DecodeMeta | _ExtendMeta | None = None
        self._decode_scratch: _DecodeMeta | None = None  # fixed [max_bs, ...] buffers (init_cuda_graph_state)

    def prepare(self, device: torch.device) -> None:
        """Start-up hook shared with TorchAttnBackend: Triton compiles its kernels on first launch."""

    def init_cuda_graph_state(self, max_bs: int, device: torch.device) -> None:
        """Allocate the decode split-KV scratch once, for up to `max_bs` requests.

        Why: a CUDA graph bakes in every buffer address it touches, so decode metadata must not be
        allocated per forward. After this call every decode batch of <= max_bs requests (captured
        or eager) uses rows [:B] of these buffers, and building its metadata is only slicing: no
        allocation, no host<->device traffic, nothing that reads a sequence length on the host.
        The scratch does not depend on the context length: each request's sequence is split into
        `num_kv_splits` parts of ceil(seq_len / splits) positions, computed inside the kernel.
        """
        shape = (max_bs, self.num_heads, self.num_kv_splits)
        self._decode_scratch = _DecodeMeta(
            torch.empty((*shape, self.head_dim), dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
        )

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.seq_lens.device
        if fb.forward_mode.is_decode():
            b = len(fb.seq_lens_cpu)
            fixed = self._decode_scratch
            if fixed is not None and b <= fixed.mid_o.shape[0]:  # graph-safe: views of fixed buffers
                self.meta = _DecodeMeta(fixed.mid_o[:b], fixed.mid_lse[:b])
                return
            mid_o = torch.empty((b, self.num_heads, self.num_kv_splits, self.head_dim), dtype=torch.float32, device=device)
            mid_lse = torch.empty((b, self.num_heads, self.num_kv_splits), dtype=torch.float32, device=device)
            self.meta = _DecodeMeta(mid_o, mid_lse)
            return
        ext = list(fb.extend_seq_lens)
        starts = [0] * len(ext)
        for i in range(1, len(ext)):
            starts[i] = starts[i - 1] + ext[i - 1]
        # One host->device copy for the three index vectors.
        host = torch.tensor([ext, starts, list(fb.extend_prefix_lens)], dtype=torch.int32).reshape(3, len(ext))
        dev = host_to_device([host], device)[0]  # pinned + non-blocking on CUDA
        self.meta = _ExtendMeta(dev[0], dev[1], dev[2], max(ext, default=0))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens. Returns [T, H*D]."""
        kern = _kernels()
        pool = fb.token_to_kv_pool
        k_buffer, v_buffer = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        kern.store_kv(k_buffer, v_buffer, fb.out_cache_loc, k, v)
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        table = fb.req_to_token_pool.req_to_token
        meta = self.meta
        if fb.forward_mode.is_decode():
            assert isinstance(meta, _DecodeMeta), "init_forward_metadata was not called for this decode batch"
            kern.decode_attention_fwd(
                q, k_buffer, v_buffer, o, table, fb.req_pool_indices, fb.seq_lens,
                self.num_kv_splits, self.scaling, mid_o=meta.mid_o, mid_lse=meta.mid_lse,
            )
        else:
            assert isinstance(meta, _ExtendMeta), "init_forward_metadata was not called for this extend batch"
            kern.extend_attention_fwd(
                q, k, v, o, k_buffer, v_buffer, table, fb.req_pool_indices, fb.seq_lens,
                meta.extend_seq_lens, meta.extend_start_loc, meta.prefix_lens, self.scaling,
                max_len_extend=meta.max_len_extend,
            )
        return o.view(q.shape[0], self.num_heads * self.head_dim)
