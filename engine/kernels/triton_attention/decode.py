"""Split-KV flash decoding over the token-level KV pool, grouped query heads per program.

Stage 1: one program per (request, KV head, split) handles every query head that shares the KV
head (grouped-query attention) over its slice of the sequence, writing a partial output and its
log-sum-exp. Stage 2: one program per (request, head) merges the splits. Every position is read
through `req_to_token`, so nothing assumes a request's slots are contiguous.

`window` (a sliding-window layer: Mistral, Phi-3, Gemma's local layers) splits only the last
`window` positions, so slots before them are never read (hybrid SWA memory may have released
them); `softcap` (Gemma 2) caps each scaled score before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_attention.common import (
    LOG2E,
    check_launchable,
    dot_precision,
    finish_out,
    interpreter_out,
    online_softmax_step,
    pow2_at_least,
    scaled_scores,
    unit_last_dim,
    upcast_dot,
)


@triton.jit
def decode_stage1_kernel(
    Q,
    K_Buffer,
    V_Buffer,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Mid_O,  # [B, H, S, D] fp32 partial outputs (each normalized by its own split's sum)
    Mid_Lse,  # [B, H, S] fp32 log2-sum-exp2 of the split's scaled scores
    qk_scale,  # sm_scale * log2(e)
    sm_scale,
    softcap,  # Gemma 2's attention-logit cap (with SOFTCAP)
    window,  # attend the last `window` positions only (0: all)
    stride_qb,
    stride_qh,
    stride_buf_ks,
    stride_buf_kh,
    stride_buf_vs,
    stride_buf_vh,
    stride_req_to_token,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    stride_mid_lb,
    stride_mid_lh,
    kv_group_num: tl.constexpr,
    head_dim: tl.constexpr,
    num_kv_splits: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split_id = tl.program_id(2)

    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)
    row = tl.load(Req_pool_indices + cur_batch).to(tl.int64)
    first = seq_len - tl.minimum(seq_len, tl.where(window > 0, window, seq_len))  # the window's first position
    len_per_split = tl.cdiv(seq_len - first, num_kv_splits)
    split_start = first + len_per_split * split_id
    split_end = tl.minimum(split_start + len_per_split, seq_len)
    if split_start >= split_end:
        return  # stage 2 skips the same empty splits

    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_n = tl.arange(0, BLOCK_N)
    cur_heads = cur_kv_head * kv_group_num + offs_g
    mask_h = offs_g < kv_group_num
    mask_d = offs_d < head_dim

    q = tl.load(
        Q + cur_batch * stride_qb + cur_heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)  # K/V tiles follow q's dtype below

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DMODEL], dtype=tl.float32)

    table_row = Req_to_token + row * stride_req_to_token
    for start_n in range(split_start, split_end, BLOCK_N):
        pos = start_n + offs_n
        mask_n = pos < split_end
        slots = tl.load(table_row + pos, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            K_Buffer + slots[None, :] * stride_buf_ks + cur_kv_head * stride_buf_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )  # [BLOCK_DMODEL, BLOCK_N]
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        qk = scaled_scores(qk, qk_scale, sm_scale, softcap, SOFTCAP)
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        v = tl.load(
            V_Buffer + slots[:, None] * stride_buf_vs + cur_kv_head * stride_buf_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_DMODEL]
        # every block holds at least one valid position, so the running max stays finite
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / l_i[:, None]
    o_ptrs = Mid_O + cur_batch * stride_mid_ob + cur_heads[:, None] * stride_mid_oh + split_id * stride_mid_os
    tl.store(o_ptrs + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    lse_ptrs = Mid_Lse + cur_batch * stride_mid_lb + cur_heads * stride_mid_lh + split_id
    tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def decode_stage2_kernel(
    Mid_O,
    Mid_Lse,
    Out,
    Seq_lens,
    window,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    stride_mid_lb,
    stride_mid_lh,
    stride_ob,
    stride_oh,
    head_dim: tl.constexpr,
    num_kv_splits: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)
    first = seq_len - tl.minimum(seq_len, tl.where(window > 0, window, seq_len))  # stage 1's splits
    len_per_split = tl.cdiv(seq_len - first, num_kv_splits)

    offs_d = tl.arange(0, BLOCK_DMODEL)
    mask_d = offs_d < head_dim
    o_base = Mid_O + cur_batch * stride_mid_ob + cur_head * stride_mid_oh
    lse_base = Mid_Lse + cur_batch * stride_mid_lb + cur_head * stride_mid_lh

    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_DMODEL], dtype=tl.float32)
    for split_id in range(0, num_kv_splits):
        split_start = first + len_per_split * split_id
        split_end = tl.minimum(split_start + len_per_split, seq_len)
        if split_end > split_start:
            lse = tl.load(lse_base + split_id)
            part = tl.load(o_base + split_id * stride_mid_os + offs_d, mask=mask_d, other=0.0)
            m_new = tl.maximum(m_run, lse)
            alpha = tl.exp2(m_run - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + part * w
            l_run = l_run * alpha + w
            m_run = m_new

    out = acc / l_run
    tl.store(Out + cur_batch * stride_ob + cur_head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: int,
    sm_scale: float,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    block_n: int = 32,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One new query token per request attends to its whole sequence (`seq_lens[b]` positions,
    including the token just stored). q/o: [B, H, D]; k/v_buffer: [num_slots, KVH, D];
    req_to_token: [rows, max_ctx]; req_pool_indices/seq_lens: [B]. Writes `o` and returns it.

    `mid_o` ([B, H, num_kv_splits, D] fp32) and `mid_lse` ([B, H, num_kv_splits] fp32) are the
    stage-1 scratch buffers; pass them to reuse one allocation across layers. `window` > 0: only
    the last `window` positions (a sliding-window layer); `softcap` > 0: scores capped (Gemma 2).
    """
    assert window >= 0 and softcap >= 0.0, (window, softcap)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert k_buffer.shape[2] == head_dim and v_buffer.shape == k_buffer.shape, (q.shape, k_buffer.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert o.shape == q.shape, (o.shape, q.shape)
    assert num_kv_splits >= 1
    if batch == 0:
        return o
    check_launchable(q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, seq_lens)
    q = unit_last_dim(q)
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1 and o.stride(-1) == 1
    assert req_to_token.stride(1) == 1
    if mid_o is None:
        mid_o = torch.empty((batch, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty((batch, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    assert mid_o.shape[:3] == (batch, num_heads, num_kv_splits) and mid_o.stride(-1) == 1, mid_o.shape
    assert mid_lse.shape == (batch, num_heads, num_kv_splits) and mid_lse.stride(-1) == 1, mid_lse.shape

    o_k = interpreter_out(o)
    kv_group_num = num_heads // num_kv_heads
    block_dmodel = pow2_at_least(head_dim)
    decode_stage1_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        sm_scale * LOG2E,
        sm_scale,
        softcap or 1.0,
        window,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        kv_group_num=kv_group_num,
        head_dim=head_dim,
        num_kv_splits=num_kv_splits,
        BLOCK_H=pow2_at_least(kv_group_num),
        BLOCK_N=pow2_at_least(block_n),
        BLOCK_DMODEL=block_dmodel,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.dtype),
        SOFTCAP=softcap > 0.0,
        num_warps=4,
        num_stages=2,
    )
    decode_stage2_kernel[(batch, num_heads)](
        mid_o,
        mid_lse,
        o_k,
        seq_lens,
        window,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o_k.stride(0),
        o_k.stride(1),
        head_dim=head_dim,
        num_kv_splits=num_kv_splits,
        BLOCK_DMODEL=block_dmodel,
        num_warps=4,
        num_stages=2,
    )
    return finish_out(o, o_k)
