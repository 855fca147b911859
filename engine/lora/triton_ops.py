"""SGMV-style Triton kernels for the LoRA delta of one projection (the GPU path of ops.py).

Segmented gather matrix-vector products (Punica's SGMV, as SGLang runs it): each program takes
one block of one segment's rows (all rows of a segment use one adapter, so one slot of the
stacked buffers, pool.py), so one launch serves every adapter of the batch, however mixed.

- `lora_shrink`: `h[i] = (x[row_i] @ A[slot].T) * scaling[slot]`, fp32, `[lora rows, parts * R]`;
- `lora_expand`: `out[row_i, part p's columns] += h[i, rank block p] @ B[slot, part p's rows].T`.

The gather of the LoRA rows happens inside the kernels (`RowIndex`), and each output element
is owned by one program, so the expand adds in place without atomics. Base rows are never loaded
or stored. Launching needs CUDA tensors, or `TRITON_INTERPRET=1` set before this module is first
imported (the tests run the kernels on CPU that way): ops.py imports this module only on that path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.lora.batch import LoRABatchInfo
from engine.lora.pool import LoRAWeights

# triton.jit reads TRITON_INTERPRET when it decorates a kernel: later changes do nothing
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BLOCK_M = 16  # rows of a segment per program: decode segments are short; tl.dot needs >= 16


@triton.jit
def lora_shrink_kernel(
    X,
    RowIndex,
    SegTable,
    A,
    Scaling,
    H,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ss,
    stride_ht,
    num_segs,
    in_features,
    rank_total,
    HAS_INDEX: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    block_m = tl.program_id(1)
    block_r = tl.program_id(2)
    slot = tl.load(SegTable + seg).to(tl.int64)
    start = tl.load(SegTable + num_segs + seg)
    length = tl.load(SegTable + 2 * num_segs + seg)
    if block_m * BLOCK_M >= length:
        return
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    lora_row = (start + offs_m).to(tl.int64)
    if HAS_INDEX:
        x_row = tl.load(RowIndex + lora_row, mask=mask_m, other=0).to(tl.int64)
    else:
        x_row = lora_row
    offs_r = block_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank_total
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < in_features
        x = tl.load(X + x_row[:, None] * stride_xt + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a_ptr = A + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None]
        a = tl.load(a_ptr, mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)
    scale = tl.load(Scaling + slot * stride_ss + offs_r, mask=mask_r, other=0.0)
    acc = acc * scale[None, :]
    tl.store(H + lora_row[:, None] * stride_ht + offs_r[None, :], acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def lora_expand_kernel(
    H,
    RowIndex,
    SegTable,
    B,
    Out,
    PartTable,
    stride_ht,
    stride_bs,
    stride_bo,
    stride_ot,
    num_segs,
    num_parts,
    max_rank,
    blocks_per_part,
    HAS_INDEX: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0)
    block_m = tl.program_id(1)
    part = tl.program_id(2) // blocks_per_part
    block_n = tl.program_id(2) % blocks_per_part
    slot = tl.load(SegTable + seg).to(tl.int64)
    start = tl.load(SegTable + num_segs + seg)
    length = tl.load(SegTable + 2 * num_segs + seg)
    out_start = tl.load(PartTable + part)
    out_size = tl.load(PartTable + num_parts + part)
    if block_m * BLOCK_M >= length or block_n * BLOCK_N >= out_size:
        return
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    lora_row = (start + offs_m).to(tl.int64)
    if HAS_INDEX:
        x_row = tl.load(RowIndex + lora_row, mask=mask_m, other=0).to(tl.int64)
    else:
        x_row = lora_row
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_size
    col = (out_start + offs_n).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, max_rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < max_rank
        h_ptr = H + lora_row[:, None] * stride_ht + (part * max_rank + offs_r)[None, :]
        h = tl.load(h_ptr, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b_ptr = B + slot * stride_bs + col[None, :] * stride_bo + offs_r[:, None]
        b = tl.load(b_ptr, mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        if UPCAST:
            b = b.to(tl.float32)
        else:
            h = h.to(b.dtype)  # as the torch path: the shrink's result in the model's dtype
        acc += tl.dot(h, b, input_precision=DOT_PRECISION)
    o_ptr = Out + x_row[:, None] * stride_ot + col[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    o = tl.load(o_ptr, mask=mask, other=0.0)
    tl.store(o_ptr, (o.to(tl.float32) + acc).to(Out.dtype.element_ty), mask=mask)


def _check_launchable(*tensors: torch.Tensor) -> None:
    if INTERPRET:
        return
    for t in tensors:
        if not t.is_cuda:
            raise RuntimeError(
                f"the Triton LoRA kernels need CUDA tensors (got one on {t.device}); set TRITON_INTERPRET=1 "
                "before importing engine.lora.triton_ops to run them on CPU, or use the torch path"
            )


def _pow2(n: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(n)))


def _dot_options(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast, precision): the interpreter's tl.dot misreads bf16 operands, so they are widened to
    fp32 there (exact); fp32 asks for exact fp32 products (TF32 would cost ~1e-3)."""
    upcast = INTERPRET and dtype == torch.bfloat16
    return upcast, "ieee" if dtype == torch.float32 or upcast else "tf32"


