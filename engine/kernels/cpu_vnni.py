"""bf16 weights resident in VNNI pairs, one form for every row count (csrc/cpu_vnni_linear.cpp).

A bf16 model's dense projections on a CPU with AVX512-BF16 and no AMX keep their weight in this
layout only (engine/layers/linear.py `VnniLinear`): a decode step of a few rows streams it at the
memory's rate (oneDNN's prepacked product read its own layout at 26-37 GB/s where this reads
46-52 on a 2-core Zen 4, docs/PERFORMANCE.md) and a prefill's GEMM runs on it at oneDNN's rate,
with no second copy. Each output is one fixed-order fp32 sum rounded once, so a row's result is
the same bits whatever the batch (deterministic inference needs no row tiles over it).

Layout: W [N, K] as `[ceil(N / 64), K / 2, 64, 2]`: blocks of 64 output columns, each block the
pairs of K in order, each pair's 64 columns side by side (zeros past N). K must be even.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu_extension import load, module_or_raise

__all__ = ["BLOCK", "available", "available_for", "linear", "pack", "unpack"]

BLOCK = 64  # output columns per block


def available() -> bool:
    """Whether the kernel is built here and is the bf16 dense form (AVX512-BF16, no AMX: where
    oneDNN has AMX its prepacked GEMM outruns this kernel at prefill sizes, and stays)."""
    module = load()
    return module is not None and bool(module.vnni_linear_built())


def available_for(weight: torch.Tensor) -> bool:
    """Whether `weight` (`[N, K]`) can live in this layout: bf16 on a CPU, K even, the kernel here."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and available()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[N, K]` in the layout above (exact: a permutation of its values and zeros)."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = weight.detach().new_zeros(blocks * BLOCK, k)
    padded[:n] = weight.detach()
    return padded.view(blocks, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The plain `[n, K]` weight back from `pack`'s layout (exact)."""
    blocks, pairs = packed.shape[0], packed.shape[1]
    return packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK, pairs * 2)[:n].contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """`F.linear(x, W, bias)` for a bf16 `x` `[M, K]` and `packed = pack(W)`, `W` `[n, K]`."""
    return module_or_raise().vnni_linear(x, packed, bias, n)
