"""GGUF 8-bit (Q8_0) and 6-bit (Q6_K) weights and their forms for our small-batch CPU kernel.

The LM head of a small model is the largest single read of a decode step (SmolLM2-135M: 49152 x
576, 56.6 MB in bf16, 43% of a bs-1 step's bytes). GGUF files usually store it, tied to the
embedding, as Q8_0: 32 int8 codes and one fp16 scale per block, 30 MB. Our kernel
(engine/kernels/cpu_quant.py) reads those blocks as they are, so a few rows of logits cost about
half the bytes, computed from the file's exact values (the bf16 table rounds each d * q to 8
significant bits; this form does not). In an fp32 model the dense head holds 4 bytes a weight,
so the blocks are a quarter of its read. `linear.QuantLinear` uses it for up to a measured number
of rows and the same blocks' dequantized tiles beyond.

Q6_K (the LM head of llama.cpp's Q4_K_M, Q5_K_M and Q6_K files, and some of their layers' v and
down projections) runs in the same loops: its 6-bit codes widened to int8 (q - 32), scaled per 16
weights by an int8 factor times an fp16 one per 256 (kquant.py), 8.6 bits a weight instead of the
dense fp32 head's 32. Q5_K (Q5_K_M's layers) likewise: 5-bit codes as int8 with Q4_K's factored
scale and offset per 32 weights, 8.75 bits. Q5_0 (codes q - 16, an fp16 d per 32) is Q8_0's form
as it is. These forms run the fp32 loops, for bf16 models too (x widened, the result rounded
once), except Q6_K and Q5_K in a bf16 model on a CPU with AVX512-BF16: their codes are kept in
lane order at their file's 6 or 5 bits a weight for the bf16 dot-product loops
(csrc/cpu_quant_lanes.cpp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels import cpu_quant
from engine.layers.kquant import SuperScales

Q6_GROUP = 16  # weights per Q6_K scale


@dataclass
class Q8Blocks:
    """W[n, k] = scale[n, g] * q[n, k] (+ offset[n, g]), g = k // group_size: GGUF Q8_0 (groups of
    32) and Q5_0 (codes q - 16); Q6_K (groups of 16, codes q - 32, scale = d * sc with the factors
    in `k`); Q5_K (groups of 32, codes 0..31, scale and offset factored as Q4_K's), unpacked."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K // group_size]
    group_size: int = cpu_quant.BLOCK
    k: SuperScales | None = None  # Q6_K's / Q5_K's factors of scale (and offset)
    offset: torch.Tensor | None = None  # float32 [N, K // group_size]: Q5_K's -(dmin * m)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (exactly gguf's own dequantization)."""
        n, k = self.q.shape
        g = self.group_size
        w = self.q.float().view(n, k // g, g) * self.scale.unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.view(n, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Q8Blocks:
        """The same weight with `fn` (a row permutation over dim 0) applied to every per-row array."""
        k = None if self.k is None else self.k.map_rows(fn)
        offset = None if self.offset is None else fn(self.offset)
        return Q8Blocks(fn(self.q), fn(self.scale), self.group_size, k, offset)

    @staticmethod
    def cat(parts: list[Q8Blocks]) -> Q8Blocks:
        """Rows concatenated, as the fused q|k|v and gate|up weights are (blocks of one kind)."""
        first = parts[0]
        if any(p.group_size != first.group_size or (p.offset is None) != (first.offset is None) for p in parts):
            raise ValueError("cannot fuse 8-bit weights of different group sizes or offsets")
        k = SuperScales.cat([p.k for p in parts])
        offsets = [p.offset for p in parts if p.offset is not None]
        offset = torch.cat(offsets) if offsets else None
        q, scale = torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts])
        return Q8Blocks(q, scale, first.group_size, k, offset)

    def pack(self, dtype: torch.dtype = torch.bfloat16) -> Q8Weight | None:
        """Our kernel's form for a model computing in `dtype`, or None where it does not apply (no
        vectorized build for that dtype, K not a multiple of 64 (Q6_K, Q5_K: 256), scales not
        fp16). Q6_K and Q5_K in a bf16 model on a CPU with AVX512-BF16 keep their codes in lane
        order for the bf16 dot-product loops; every other form runs the fp32 loops (a bf16 x
        widened, the result rounded once)."""
        k = self.q.shape[1]
        if self.k is not None:
            lanes = dtype == torch.bfloat16 and cpu_quant.vectorized(torch.bfloat16)
            fp32_loops = dtype in (torch.float32, torch.bfloat16) and cpu_quant.vectorized(torch.float32)
            if not (lanes or fp32_loops) or k % cpu_quant.SUPER:
                return None
            f = self.k
            q5 = f.m is not None and f.dmin is not None
            kind = cpu_quant.Q5_K if q5 else cpu_quant.Q6_K
            codes = cpu_quant.q8_lanes_pack(self.q, kind) if lanes else self.q.contiguous()
            if q5:
                small = torch.stack([f.sc, f.m], dim=1).to(torch.uint8).contiguous()
                big = torch.stack([f.d, f.dmin], dim=1).float().contiguous()
                return Q8Weight(codes, small, big)
            return Q8Weight(codes, f.sc.to(torch.int8).contiguous(), f.d.float().contiguous())
        # Q8_0 (and Q5_0) in a bf16 model only where the bf16 block loops are built, as before (its
        # x goes through the fp32 loops; elsewhere the model keeps the dense form)
        if not (cpu_quant.vectorized(dtype) and k % cpu_quant.CHUNK == 0):
            return None
        if self.group_size != cpu_quant.BLOCK or not cpu_quant.exact_in_fp16(self.scale):
            return None
        return Q8Weight(self.q.contiguous(), self.scale.to(torch.float16).contiguous())


@dataclass
class Q8Weight:
    """Q8_0 blocks as our kernel reads them: int8 codes [N, K], fp16 scales [N, K // 32]; Q6_K's:
    int8 scales [N, K // 16] and `supers`, d [N, K // 256] (fp16 values, held in fp32); Q5_K's:
    uint8 scales [N, 2, K // 32] (sc, m), supers [N, 2, K // 256] (d, dmin). Q6_K's and Q5_K's
    codes are packed uint8 in lane order (6 or 5 bits a weight) where a bf16 model runs the bf16
    loops (cpu_quant.q8_lanes_pack)."""

    codes: torch.Tensor
    scales: torch.Tensor
    supers: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        if self.codes.dtype == torch.uint8:  # lane order: 6 or 5 bits a weight; K from the scales
            return self.scales.shape[-1] * (Q6_GROUP if self.scales.dtype == torch.int8 else cpu_quant.BLOCK)
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.supers is None else self.supers.nbytes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for a bf16 x of shape [..., K], or an fp32 one (codes in natural order)."""
        rows = x.numel() // self.in_features
        out = cpu_quant.q8_gemv(x.reshape(rows, self.in_features).contiguous(), self.codes, self.scales, self.supers)
        return out.view(*x.shape[:-1], self.out_features)

    def tiles_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`matmul` for many rows: the weight's tiles dequantized one at a time (cpu_quant.q8_tiles_mm)."""
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features).contiguous()
        out = cpu_quant.q8_tiles_mm(x2, self.codes, self.scales, self.supers)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype`: the exact values rounded once, in natural order."""
        return cpu_quant.dequantize(self.codes, self.scales, self.supers, self.out_features, dtype)
