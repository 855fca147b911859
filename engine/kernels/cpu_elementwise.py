"""Fused bf16 elementwise ops of a decoder layer on CPUs (csrc/cpu_elementwise.cpp).

RMSNorm (alone or after the residual add), SiLU(gate) * up and rotary embedding, each one pass over
memory instead of torch's seven, two and four ops (rotary's result is bit-identical to torch's). They round like transformers' bf16 op order, but sum squares in
another order, so a value can differ from torch's by one bf16 rounding step: they are used for
bf16 only; fp32 keeps the torch ops, whose greedy output is token-identical to transformers'.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu_extension import load, module_or_raise

__all__ = ["load", "supports", "rms_norm", "add_rms_norm_", "silu_mul", "rotary"]


def supports(x: torch.Tensor) -> bool:
    """Whether the fused ops take this activation (CPU bf16, last dim a multiple of 16)."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[-1] % 16 == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * bf16(x * rsqrt(mean(x^2) + eps))` over the last dim of a bf16 `[T, N]` x."""
    return module_or_raise().rms_norm(x.contiguous(), weight, eps)


def add_rms_norm_(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x += y` in place (bf16, the residual stream), then returns `rms_norm(x)`."""
    return module_or_raise().add_rms_norm_(x, y.contiguous(), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a bf16 `[T, 2I]` gate|up slab (gate first), as `[T, I]`."""
    return module_or_raise().silu_mul(gate_up.contiguous())


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`layers.rotary.apply_rotary` for bf16 `[T, NH, D]` heads (rows may be a strided view), same bits."""
    return module_or_raise().rotary(x, cos, signed_sin)
