"""A GGUF tensor's quantized bytes as the block forms our kernels read (int4.py, q8.py).

Which tensors keep their blocks (`blocks_of`): decoder-layer weight matrices in Q4_0, Q4_1, Q4_K,
Q5_0, Q5_K, Q6_K or Q8_0, and a Q8_0 or Q6_K embedding or LM head (the head reads the embedding's
blocks when tied). Everything else (Q5_1, Q2_K, Q3_K, IQ*, ...) loads dequantized only.
llama.cpp's Q4_K_M, the file most people download, is Q4_K with Q6_K for the head and for some
layers' v and down projections (Q5_K_M: Q5_K with the same Q6_K tensors), so all of its matrices
keep their blocks (a fused q|k|v whose parts differ in kind runs them side by side: linear.py
QuantParts), in fp32 and bf16 models: Q4_K's K form has loops for both; Q5_K's and Q6_K's 8-bit
forms fp32 ones only, which a bf16 model runs on its activations widened to fp32, each result
rounded to bf16 once.

The byte layouts follow the `gguf` package's dequantization (gguf.quants), and each form's
`dequantize()` equals gguf's to the bit (tests/test_gguf_kquants.py).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from engine.layers.int4 import Q4Blocks
from engine.layers.kquant import SuperScales
from engine.layers.q8 import Q6_GROUP, Q8Blocks

# 4-bit types whose blocks map onto torch's int4 kernel: 32 weights per block, fp16 scale d, for
# Q4_1 an fp16 min m (w = d*q + m), for Q4_0 none (w = d*(q - 8)); then 16 bytes of codes, byte j
# holding weight j in its low nibble and weight j + 16 in its high nibble.
Q4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
QK_K = 256  # weights per K-quant super-block

# weights whose 8-bit blocks the LM head can read (the embedding when the head is tied to it)
_HEAD_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def _half(b: np.ndarray) -> np.ndarray:
    """Two bytes per row of `b` [..., 2] as the fp16 values they hold, in float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _rows(blocks: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[np.ndarray, int, int]:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n, k = shape
    return blocks.reshape(n, k // block_size, type_size), n, k


def q4_blocks(blocks: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Q4Blocks:
    """A Q4_0/Q4_1 matrix's bytes (as gguf_weights reads them) as codes, scales and offsets."""
    if qtype not in Q4_TYPES or len(shape) != 2:
        raise ValueError(f"not a 2-D Q4_0/Q4_1 tensor: {qtype.name} {shape}")
    b, n, k = _rows(blocks, qtype, shape)
    d = _half(b[..., 0:2])
    if qtype == GGMLQuantizationType.Q4_1:
        m, codes = _half(b[..., 2:4]), b[..., 4:]
    else:
        m, codes = d * np.float32(-8), b[..., 2:]  # exact: d is an fp16, times a power of two
    q = np.concatenate([codes & np.uint8(0x0F), codes >> np.uint8(4)], axis=-1).reshape(n, k)
    return Q4Blocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), GGML_QUANT_SIZES[qtype][0])


def _k_scales(b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, SuperScales]:
    """Q4_K's and Q5_K's scales from their blocks' rows `b` [n, supers, bytes] (fp16 d and dmin,
    then 12 bytes of eight 6-bit (sc, m) pairs): each group of 32's exact scale d*sc and offset
    -(dmin*m), and the factors."""
    n, supers = b.shape[:2]
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])  # [n, supers]
    sc, m = (t.reshape(n, supers * 8) for t in Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12)))
    groups = np.repeat(np.arange(supers), 8)  # each group's super-block
    scale = d[:, groups] * sc.astype(np.float32)  # exact: an fp16 times a 6-bit integer
    offset = -(dmin[:, groups] * m.astype(np.float32))
    factors = SuperScales(*(torch.from_numpy(np.ascontiguousarray(t)) for t in (d, sc, dmin, m)))
    return torch.from_numpy(scale), torch.from_numpy(offset), factors