def lora_shrink(x: torch.Tensor, w: LoRAWeights, info: LoRABatchInfo) -> torch.Tensor:
    """`[lora rows, parts * R]` fp32: each LoRA row's scaled shrink, segment after segment."""
    rank_total, in_features = w.a.shape[1], w.a.shape[2]
    h = torch.empty(info.num_lora_rows, rank_total, device=x.device, dtype=torch.float32)
    if x.stride(-1) != 1:
        x = x.contiguous()
    _check_launchable(x, w.a)
    upcast, precision = _dot_options(x.dtype)
    block_r = _pow2(rank_total, 64)
    num_segs = len(info.seg_slots)
    grid = (num_segs, triton.cdiv(info.max_seg_len, BLOCK_M), triton.cdiv(rank_total, block_r))
    index = info.row_index if info.row_index is not None else info.seg_table  # unused when no index
    lora_shrink_kernel[grid](
        x,
        index,
        info.seg_table,
        w.a,
        w.scaling,
        h,
        x.stride(0),
        w.a.stride(0),
        w.a.stride(1),
        w.scaling.stride(0),
        h.stride(0),
        num_segs,
        in_features,
        rank_total,
        HAS_INDEX=info.row_index is not None,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        BLOCK_M=BLOCK_M,
        BLOCK_R=block_r,
        BLOCK_K=_pow2(in_features, 64),
    )
    return h


def lora_expand(h: torch.Tensor, w: LoRAWeights, out: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
    """`out[LoRA rows, part p's columns] += h[:, rank block p] @ B[slot, part p].T`, in place."""
    if out.stride(-1) != 1:
        raise ValueError("lora_expand adds into `out` in place: its last dim must be contiguous")
    _check_launchable(h, w.b, out)
    upcast, precision = _dot_options(out.dtype)
    sizes = w.out_sizes
    block_n = _pow2(max(sizes), 64)
    blocks_per_part = triton.cdiv(max(sizes), block_n)
    num_segs = len(info.seg_slots)
    grid = (num_segs, triton.cdiv(info.max_seg_len, BLOCK_M), len(sizes) * blocks_per_part)
    index = info.row_index if info.row_index is not None else info.seg_table
    lora_expand_kernel[grid](
        h,
        index,
        info.seg_table,
        w.b,
        out,
        w.part_table,
        h.stride(0),
        w.b.stride(0),
        w.b.stride(1),
        out.stride(0),
        num_segs,
        len(sizes),
        w.max_rank,
        blocks_per_part,
        HAS_INDEX=info.row_index is not None,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_R=_pow2(w.max_rank, 64),
    )
    return out
