"""Small-batch products with block-quantized weights on CPUs (csrc/cpu_quant_gemv.cpp for bf16
activations, csrc/cpu_quant_gemv_f32.cpp for fp32 ones).

`y = x @ W.T` for an x of a few rows, W kept in a GGUF file's own blocks: 4-bit
(Q4_0/Q4_1: code, fp16 scale and offset per 32 weights) or 8-bit (Q8_0: int8 code, fp16 scale).
A decode step of a small model reads each weight once, so its time is the bytes it reads over the
memory bandwidth; these loops unpack so cheaply that the read is (nearly) the bound (torch's
int4pack kernel is compute-bound at ~40% of one core's bandwidth on the development machine, and
takes bf16 only).

Any row count works. x's dtype picks the loops: bf16 x (output bf16) or fp32 x (output fp32, the
weights' exact values with fp32 sums of the loop's own order; each row's result independent of
the other rows and the thread count). The layers use a dtype's products only where its vector
loops were compiled (`vectorized(dtype)`: bf16 needs AVX512-BF16, -BW and -VL; fp32 needs AVX2,
FMA and F16C, or AVX-512F); elsewhere the int4 layers keep torch's int4pack kernel (bf16) or run
dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.cpu_extension import load, module_or_raise

__all__ = ["BLOCK", "CHUNK", "TILE", "Q4Packed", "exact_in_fp16", "q4_gemv", "q4_pack", "q8_gemv", "vectorized"]

BLOCK = 32  # weights per scale
CHUNK = 64  # weights per 32 packed bytes: K must be a multiple of this
TILE = 16  # 4-bit rows per tile (one per fp32 lane)


def vectorized(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the extension is built and runs these products for `dtype` activations (bf16 or
    fp32) with vector instructions here."""
    module = load()
    if module is None:
        return False
    if dtype == torch.float32:
        return bool(module.quant_gemv_f32_vectorized())
    return dtype == torch.bfloat16 and bool(module.quant_gemv_vectorized())


def exact_in_fp16(t: torch.Tensor) -> bool:
    """Whether every value of `t` is an fp16 number (the kernels keep scales and offsets in fp16)."""
    return bool(torch.equal(t.to(torch.float16).float(), t.float()))


@dataclass(frozen=True)
class Q4Packed:
    """A 4-bit weight in the kernel's layout (csrc/cpu_quant_gemv.cpp): rows in tiles of TILE,
    codes uint8 [T, K/32, 8, 32], fp16 scales and offsets [T, K/32, TILE]."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int  # N (the last tile's rows past N are zero padding)
    in_features: int  # K

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes


def q4_pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Q4Packed:
    """W[n, k] = scale[n, k/32] * q[n, k] + offset[n, k/32] (q: codes 0..15 [N, K]; scale and
    offset exactly representable in fp16, as a GGUF file's are) -> the kernel's layout."""
    n, k = q.shape
    if k % CHUNK:
        raise ValueError(f"4-bit rows must be a multiple of {CHUNK} wide, got {k}")
    tiles, nb = -(-n // TILE), k // BLOCK
    pad = tiles * TILE - n
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad))
    # [T, 16 rows, nb, 2 halves of the pairs, 8 pairs, 2] -> [T, nb, 8 pairs, 2 halves, 16 rows, 2]
    q = q.view(tiles, TILE, nb, 2, 8, 2).permute(0, 2, 4, 3, 1, 5)
    codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(tiles, nb, 8, 2 * TILE).contiguous()

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        if not exact_in_fp16(t):
            raise ValueError("4-bit scales and offsets must be exact in fp16")
        half = torch.nn.functional.pad(t.to(torch.float16), (0, 0, 0, pad))
        return half.view(tiles, TILE, nb).transpose(1, 2).contiguous()

    return Q4Packed(codes, per_tile(scale), per_tile(offset), n, k)


def q4_gemv(x: torch.Tensor, w: Q4Packed, vector: bool = True) -> torch.Tensor:
    """bf16 or fp32 `[M, K] @ W.T` -> `[M, N]` of x's dtype. `vector=False` runs the plain loops
    (the tests' reference; for fp32 the same sums in the same order, so equal to the bit)."""
    module = module_or_raise()
    fn = module.q4_gemv_f32 if x.dtype == torch.float32 else module.q4_gemv
    return fn(x, w.codes, w.scales, w.offsets, w.out_features, vector)


def q8_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, vector: bool = True) -> torch.Tensor:
    """bf16 or fp32 `[M, K] @ W.T` -> `[M, N]` of x's dtype, W[n, k] = scales[n, k/32] * codes[n, k]
    (Q8_0). `vector=False` runs the plain loops (the tests' reference)."""
    module = module_or_raise()
    fn = module.q8_gemv_f32 if x.dtype == torch.float32 else module.q8_gemv
    return fn(x, codes, scales, vector)