def q4k_blocks(blocks: np.ndarray, shape: tuple[int, ...]) -> Q4Blocks:
    """A Q4_K matrix's bytes: per 256 weights fp16 d and dmin, 12 bytes of eight 6-bit (sc, m)
    pairs, then 128 bytes of codes, 64 weights per 32 bytes (low nibbles the first 32, high the
    next). w = d*sc*q - dmin*m per group of 32."""
    b, n, k = _rows(blocks, GGMLQuantizationType.Q4_K, shape)
    qs = b[..., 16:].reshape(n, k // QK_K, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n, k)
    scale, offset, factors = _k_scales(b)
    return Q4Blocks(torch.from_numpy(q), scale, offset, 32, factors)


def q6k_blocks(blocks: np.ndarray, shape: tuple[int, ...]) -> Q8Blocks:
    """A Q6_K matrix's bytes: per 256 weights 128 bytes of low nibbles, 64 of high bit pairs, 16
    int8 scales (one per 16 weights) and an fp16 d. w = d*sc*(q - 32)."""
    b, n, k = _rows(blocks, GGMLQuantizationType.Q6_K, shape)
    supers = k // QK_K
    ql = b[..., 0:128].reshape(n, supers, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[..., 128:192].reshape(n, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    low = (ql & np.uint8(0x0F)).reshape(n, supers, 8, 32)
    high = (qh & np.uint8(0x03)).reshape(n, supers, 8, 32)
    q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, k)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, supers * 16)
    d = _half(b[..., 208:210])
    scale = d[:, np.repeat(np.arange(supers), 16)] * sc.astype(np.float32)  # exact: fp16 times int8
    factors = SuperScales(torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(sc))
    return Q8Blocks(torch.from_numpy(q), torch.from_numpy(scale), Q6_GROUP, factors)


def q5k_blocks(blocks: np.ndarray, shape: tuple[int, ...]) -> Q8Blocks:
    """A Q5_K matrix's bytes: Q4_K's d, dmin and 6-bit (sc, m) pairs, then 32 bytes of fifth bits
    (byte l's bit j: weight l of group j) and Q4_K's 128 bytes of low nibbles. w = d*sc*q -
    dmin*m per group of 32, q 0..31, held as int8 codes."""
    b, n, k = _rows(blocks, GGMLQuantizationType.Q5_K, shape)
    supers = k // QK_K
    qh = b[..., 16:48].reshape(n, supers, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    ql = b[..., 48:].reshape(n, supers, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = ((ql & np.uint8(0x0F)).reshape(n, supers, 8, 32) | ((qh & np.uint8(1)) << np.uint8(4))).astype(np.int8)
    scale, offset, factors = _k_scales(b)
    return Q8Blocks(torch.from_numpy(q.reshape(n, k)), scale, 32, factors, offset)


def q5_0_blocks(blocks: np.ndarray, shape: tuple[int, ...]) -> Q8Blocks:
    """A Q5_0 matrix's bytes: per 32 weights an fp16 d, 4 bytes of fifth bits (bit l: weight l),
    16 bytes of low nibbles (byte j: weights j and j + 16). w = d*(q - 16): Q8_0's form."""
    b, n, k = _rows(blocks, GGMLQuantizationType.Q5_0, shape)
    high = np.ascontiguousarray(b[..., 2:6]).view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [n, g, 32]
    low = b[..., 6:].reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (low & np.uint8(0x0F)).reshape(n, -1, 32) | ((high & np.uint32(1)).astype(np.uint8) << np.uint8(4))
    codes = (q.astype(np.int8) - np.int8(16)).reshape(n, k)
    return Q8Blocks(torch.from_numpy(codes), torch.from_numpy(_half(b[..., 0:2])))


def q8_blocks(blocks: np.ndarray, shape: tuple[int, ...]) -> Q8Blocks:
    """A Q8_0 matrix's bytes: per 32 weights an fp16 scale d, then 32 int8 codes (w = d * q)."""
    b, n, k = _rows(blocks, GGMLQuantizationType.Q8_0, shape)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
    return Q8Blocks(torch.from_numpy(q), torch.from_numpy(_half(b[..., 0:2])))


def blocks_of(
    blocks: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], hf_name: str
) -> Q4Blocks | Q8Blocks | None:
    """The quantized blocks a kernel can read for this tensor (see the module docstring), if any."""
    if len(shape) != 2:
        return None
    layer = hf_name.startswith("model.layers.")
    if layer and qtype in Q4_TYPES:
        return q4_blocks(blocks, qtype, shape)
    if layer and qtype == GGMLQuantizationType.Q4_K:
        return q4k_blocks(blocks, shape)
    if (layer or hf_name in _HEAD_NAMES) and qtype == GGMLQuantizationType.Q6_K:
        return q6k_blocks(blocks, shape)
    if (layer or hf_name in _HEAD_NAMES) and qtype == GGMLQuantizationType.Q8_0:
        return q8_blocks(blocks, shape)
    if layer and qtype == GGMLQuantizationType.Q5_K:
        return q5k_blocks(blocks, shape)
    if layer and qtype == GGMLQuantizationType.Q5_0:
        return q5_0_blocks(blocks, shape)
    return None
