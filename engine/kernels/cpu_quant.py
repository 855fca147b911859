"""Small-batch products with block-quantized weights on CPUs (csrc/cpu_quant_gemv.cpp for bf16
activations, csrc/cpu_quant_gemv_f32.cpp for fp32 ones).

`y = x @ W.T` for an x of a few rows, W kept in a GGUF file's own blocks: 4-bit
(Q4_0/Q4_1: code, fp16 scale and offset per 32 weights; Q4_K: the same codes, each scale and
offset a 6-bit factor per 32 weights times an fp16 one per 256) or 8-bit (Q8_0: int8 code, fp16
scale; Q6_K's 6-bit codes as int8, an int8 factor per 16 weights times a d per 256; Q5_K's 5-bit
codes as int8 with Q4_K's factored scale and offset). The 8-bit forms run fp32 loops over their
codes in natural order, for a bf16 x too (widened, the result rounded to bf16 once); Q6_K and Q5_K
also have bf16 dot-product loops over their codes in lane order (`q8_lanes_pack`,
csrc/cpu_quant_lanes.cpp), which bf16 models take on CPUs with AVX512-BF16.
A decode step of a small model reads each weight once, so its time is the bytes it reads over the
memory bandwidth; these loops unpack so cheaply that the read is (nearly) the bound (torch's
int4pack kernel is compute-bound at ~40% of one core's bandwidth on the development machine, and
takes bf16 only).

Past a few dozen rows a GEMM wins: `q4_tiles_mm` and `q8_tiles_mm` run those products through
tiles of the weight dequantized one at a time (csrc/cpu_quant_tiles.cpp), so the blocks are a
projection's only resident form.

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

__all__ = [
    "BLOCK",
    "CHUNK",
    "Q5_K",
    "Q6_K",
    "SUPER",
    "TILE",
    "Q4Packed",
    "dequantize",
    "exact_in_fp16",
    "int8_activations",
    "q4_gemv",
    "q4_pack",
    "q4_tiles_mm",
    "q4k_pack",
    "q8_gemv",
    "q8_lanes_pack",
    "q8_tiles_mm",
    "set_int8_activations",
    "vectorized",
]

BLOCK = 32  # weights per scale
CHUNK = 64  # weights per 32 packed bytes: K must be a multiple of this
TILE = 16  # 4-bit rows per tile (one per fp32 lane)
SUPER = 256  # weights per fp16 factor of the K forms (llama.cpp's QK_K)


def vectorized(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the extension is built and runs these products for `dtype` activations (bf16 or
    fp32) with vector instructions here."""
    module = load()
    if module is None:
        return False
    if dtype == torch.float32:
        return bool(module.quant_gemv_f32_vectorized())
    return dtype == torch.bfloat16 and bool(module.quant_gemv_vectorized())


def set_int8_activations(on: bool) -> None:
    """--q4-int8-activations, process-wide: whether `q4_gemv` reads a bf16 x in int8 blocks (VNNI
    dot products, as llama.cpp; faster, ~5x bf16's rounding of x) or exactly (the default)."""
    module = load()
    if module is not None:
        module.set_q4_int8_activations(bool(on))


def int8_activations() -> bool:
    """The `set_int8_activations` setting in force (False where the extension is not built)."""
    module = load()
    return module is not None and bool(module.q4_int8_activations())


def exact_in_fp16(t: torch.Tensor) -> bool:
    """Whether every value of `t` is an fp16 number (the kernels keep scales and offsets in fp16)."""
    return bool(torch.equal(t.to(torch.float16).float(), t.float()))


