"""4-bit groupwise linear weights on CPU: torch's int4pack kernel for a few rows, dense otherwise.

A single-stream decode step is bound by reading the weights; torch's CPU int4 kernel reads a
quarter of what a bf16 GEMV reads, so it wins for a few rows; with more rows a dense bf16 matmul
wins (it becomes compute-bound and the int4 kernel's cost grows with the rows: SmolLM2-135M's
decode step breaks even near 16-20 rows on a 2-core CPU). So a layer keeps both: the dense weight
for prefill and large batches, the packed one for small ones (ServerArgs.q4_max_tokens).

The kernel's contract, found empirically on torch 2.13 CPU (tests/test_quant_linear.py pins it):

    packed = aten._convert_weight_to_int4pack_for_cpu(q, 1)  # q: int32 [N, K], codes 0..15
    y = aten._weight_int4pack_mm_for_cpu(x, packed, G, sz)   # x: contiguous 2-D [M, K]; y = x @ W.T

with `sz` ("scales_and_zeros") of shape [K // G, N, 2] and x's dtype; groups run along K (the input
dim, as GGUF blocks do). For output row n, input column k and g = k // G:

    W[n, k] = (q[n, k] - 8) * sz[g, n, 0] + sz[g, n, 1]

i.e. a code centred at 8 times the scale, plus an additive offset ("zero" is not an integer zero
point). Constraints: N % 16 == 0, G in {32, 64, 128, 256}, K % G == 0. The packed bytes are in an
opaque blocked layout, so fused weights are concatenated before packing, never after. fp32 inputs
are accepted but ~25x slower than bf16, so only bf16 activations take this path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs N in blocks of 16 rows
_CENTER = 8  # the kernel computes with (q - 8)


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


@dataclass
class Q4Blocks:
    """An unpacked 4-bit groupwise weight: W[n, k] = scale[n, g] * q[n, k] + offset[n, g], g = k // group_size.

    GGUF Q4_1 is exactly this (d, m); Q4_0 is d * (q - 8), i.e. offset = -8 * d. Rows are whole,
    so row permutations and concatenations apply to q, scale and offset alike.
    """

    q: torch.Tensor  # uint8 [N, K], codes 0..15
    scale: torch.Tensor  # float32 [N, K // group_size]
    offset: torch.Tensor  # float32 [N, K // group_size]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (for GGUF blocks: exactly gguf's own dequantization)."""
        n, k = self.q.shape
        groups = self.q.view(n, k // self.group_size, self.group_size).float()
        return (self.scale.unsqueeze(-1) * groups + self.offset.unsqueeze(-1)).view(n, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Q4Blocks:
        """The same weight with `fn` (a row permutation over dim 0) applied to every per-row array."""
        return Q4Blocks(fn(self.q), fn(self.scale), fn(self.offset), self.group_size)

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """Rows concatenated, as the fused q|k|v and gate|up weights are."""
        group, k = parts[0].group_size, parts[0].q.shape[1]
        if any(p.group_size != group or p.q.shape[1] != k for p in parts):
            raise ValueError("cannot fuse 4-bit weights with different group sizes or input dims")
        return Q4Blocks(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]), group,
        )  # fmt: skip

    def pack(self, max_rows: int) -> PackedInt4Weight | None:
        """The kernel's form, or None when the kernel cannot take this shape (then dense is used)."""
        n, k = self.q.shape
        if not (int4_kernel_available() and n % _ROW_MULTIPLE == 0 and self.group_size in _GROUP_SIZES
                and k % self.group_size == 0):  # fmt: skip
            return None
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32).contiguous(), 1)
        # scale*q + offset == (q - 8)*scale + (offset + 8*scale): computed in fp32, then one rounding to bf16.
        zero = self.offset + _CENTER * self.scale
        scales_zeros = torch.stack([self.scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return PackedInt4Weight(packed, scales_zeros, self.group_size, n, k, max_rows)


@dataclass
class PackedInt4Weight:
    """A weight in `_weight_int4pack_mm_for_cpu`'s form, used for inputs of at most `max_rows` rows."""

    packed: torch.Tensor  # uint8, opaque layout
    scales_zeros: torch.Tensor  # bf16 [K // group_size, N, 2]
    group_size: int
    out_features: int  # N
    in_features: int  # K
    max_rows: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for a bf16 x of shape [..., K]."""
        rows = x.numel() // self.in_features
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(rows, self.in_features).contiguous(), self.packed, self.group_size, self.scales_zeros
        )
        return out.view(*x.shape[:-1], self.out_features)


def onednn_prepack_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@dataclass
class OneDNNWeight:
    """A dense bf16 weight reordered once into oneDNN's blocked layout (what inductor's CPU
    freezing does). `F.linear` in bf16 runs the same oneDNN kernel but reorders the weight on
    every call; prepacked, a decode step's matmuls take 15-45% less time (measured on the 2-core
    CPU, batch 1 to 64) with bit-identical results. bf16 only: fp32 `F.linear` uses another BLAS,
    whose summation order differs, and fp32 is the reference path."""

    packed: torch.Tensor  # opaque mkldnn tensor
    in_features: int

    @classmethod
    def from_dense(cls, weight: torch.Tensor, rows_hint: int = 32) -> OneDNNWeight | None:
        if not (onednn_prepack_available() and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"):
            return None
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint), weight.shape[1])

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [None], "")


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedInt4Weight | None,
    onednn: OneDNNWeight | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias): through the packed 4-bit kernel when there is one and x is a few
    bf16 rows, else through the prepacked oneDNN weight when there is one, else plain."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        rows = x.numel() // weight.shape[1]
        if packed is not None and 0 < rows <= packed.max_rows:
            out = packed.matmul(x)
            return out if bias is None else out + bias
        if onednn is not None and rows > 0:
            return onednn.matmul(x, bias)
    return F.linear(x, weight, bias)
