"""GGUF 4-bit groupwise weights and their forms for a 4-bit CPU kernel.

A single-stream decode step is bound by reading the weights; a 4-bit kernel reads a quarter of
what a bf16 GEMV reads, so it wins for a few rows, while a dense bf16 matmul wins for many (the
4-bit kernel's cost grows with the rows). `linear.QuantLinear` picks by row count between the
kernel and the same blocks' dequantized tiles (or, for torch's form, a dense copy); this module
only knows the weights.

Two kernels, in order of preference (`Q4Blocks.pack`):
- ours (`TiledQ4Weight`, engine/kernels/cpu_quant.py): the blocks' own fp16 scales and offsets
  (for fp32 activations, Q4_K's two-level factors too: kquant.py),
  bandwidth-bound on one core (~35 GB/s cold on the development machine, against ~16 for
  torch's); K a multiple of 64. bf16 activations need the extension built with AVX512-BF16;
  fp32 ones (the exact dequantized values, an fp32 model's decode) AVX2 + FMA + F16C.
- torch's int4pack kernel (`PackedInt4Weight`) everywhere else it applies (bf16 only).

torch's kernel's contract, found empirically on torch 2.13 CPU (tests/test_quant_linear.py pins it):

    packed = aten._convert_weight_to_int4pack_for_cpu(q, 1)  # q: int32 [N, K], codes 0..15
    y = aten._weight_int4pack_mm_for_cpu(x, packed, G, sz)   # x: contiguous 2-D [M, K]; y = x @ W.T

with `sz` ("scales_and_zeros") of shape [K // G, N, 2] and x's dtype; groups run along K (the input
dim, as GGUF blocks do). For output row n, input column k and g = k // G:

    W[n, k] = (q[n, k] - 8) * sz[g, n, 0] + sz[g, n, 1]

i.e. a code centred at 8 times the scale, plus an additive offset ("zero" is not an integer zero
point). Constraints: N % 16 == 0, G in {32, 64, 128, 256}, K % G == 0. The packed bytes are in an
opaque blocked layout, so fused weights are concatenated before packing, never after. fp32 inputs
are accepted but ~25x slower than bf16, so only bf16 models use this form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels import cpu_quant
from engine.layers.kquant import SuperScales

GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs N in blocks of 16 rows
CENTER = 8  # the kernel computes with (q - 8)


def torch_int4_kernel_available() -> bool:
    """Whether this torch build has the CPU int4pack kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def int4_kernel_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether some 4-bit CPU kernel for `dtype` activations is here: ours (vectorized build) or,
    for bf16, torch's int4pack."""
    if dtype == torch.float32:
        return cpu_quant.vectorized(torch.float32)
    return cpu_quant.vectorized() or torch_int4_kernel_available()


