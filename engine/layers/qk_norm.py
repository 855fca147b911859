"""RMSNorm of the attention's q and k before RoPE, in the two forms the supported families use.

Both take and return the adjacent q|k heads of one forward as a `[T, H + KVH, D]` slab (the
attention rotates that slab in one call):
- `QKNorm` (Qwen3): each head normalised on its own, with one `[D]` weight for q and one for k;
- `WholeQKNorm` (OLMo 2): all of q normalised as one `[H * D]` row and all of k as one
  `[KVH * D]` row (transformers' `Olmo2Attention`: `q_norm(q_proj(x))`), weights of those sizes.
  Under tensor parallelism a rank holds only its heads: the sums of squares are all-reduced
  (one collective for q and k), so each rank normalises by the whole row's mean. A KV head
  replicated on `r` ranks is counted `r` times in the sum and in the count alike.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import TPGroup
from engine.distributed.sharding import TPShard
from engine.kernels import cpu_elementwise
from engine.layers.norm import fused_norm_applies, rms_norm, rms_norm_weight_first


def _param(size: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(size, device=device, dtype=dtype), requires_grad=False)


class QKNorm(nn.Module):
    """Qwen3's per-head RMSNorm of q and k, applied to the adjacent q|k heads as one slab with one
    `[H + KVH, D]` weight table (half the ops of normalising each; same per-element arithmetic).

    `unit_offset` (Gemma 3): the weights scale by `1 + weight` in fp32, before the cast.

    bf16 on a CPU with the fused kernels (`uses_cpu_kernel`): one pass per head
    (`cpu_elementwise.rms_norm_heads`, the fused RMSNorm's roundings) instead of seven torch ops;
    the fused decode loop calls the same kernel on the same table."""

    def __init__(
        self,
        head_dim: int,
        eps: float,
        shard: TPShard,
        device: torch.device,
        dtype: torch.dtype,
        unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.eps = shard.num_heads, shard.num_kv_heads, eps
        self.q_weight = _param(head_dim, device, dtype)
        self.k_weight = _param(head_dim, device, dtype)
        self.unit_offset = unit_offset
        self._norm = rms_norm_weight_first if unit_offset else rms_norm
        self.uses_cpu_kernel = fused_norm_applies(head_dim, device, dtype)
        self.table = torch.empty(0)  # built once the weights are in (`process_weights_after_loading`)

    def process_weights_after_loading(self) -> None:
        q, k = self.q_weight, self.k_weight
        if self.unit_offset and not self.uses_cpu_kernel:  # an fp32 table: scaled before the cast
            q, k = 1.0 + q.float(), 1.0 + k.float()  # (the kernel adds the 1 in fp32 itself)
        self.table = torch.cat([q.expand(self.num_heads, -1), k.expand(self.num_kv_heads, -1)])

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        if self.uses_cpu_kernel:
            return cpu_elementwise.rms_norm_heads(qk, self.table, self.eps, self.unit_offset)
        return self._norm(qk, self.table, self.eps)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class WholeQKNorm(nn.Module):
    """OLMo 2's RMSNorm over the whole projected q and k (see the module docstring), in its
    order: fp32 statistics, the weight applied in fp32, then the cast."""

    def __init__(
        self, head_dim: int, eps: float, tp: TPGroup, shard: TPShard, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp, self.eps = tp, eps
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, head_dim
        self.q_weight = _param(shard.num_heads * head_dim, device, dtype)  # this rank's slice of q_norm
        self.k_weight = _param(shard.num_kv_heads * head_dim, device, dtype)
        # the whole rows' widths, as the all-reduced sums count them
        self.counts = torch.tensor([self.q_weight.numel(), self.k_weight.numel()], dtype=torch.float) * tp.size
        self.counts = self.counts.to(device)

    def process_weights_after_loading(self) -> None:
        pass

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        t, heads = qk.shape[0], self.num_heads
        q = qk[:, :heads].reshape(t, -1).float()
        k = qk[:, heads:].reshape(t, -1).float()
        if self.tp.size == 1:
            q_var, k_var = q.pow(2).mean(-1, keepdim=True), k.pow(2).mean(-1, keepdim=True)
        else:
            sums = self.tp.all_reduce(torch.stack((q.pow(2).sum(-1), k.pow(2).sum(-1)), dim=-1))
            var = sums / self.counts
            q_var, k_var = var[:, :1], var[:, 1:]
        q = self.q_weight * (q * torch.rsqrt(q_var + self.eps))
        k = self.k_weight * (k * torch.rsqrt(k_var + self.eps))
        return torch.cat((q, k), dim=-1).to(qk.dtype).view(t, -1, self.head_dim)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)
