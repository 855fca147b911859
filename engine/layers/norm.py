"""RMSNorm and residual-add + RMSNorm, as modules whose implementation is fixed at construction.

- torch form (`rms_norm`): computed in fp32 exactly as transformers' Llama/Qwen do (same op order
  => same bits), so fp32 greedy output stays token-identical to transformers';
- fused form (kernels/cpu_elementwise.py): one pass over memory instead of seven ops, bf16 on a
  CPU whose kernels built, rows a multiple of 16 wide. `AddRMSNorm`'s fused form adds into the
  residual stream in place, so the residual must be the forward's own tensor (the embedding
  output or a layer's sum), never a view of something else.

Choosing at construction (from the model's device and dtype) keeps the per-token path free of
feature checks.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import cpu_elementwise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: fp32 statistics, cast back, then the weight."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rms_norm_weight_first(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo 2's RMSNorm: as `rms_norm` but the weight multiplies the fp32 rows before the cast
    (`(weight * h).to(dtype)`; the same bits as `rms_norm` in fp32, one rounding fewer in bf16)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h).to(input_dtype)


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: fp32 statistics, scaled by `1 + weight` in fp32, then the cast (its
    checkpoints store the weight as an offset from 1)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in torch ops (transformers' order: add, then norm)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def fused_add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` in one fused pass; `residual` is updated in place and returned."""
    return cpu_elementwise.add_rms_norm_(residual, x, weight, eps), residual


def fused_norm_applies(hidden_size: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused norms run for this width, device and dtype (builds the kernels if needed)."""
    return hidden_size % cpu_elementwise.WIDTH_MULTIPLE == 0 and cpu_elementwise.available(device, dtype)


class RMSNorm(nn.Module):
    """`weight * normalize(x)` over the last dim of `[T, N]` rows.

    `weight_before_cast`: OLMo 2's order (`rms_norm_weight_first`, torch ops: the fused kernel
    rounds before the weight, as Llama's RMSNorm does); `unit_offset`: Gemma's
    (`rms_norm_unit_offset`; fused, its own kernel, where the plain norm's would be)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        device: torch.device,
        dtype: torch.dtype,
        weight_before_cast: bool = False,
        unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.uses_cpu_kernel = not weight_before_cast and fused_norm_applies(hidden_size, device, dtype)
        torch_form = rms_norm_unit_offset if unit_offset else rms_norm_weight_first if weight_before_cast else rms_norm
        kernel = cpu_elementwise.rms_norm_unit_offset if unit_offset else cpu_elementwise.rms_norm
        self._norm = kernel if self.uses_cpu_kernel else torch_form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class AddRMSNorm(nn.Module):
    """`residual += x`, then RMSNorm of the sum: returns (normalised, new residual)."""

    def __init__(self, hidden_size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.uses_cpu_kernel = fused_norm_applies(hidden_size, device, dtype)
        self._add_norm = fused_add_rms_norm if self.uses_cpu_kernel else add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_norm(residual, x, self.weight, self.eps)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)