@dataclass
class Q4Blocks:
    """An unpacked 4-bit groupwise weight: W[n, k] = scale[n, g] * q[n, k] + offset[n, g], g = k // group_size.

    GGUF Q4_1 is exactly this (d, m); Q4_0 is d * (q - 8), i.e. offset = -8 * d; Q4_K (groups of
    32) scale = d * sc, offset = -(dmin * m), its factors kept in `k`. Rows are whole, so row
    permutations and concatenations apply to every array alike.
    """

    q: torch.Tensor  # uint8 [N, K], codes 0..15
    scale: torch.Tensor  # float32 [N, K // group_size]
    offset: torch.Tensor  # float32 [N, K // group_size]
    group_size: int
    k: SuperScales | None = None  # Q4_K's factors of scale and offset

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (for GGUF blocks: exactly gguf's own dequantization)."""
        n, k = self.q.shape
        groups = self.q.view(n, k // self.group_size, self.group_size).float()
        return (self.scale.unsqueeze(-1) * groups + self.offset.unsqueeze(-1)).view(n, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Q4Blocks:
        """The same weight with `fn` (a row permutation over dim 0) applied to every per-row array."""
        k = None if self.k is None else self.k.map_rows(fn)
        return Q4Blocks(fn(self.q), fn(self.scale), fn(self.offset), self.group_size, k)

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """Rows concatenated, as the fused q|k|v and gate|up weights are."""
        group, k = parts[0].group_size, parts[0].q.shape[1]
        if any(p.group_size != group or p.q.shape[1] != k for p in parts):
            raise ValueError("cannot fuse 4-bit weights with different group sizes or input dims")
        q = torch.cat([p.q for p in parts])
        k = SuperScales.cat([p.k for p in parts])
        return Q4Blocks(q, torch.cat([p.scale for p in parts]), torch.cat([p.offset for p in parts]), group, k)

    def pack(self, dtype: torch.dtype = torch.bfloat16) -> TiledQ4Weight | PackedInt4Weight | None:
        """The fastest kernel form this weight can take here for a model computing in `dtype`
        (see the module docstring), or None when no kernel can take it (the weight stays dense)."""
        k = self.q.shape[1]
        ours = dtype in (torch.float32, torch.bfloat16) and cpu_quant.vectorized(dtype)
        if self.k is not None and ours and k % cpu_quant.SUPER == 0:
            # the K form: fewer scale bytes than the fp16 one, and exact where fp16 is not
            f = self.k
            return TiledQ4Weight(cpu_quant.q4k_pack(self.q, f.sc, f.m, f.d, f.dmin))
        if cpu_quant.vectorized(dtype) and k % cpu_quant.CHUNK == 0 and self.group_size % cpu_quant.BLOCK == 0:
            per_block = self.group_size // cpu_quant.BLOCK  # our kernel scales every 32 weights
            scale, offset = (t.repeat_interleave(per_block, dim=1) for t in (self.scale, self.offset))
            if cpu_quant.exact_in_fp16(scale) and cpu_quant.exact_in_fp16(offset):
                return TiledQ4Weight(cpu_quant.q4_pack(self.q, scale, offset))
        return self.pack_torch() if dtype == torch.bfloat16 else None

    def pack_torch(self) -> PackedInt4Weight | None:
        """torch's int4pack form, or None when that kernel cannot take this shape."""
        n, k = self.q.shape
        shape_ok = n % ROW_MULTIPLE == 0 and self.group_size in GROUP_SIZES and k % self.group_size == 0
        if not (torch_int4_kernel_available() and shape_ok):
            return None
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32).contiguous(), 1)
        # scale*q + offset == (q - 8)*scale + (offset + 8*scale): computed in fp32, then one rounding to bf16.
        zero = self.offset + CENTER * self.scale
        scales_zeros = torch.stack([self.scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return PackedInt4Weight(packed, scales_zeros, self.group_size, n, k)


@dataclass
class TiledQ4Weight:
    """A 4-bit weight in our kernel's tiled layout (engine/kernels/cpu_quant.py; bf16 or fp32 inputs)."""

    tiles: cpu_quant.Q4Packed

    @property
    def out_features(self) -> int:
        return self.tiles.out_features

    @property
    def in_features(self) -> int:
        return self.tiles.in_features

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for a bf16 or fp32 x of shape [..., K]."""
        rows = x.numel() // self.in_features
        out = cpu_quant.q4_gemv(x.reshape(rows, self.in_features).contiguous(), self.tiles)
        return out.view(*x.shape[:-1], self.out_features)

    def tiles_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`matmul` for many rows: the weight's tiles dequantized one at a time (cpu_quant.q4_tiles_mm)."""
        rows = x.numel() // self.in_features
        out = cpu_quant.q4_tiles_mm(x.reshape(rows, self.in_features).contiguous(), self.tiles)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype`: the exact values rounded once."""
        t = self.tiles
        return cpu_quant.dequantize(t.codes, t.scales, t.offsets, t.out_features, dtype)


@dataclass
class PackedInt4Weight:
    """A weight in `_weight_int4pack_mm_for_cpu`'s form (bf16 activations only)."""

    packed: torch.Tensor  # uint8, opaque layout
    scales_zeros: torch.Tensor  # bf16 [K // group_size, N, 2]
    group_size: int
    out_features: int  # N
    in_features: int  # K

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for a bf16 x of shape [..., K]."""
        rows = x.numel() // self.in_features
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(rows, self.in_features).contiguous(), self.packed, self.group_size, self.scales_zeros
        )
        return out.view(*x.shape[:-1], self.out_features)
