"""Rotary position embedding.

Inverse frequencies come from transformers' own RoPE initialisers (default, linear, llama3, yarn,
longrope, ...), so every scaling type transformers supports for these models is computed the same
way. cos/sin are computed once per forward for the batch's positions (`cos_sin`), with the same op
order as transformers, which keeps fp32 greedy outputs token-identical; each layer then rotates
its q|k slab (`forward`): in the fused C++ op for bf16 on a CPU whose kernels built (head size a
multiple of 32; bit-identical to the torch ops), else in torch ops. The choice is made at
construction, from the model's device and dtype.

Two variants, both in torch ops: partial rotary (`partial_rotary_factor`, Phi-3/Phi-4-mini: only
each head's first `rotary_dim` channels turn, the rest pass through, as transformers' Phi-3 does)
and `fp32_tables` (OLMo 2: cos/sin stay fp32, so the rotation is computed in fp32 and rounded
once to the model dtype; identical to the other form in fp32).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.kernels import cpu_elementwise

log = logging.getLogger(__name__)


def _rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in params:  # older-style configs
        params = dict(params, rope_theta=getattr(config, "rope_theta", 10000.0))
    return params


def _partial_rotary_factor(config: PretrainedConfig, params: dict) -> float:
    return float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))


class RotaryEmbedding(nn.Module):
    """RoPE tables for a forward's positions, and the rotation of each layer's q|k heads."""

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        fp32_tables: bool = False,
        layer_type: str | None = None,
    ) -> None:
        """`layer_type` (Gemma 3): the RoPE of that layer type, `rope_parameters[layer_type]`."""
        super().__init__()
        params = _rope_parameters(config) if layer_type is None else config.rope_parameters[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params["rope_theta"]
            dim = int(head_dim * _partial_rotary_factor(config, params))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            if rope_type == "dynamic":
                log.warning("dynamic RoPE: using the base frequencies (exact up to the original max length)")
            kw = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device, **kw)
        # fp32 whatever the model dtype; a plain attribute, not a buffer, so no cast ever reaches it
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float)
        self.device, self.dtype = torch.device(device), dtype  # the model's: layers built beside it use them
        self.rotary_dim = 2 * self.inv_freq.numel()  # head_dim, or its rotated part (partial rotary)
        self.table_dtype = torch.float if fp32_tables else dtype
        plain = self.rotary_dim == head_dim and not fp32_tables
        self.uses_cpu_kernel = (
            plain
            and head_dim % cpu_elementwise.ROTARY_HEAD_DIM_MULTIPLE == 0
            and cpu_elementwise.available(device, dtype)
        )
        if self.uses_cpu_kernel:
            self._rotate = cpu_elementwise.rotary
        elif self.rotary_dim != head_dim:
            self._rotate = self._rotate_partial
        else:
            self._rotate = apply_rotary if not fp32_tables else _apply_rotary_cast

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin in the model dtype (fp32 with `fp32_tables`), each [num_tokens,
        rotary_dim], for flat token positions.

        The sin's first half is negated here, once per forward, so `apply_rotary` needs no `neg`
        per layer: (-x2) * s == x2 * (-s) exactly, so results keep transformers' bits.
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return cos.to(self.table_dtype), sin.to(self.table_dtype)

    def _rotate_partial(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """transformers' Phi-3: rotate the first `rotary_dim` channels of each head, pass the rest."""
        d = self.rotary_dim
        return torch.cat((_apply_rotary_cast(x[..., :d], cos, signed_sin), x[..., d:]), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`x` [num_tokens, heads, head_dim] (rows of head_dim contiguous) rotated: a new tensor."""
        return self._rotate(x, cos, signed_sin)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos/signed_sin from `cos_sin`: [num_tokens, head_dim].

    transformers' x*cos + rotate_half(x)*sin with rotate_half(x) = (-x2, x1), computed as
    x*cos + (x2, x1)*signed_sin.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + swapped * signed_sin.unsqueeze(1)


def _apply_rotary_cast(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in the tables' dtype, cast back to x's (OLMo 2's fp32 tables; a no-op cast else)."""
    return apply_rotary(x, cos, signed_sin).to(x.dtype)
