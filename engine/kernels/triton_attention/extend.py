"""Extend (prefill) attention: new tokens attend to their cached prefix plus themselves, causally.

One program per (request, head, block of new tokens): it streams the cached prefix (gathered
through `req_to_token`) and then the new tokens themselves under a causal mask, with an online
softmax.

`window` (a sliding-window layer) hides a key from a query `window` or more positions before it
(transformers: visible when q - window < k <= q) and skips key blocks no query of the program
sees, so slots before a request's window are never read; `softcap` (Gemma 2) caps each scaled
score before the mask.
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
def extend_kernel(
    Q_Extend,
    K_Extend,
    V_Extend,
    O_Extend,
    K_Buffer,
    V_Buffer,
    Req_to_token,
    Req_pool_indices,
    Extend_seq_lens,
    Extend_start_loc,
    Prefix_lens,
    qk_scale,  # sm_scale * log2(e)
    sm_scale,
    softcap,  # Gemma 2's attention-logit cap (with SOFTCAP)
    window,  # with WINDOW: keys window or more positions before a query are hidden
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_buf_ks,
    stride_buf_kh,
    stride_buf_vs,
    stride_buf_vh,
    stride_req_to_token,
    kv_group_num: tl.constexpr,
    head_dim: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    cur_seq = tl.program_id(0)
    cur_head = tl.program_id(1)
    cur_block_m = tl.program_id(2)
    cur_kv_head = cur_head // kv_group_num

    ext_len = tl.load(Extend_seq_lens + cur_seq).to(tl.int32)
    block_start = cur_block_m * BLOCK_M
    if block_start >= ext_len:
        return
    ext_start = tl.load(Extend_start_loc + cur_seq).to(tl.int64)
    prefix_len = tl.load(Prefix_lens + cur_seq).to(tl.int32)
    row = tl.load(Req_pool_indices + cur_seq).to(tl.int64)

    offs_m = block_start + tl.arange(0, BLOCK_M)  # positions within the new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_DMODEL)
    mask_m = offs_m < ext_len
    mask_d = offs_d < head_dim

    q = tl.load(
        Q_Extend + (ext_start + offs_m[:, None]) * stride_qt + cur_head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)  # K/V tiles follow q's dtype below

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DMODEL], dtype=tl.float32)

    # 1) the cached prefix, gathered slot by slot through the request's table row (no causal mask:
    #    every new token comes after the whole prefix). Each block has >= 1 valid column (with a
    #    window, a row may see none of a block: online_softmax_step keeps it exact).
    table_row = Req_to_token + row * stride_req_to_token
    q_pos = prefix_len + offs_m  # the queries' positions in the sequence
    prefix_from = 0
    if WINDOW:  # the first key the block's first query sees, down to a block boundary
        prefix_from = tl.maximum(prefix_len + block_start - window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(prefix_from, prefix_len, BLOCK_N):
        pos = start_n + offs_n
        mask_n = pos < prefix_len
        if WINDOW:  # slots before the window may be released: never gathered
            mask_n = mask_n & (pos > prefix_len + block_start - window)
        slots = tl.load(table_row + pos, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            K_Buffer + slots[None, :] * stride_buf_ks + cur_kv_head * stride_buf_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)
        qk = scaled_scores(qk, qk_scale, sm_scale, softcap, SOFTCAP)
        if WINDOW:
            qk = tl.where(mask_n[None, :] & (q_pos[:, None] - pos[None, :] < window), qk, float("-inf"))
        else:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
        v = tl.load(
            V_Buffer + slots[:, None] * stride_buf_vs + cur_kv_head * stride_buf_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    # 2) the new tokens themselves, causally; only blocks up to this query block's last row.
    #    Column 0 is visible to every row, so no row is ever fully masked.
    end_n = tl.minimum(ext_len, block_start + BLOCK_M)
    ext_from = 0
    if WINDOW:
        ext_from = tl.maximum(block_start - window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(ext_from, end_n, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < end_n
        k = tl.load(
            K_Extend + (ext_start + cols[None, :]) * stride_kt + cur_kv_head * stride_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)
        qk = scaled_scores(qk, qk_scale, sm_scale, softcap, SOFTCAP)
        visible = mask_n[None, :] & (offs_m[:, None] >= cols[None, :])
        if WINDOW:
            visible = visible & (offs_m[:, None] - cols[None, :] < window)
        qk = tl.where(visible, qk, float("-inf"))
        v = tl.load(
            V_Extend + (ext_start + cols[:, None]) * stride_vt + cur_kv_head * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    if WINDOW:  # a padding row past the request may see no key (never stored): no 0 / 0
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        O_Extend + (ext_start + offs_m[:, None]) * stride_ot + cur_head * stride_oh + offs_d[None, :],
        out.to(O_Extend.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    sm_scale: float,
    max_len_extend: int | None = None,
    block_m: int = 32,
    block_n: int = 32,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Prefill (possibly on top of a cached prefix) for a batch of requests of different lengths.

    q/o_extend: [T, H, D] and k/v_extend: [T, KVH, D] for the new tokens, request b's rows being
    `extend_start_loc[b] : extend_start_loc[b] + extend_seq_lens[b]`. The prefix (the first
    `prefix_lens[b]` positions of table row `req_pool_indices[b]`) is read from the pool; the new
    tokens' K/V are read from k/v_extend (they may also be in the pool already; that is not
    required). `seq_lens` (= prefix + extend) is accepted for interface parity and not needed.
    `max_len_extend` (host int) avoids a device sync when given. `window` > 0: a sliding-window
    layer's mask; `softcap` > 0: scores capped (Gemma 2). Writes `o_extend` and returns it.
    """
    del seq_lens
    assert window >= 0 and softcap >= 0.0, (window, softcap)
    num_tokens, num_heads, head_dim = q_extend.shape
    num_kv_heads = k_extend.shape[1]
    assert k_extend.shape == v_extend.shape == (num_tokens, num_kv_heads, head_dim), (q_extend.shape, k_extend.shape)
    assert k_buffer.shape[1:] == (num_kv_heads, head_dim) and v_buffer.shape == k_buffer.shape, k_buffer.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert o_extend.shape == q_extend.shape, (o_extend.shape, q_extend.shape)
    batch = extend_seq_lens.shape[0]
    if batch == 0 or num_tokens == 0:
        return o_extend
    check_launchable(
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        extend_seq_lens,
        extend_start_loc,
        prefix_lens,
    )
    q_extend, k_extend, v_extend = unit_last_dim(q_extend), unit_last_dim(k_extend), unit_last_dim(v_extend)
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1 and o_extend.stride(-1) == 1
    assert req_to_token.stride(1) == 1
    if max_len_extend is None:
        max_len_extend = int(extend_seq_lens.max().item())
    if max_len_extend == 0:
        return o_extend

    o_k = interpreter_out(o_extend)
    block_m = pow2_at_least(min(block_m, triton.next_power_of_2(max_len_extend)))
    grid = (batch, num_heads, triton.cdiv(max_len_extend, block_m))
    extend_kernel[grid](
        q_extend,
        k_extend,
        v_extend,
        o_k,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        extend_seq_lens,
        extend_start_loc,
        prefix_lens,
        sm_scale * LOG2E,
        sm_scale,
        softcap or 1.0,
        window,
        q_extend.stride(0),
        q_extend.stride(1),
        k_extend.stride(0),
        k_extend.stride(1),
        v_extend.stride(0),
        v_extend.stride(1),
        o_k.stride(0),
        o_k.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        kv_group_num=num_heads // num_kv_heads,
        head_dim=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=pow2_at_least(block_n),
        BLOCK_DMODEL=pow2_at_least(head_dim),
        DOT_PRECISION=dot_precision(q_extend.dtype),
        UPCAST_DOT=upcast_dot(q_extend.dtype),
        SOFTCAP=softcap > 0.0,
        WINDOW=window > 0,
        num_warps=4 if head_dim <= 64 else 8,
        num_stages=1,
    )
    return finish_out(o_extend, o_k)
