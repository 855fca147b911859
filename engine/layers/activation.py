"""Gated activations of the MLP (`act(gate) * up` over a fused gate|up slab), as modules whose
implementation is fixed at construction.

`SiluAndMul` runs the fused C++ op (kernels/cpu_elementwise.py: one pass instead of two ops) for
bf16 on a CPU whose kernels built when the intermediate size is a multiple of 16; the torch form
(`F.silu(gate) * up`, transformers' ops) otherwise, including fp32, whose parity with
transformers is tested token for token. `GeluAndMul`'s tanh form (Gemma's GeGLU) likewise; the
exact (erf) GELU has no fused form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_elementwise


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """`silu(gate) * up` of a `[T, 2I]` gate|up slab (gate first), as `[T, I]`."""

    def __init__(self, intermediate_size: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.uses_cpu_kernel = _fused_applies(intermediate_size, device, dtype)
        self._act: Callable[[torch.Tensor], torch.Tensor] = (
            cpu_elementwise.silu_mul if self.uses_cpu_kernel else silu_and_mul
        )

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act(gate_up)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


def _fused_applies(intermediate_size: int, device: torch.device, dtype: torch.dtype) -> bool:
    return intermediate_size % cpu_elementwise.WIDTH_MULTIPLE == 0 and cpu_elementwise.available(device, dtype)


class GeluAndMul(nn.Module):
    """`gelu(gate) * up` (`approximate`: "none" or "tanh", as `F.gelu`)."""

    def __init__(
        self,
        approximate: str,
        intermediate_size: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.approximate = approximate
        fused = approximate == "tanh" and device is not None and dtype is not None
        self.uses_cpu_kernel = fused and _fused_applies(intermediate_size, device, dtype)  # type: ignore[arg-type]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.uses_cpu_kernel:
            return cpu_elementwise.gelu_tanh_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


def get_act_and_mul(hidden_act: str, intermediate_size: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The gated activation module for a config's `hidden_act`."""
    if hidden_act == "silu":
        return SiluAndMul(intermediate_size, device, dtype)
    if hidden_act == "gelu":
        return GeluAndMul("none")
    if hidden_act == "gelu_pytorch_tanh":
        return GeluAndMul("tanh", intermediate_size, device, dtype)
    raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: silu, gelu, gelu_pytorch_tanh")
