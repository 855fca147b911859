"""`store_kv`: scatter the new tokens' K/V into their slots of the token-level KV pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_attention.common import INTERPRET, check_launchable, unit_last_dim


@triton.jit
def store_kv_kernel(
    K_Buffer,
    V_Buffer,
    Loc,
    K,
    V,
    stride_buf_ks,
    stride_buf_kh,
    stride_buf_vs,
    stride_buf_vh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(Loc + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)

    k = tl.load(K + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = K_Buffer + slot * stride_buf_ks + offs_h[:, None] * stride_buf_kh + offs_d[None, :]
    v_dst = V_Buffer + slot * stride_buf_vs + offs_h[:, None] * stride_buf_vh + offs_d[None, :]
    tl.store(k_dst, k.to(K_Buffer.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(V_Buffer.dtype.element_ty), mask=mask)


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """`k_buffer[loc[i]] = k[i]` and likewise for V (cast to the pool dtype).

    k_buffer/v_buffer: [num_slots, KVH, D]; loc: [T] integer slots; k/v: [T, KVH, D] (any strides on
    the first two dims).
    """
    num_tokens = loc.shape[0]
    if num_tokens == 0:
        return
    assert k.shape == v.shape and k.shape[0] == num_tokens, (k.shape, v.shape, loc.shape)
    assert k.shape[1:] == k_buffer.shape[1:] == v_buffer.shape[1:], (k.shape, k_buffer.shape)
    check_launchable(k_buffer, v_buffer, loc, k, v)
    if INTERPRET and k_buffer.dtype == torch.bfloat16 and k.dtype != torch.bfloat16:
        # the interpreter's fp32->bf16 cast truncates; round on the host like a GPU would (RTNE)
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    k, v = unit_last_dim(k), unit_last_dim(v)
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    kvh, d = k.shape[1], k.shape[2]
    store_kv_kernel[(num_tokens,)](
        k_buffer,
        v_buffer,
        loc,
        k,
        v,
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kvh,
        d,
        BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d),
    )