@dataclass(frozen=True)
class Q4Packed:
    """A 4-bit weight in the kernel's layout (csrc/cpu_quant_gemv.cpp): rows in tiles of TILE,
    codes uint8 [T, K/32, 8, 32], fp16 scales and offsets [T, K/32, TILE]; or in the K form
    (`q4k_pack`): `scales` uint8 [T, K/32, 2, TILE] (each block's sc and m),
    `offsets` fp16 [T, K/256, 2, TILE] (each 256 weights' d and dmin)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int  # N (the last tile's rows past N are zero padding)
    in_features: int  # K

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes

    @property
    def k_form(self) -> bool:
        return self.scales.dtype == torch.uint8


def _tile_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [N, K] -> the tiles' bytes [T, K/32, 8, 32] (rows past N zero)."""
    n, k = q.shape
    if k % CHUNK:
        raise ValueError(f"4-bit rows must be a multiple of {CHUNK} wide, got {k}")
    tiles, nb = -(-n // TILE), k // BLOCK
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, tiles * TILE - n))
    # [T, 16 rows, nb, 2 halves of the pairs, 8 pairs, 2] -> [T, nb, 8 pairs, 2 halves, 16 rows, 2]
    q = q.view(tiles, TILE, nb, 2, 8, 2).permute(0, 2, 4, 3, 1, 5)
    return (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(tiles, nb, 8, 2 * TILE).contiguous()


def _per_tile(t: torch.Tensor) -> torch.Tensor:
    """A per-row array [N, G] -> [T, G, TILE] (each tile's rows side by side, zero padding)."""
    n, g = t.shape
    tiles = -(-n // TILE)
    return torch.nn.functional.pad(t, (0, 0, 0, tiles * TILE - n)).view(tiles, TILE, g).transpose(1, 2).contiguous()


def _exact_half(t: torch.Tensor, what: str) -> torch.Tensor:
    if not exact_in_fp16(t):
        raise ValueError(f"{what} must be exact in fp16")
    return t.to(torch.float16)


def q4_pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Q4Packed:
    """W[n, k] = scale[n, k/32] * q[n, k] + offset[n, k/32] (q: codes 0..15 [N, K]; scale and
    offset exactly representable in fp16, as a GGUF file's are) -> the kernel's layout."""
    n, k = q.shape
    codes = _tile_codes(q)
    scales, offsets = (_per_tile(_exact_half(t, "4-bit scales and offsets")) for t in (scale, offset))
    return Q4Packed(codes, scales, offsets, n, k)


def q4k_pack(q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> Q4Packed:
    """W[n, k] = d[n, k/256] * sc[n, k/32] * q[n, k] - dmin[n, k/256] * m[n, k/32] (GGUF Q4_K: q
    codes 0..15 [N, K], sc and m 0..63 [N, K/32], d and dmin fp16 values [N, K/256]) -> the
    kernel's K form (bf16 and fp32 inputs)."""
    n, k = q.shape
    if k % SUPER:
        raise ValueError(f"K-form rows must be a multiple of {SUPER} wide, got {k}")
    codes = _tile_codes(q)
    small = torch.stack([_per_tile(t.to(torch.uint8)) for t in (sc, m)], dim=2).contiguous()
    big = torch.stack([_per_tile(_exact_half(t, "Q4_K's d and dmin")) for t in (d, dmin)], dim=2).contiguous()
    return Q4Packed(codes, small, big, n, k)


def q4_gemv(x: torch.Tensor, w: Q4Packed, vector: bool = True) -> torch.Tensor:
    """bf16 or fp32 `[M, K] @ W.T` -> `[M, N]` of x's dtype. `vector=False` runs the plain loops
    (the tests' reference; for fp32 the same sums in the same order, so equal to the bit)."""
    module = module_or_raise()
    fn = module.q4_gemv_f32 if x.dtype == torch.float32 else module.q4_gemv
    return fn(x, w.codes, w.scales, w.offsets, w.out_features, vector)


Q6_K, Q5_K = 0, 1  # the kinds' numbers in csrc/cpu_quant_lanes.cpp


def q8_lanes_pack(codes: torch.Tensor, kind: int) -> torch.Tensor:
    """int8 codes [N, K] of Q6_K (q - 32) or Q5_K (0..31) -> the bf16 loops' form: codes u = q + 32
    or q, each 256 weights in lane order at 6 or 5 bits a weight, uint8 [N, K / 256 * (192 or 160)]
    (csrc/cpu_quant_lanes.cpp). K: a multiple of 256."""
    return module_or_raise().q8_lanes_pack(codes, kind)


def q8_gemv(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor | None = None, vector: bool = True
) -> torch.Tensor:
    """`[M, K] @ W.T` -> `[M, N]` of x's dtype for 8-bit blocks, the kind named by `scales`: fp16
    [N, K/32] Q8_0 (W = scales * codes per 32 weights); int8 [N, K/16] with `supers` d [N, K/256]
    Q6_K (W = d * scales * codes per 16); uint8 [N, 2, K/32] (sc, m) with `supers` [N, 2, K/256]
    (d, dmin) Q5_K (W = d * sc * codes - dmin * m per 32). Codes int8 [N, K] in natural order run
    the fp32 loops (a bf16 x widened, the result rounded once); Q6_K's and Q5_K's uint8 codes from
    `q8_lanes_pack` run the bf16 dot-product loops (a bf16 x only). `vector=False` runs the plain loops (the
    tests' reference; for fp32 the same sums in the same order, so equal to the bit)."""
    return module_or_raise().q8_blocks_gemv(x, codes, scales, supers, vector)


def q4_tiles_mm(x: torch.Tensor, w: Q4Packed) -> torch.Tensor:
    """bf16 or fp32 `[M, K] @ W.T` for many rows (past the small-batch loops' crossover) without a
    dense copy of W: its tiles dequantized one at a time into a core's cache, each multiplied there
    (csrc/cpu_quant_tiles.cpp). The weights' exact values rounded to x's dtype, the dense copy's."""
    return module_or_raise().q4_tiles_mm(x, w.codes, w.scales, w.offsets, w.out_features)


def q8_tiles_mm(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor | None
) -> torch.Tensor:
    """`q8_gemv`'s product for many rows through dequantized tiles, as `q4_tiles_mm`."""
    return module_or_raise().q8_tiles_mm(x, codes, scales, supers)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, out_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """A 4-bit (`Q4Packed`'s tensors) or 8-bit (`q8_gemv`'s) weight as a dense `[N, K]` of `dtype`
    (bf16 or fp32): the exact values, rounded once, in natural order."""
    return module_or_raise().quant_dequantize(codes, scales, offsets, out_features, dtype)
