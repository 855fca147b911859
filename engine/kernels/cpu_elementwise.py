"""Fused bf16 elementwise ops of a decoder layer on CPUs (csrc/cpu_elementwise.cpp).

RMSNorm (alone or after the residual add), SiLU(gate) * up and rotary embedding, each one pass over
memory instead of torch's seven, two and four ops (rotary's result is bit-identical to torch's);
Gemma's (1 + w) RMSNorm, its sandwich step (`add_unit_norm_`) and GELU-tanh(gate) * up.
They round like transformers' bf16 op order, but sum squares in another order, so a value can
differ from torch's by one bf16 rounding step: they are used for bf16 only; fp32 keeps the torch
ops, whose greedy output is token-identical to transformers'. The layers (engine/layers/norm.py,
activation.py, rotary.py) choose them once, at construction.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu_extension import load, module_or_raise

__all__ = [
    "ROTARY_HEAD_DIM_MULTIPLE",
    "WIDTH_MULTIPLE",
    "add_rms_norm_",
    "add_unit_norm_",
    "argmax_rows",
    "available",
    "gelu_tanh_mul",
    "load",
    "rms_norm",
    "rms_norm_heads",
    "rms_norm_unit_offset",
    "rotary",
    "silu_mul",
    "supports",
]

# Shapes the kernels take: normalised rows and silu_mul's halves a multiple of 16 wide (the bf16
# vector width), rotary's head size a multiple of 32 (two halves of whole vectors).
WIDTH_MULTIPLE = 16
ROTARY_HEAD_DIM_MULTIPLE = 32


def supports(x: torch.Tensor) -> bool:
    """Whether the fused ops take this activation (CPU bf16, last dim a multiple of 16)."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[-1] % WIDTH_MULTIPLE == 0


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on this device and dtype can use the fused ops: CPU, bf16, the extension
    built (`ASYNCLLM_CPU_KERNELS=0` or a failed build: no). Each op adds its own shape condition."""
    return device.type == "cpu" and dtype == torch.bfloat16 and load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * bf16(x * rsqrt(mean(x^2) + eps))` over the last dim of a bf16 `[T, N]` x."""
    return module_or_raise().rms_norm(x.contiguous(), weight, eps)


def add_rms_norm_(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x += y` in place (bf16, the residual stream), then returns `rms_norm(x)`."""
    return module_or_raise().add_rms_norm_(x, y.contiguous(), weight, eps)


def rms_norm_heads(x: torch.Tensor, table: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """Each head of `x` `[T, NH, D]` (heads packed, any token stride) normalised as `rms_norm`
    (`unit_offset`: as `rms_norm_unit_offset`) with its own weight row `table[h]` `[NH, D]`: the
    q and k norms of Qwen3 (Gemma 3) on the q|k slab in one call. A new contiguous tensor."""
    return module_or_raise().rms_norm_heads(x, table, eps, unit_offset)


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, `bf16(x * rsqrt(mean(x^2) + eps) * (1 + weight))` (the scale in fp32, one
    rounding), over the last dim of a bf16 `[T, N]` x."""
    return module_or_raise().rms_norm_unit_offset(x.contiguous(), weight, eps)


def add_unit_norm_(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Gemma's sandwich step: `x += rms_norm_unit_offset(y, weight)` in place (bf16, the residual
    stream), then returns `rms_norm_unit_offset(x, next_weight)`, or x when `next_weight` is None."""
    return module_or_raise().add_unit_norm_(x, y.contiguous(), weight, next_weight, eps)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gelu(gate, approximate="tanh") * up` of a bf16 `[T, 2I]` gate|up slab (gate first), as `[T, I]`."""
    return module_or_raise().gelu_tanh_mul(gate_up.contiguous())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a bf16 `[T, 2I]` gate|up slab (gate first), as `[T, I]`."""
    return module_or_raise().silu_mul(gate_up.contiguous())


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of contiguous bf16 or fp32 `[B, V]` rows (csrc/cpu_argmax.cpp): read in
    place, vectorized; torch's bf16 argmax is a scalar loop. Same indices, NaN and ties included."""
    return module_or_raise().argmax_rows(x)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`layers.rotary.apply_rotary` for bf16 `[T, NH, D]` heads (rows may be a strided view), same bits."""
    return module_or_raise().rotary(x, cos, signed_sin)
