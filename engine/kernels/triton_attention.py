"""Triton attention kernels over the token-level KV pool (SGLang-style).

The pool is `k_buffer` / `v_buffer` of shape `[num_slots, KVH, D]`; `req_to_token[row, pos]` is the
slot holding position `pos` of the request in table row `row`. Every position is looked up through
that table, so nothing assumes a request's slots are contiguous (page size 1, shuffled slots and
paged layouts all work the same).

Kernels (all accumulate in fp32; operands may be fp32, fp16 or bf16):

- `store_kv`: scatter the new tokens' K/V into their pool slots.
- `decode_attention_fwd`: split-KV flash decoding. Stage 1: one program per (request, KV head,
  split) handles every query head that shares the KV head (grouped-query attention) over its slice
  of the sequence, writing a partial output and its log-sum-exp. Stage 2: one program per
  (request, head) merges the splits.
- `extend_attention_fwd`: one program per (request, head, block of new tokens). It streams the cached
  prefix (gathered through `req_to_token`) and then the new tokens themselves under a causal mask,
  with an online softmax.

Importing this module needs `triton` but no GPU. Launching needs CUDA tensors, or
`TRITON_INTERPRET=1` set before this module is first imported (the interpreter runs the kernels on
CPU with numpy; that is how the tests run them). Otherwise the wrappers raise RuntimeError.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634

# Decided when the kernels are decorated: triton.jit reads TRITON_INTERPRET at import time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_launchable(*tensors: torch.Tensor) -> None:
    if INTERPRET:
        return
    for t in tensors:
        if not t.is_cuda:
            raise RuntimeError(
                "Triton attention kernels need CUDA tensors (got a tensor on "
                f"{t.device}); to run them on CPU set TRITON_INTERPRET=1 before importing "
                "engine.kernels.triton_attention, or use the torch attention backend"
            )


def _upcast_dot(dtype: torch.dtype) -> bool:
    # The interpreter's tl.dot multiplies bf16 operands' raw uint16 storage (seen in triton 3.7), so
    # under the interpreter bf16 tiles are widened to fp32 (exact) before each dot. GPUs keep bf16.
    return INTERPRET and dtype == torch.bfloat16


def _interpreter_out(o: torch.Tensor) -> torch.Tensor:
    # The interpreter's fp32->bf16 cast truncates instead of rounding to nearest even as GPUs do;
    # there, bf16 outputs are written to an fp32 buffer and rounded by torch (see _finish_out).
    if INTERPRET and o.dtype == torch.bfloat16:
        return torch.empty(o.shape, dtype=torch.float32, device=o.device)
    return o


def _finish_out(o: torch.Tensor, o_kernel: torch.Tensor) -> torch.Tensor:
    if o_kernel is not o:
        o.copy_(o_kernel)
    return o


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands: exact fp32 products (TF32 would cost ~1e-3 relative error); half types: ignored.
    return "ieee" if dtype == torch.float32 or _upcast_dot(dtype) else "tf32"


def _pow2_at_least(n: int, floor: int = 16) -> int:
    # tl.dot needs every block dimension >= 16 on NVIDIA GPUs.
    return max(floor, triton.next_power_of_2(n))


# --------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
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


def _unit_last_dim(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


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
    _check_launchable(k_buffer, v_buffer, loc, k, v)
    if INTERPRET and k_buffer.dtype == torch.bfloat16 and k.dtype != torch.bfloat16:
        # the interpreter's fp32->bf16 cast truncates; round on the host like a GPU would (RTNE)
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    k, v = _unit_last_dim(k), _unit_last_dim(v)
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    kvh, d = k.shape[1], k.shape[2]
    _store_kv_kernel[(num_tokens,)](
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


# --------------------------------------------------------------------------------------------
# shared: one online-softmax step
# --------------------------------------------------------------------------------------------


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one block of base-2 scores `qk` [rows, BLOCK_N] (masked columns -inf; every row has at
    least one finite score overall) and its values `v` [BLOCK_N, D] into the running max, sum
    and output accumulator. Inlined by Triton into each kernel."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# --------------------------------------------------------------------------------------------
# decode: split-KV flash decoding with grouped query heads
# --------------------------------------------------------------------------------------------


@triton.jit
def _decode_stage1_kernel(
    Q,
    K_Buffer,
    V_Buffer,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Mid_O,  # [B, H, S, D] fp32 partial outputs (each normalized by its own split's sum)
    Mid_Lse,  # [B, H, S] fp32 log2-sum-exp2 of the split's scaled scores
    qk_scale,  # sm_scale * log2(e)
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
):
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split_id = tl.program_id(2)

    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)
    row = tl.load(Req_pool_indices + cur_batch).to(tl.int64)
    len_per_split = tl.cdiv(seq_len, num_kv_splits)
    split_start = len_per_split * split_id
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
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        v = tl.load(
            V_Buffer + slots[:, None] * stride_buf_vs + cur_kv_head * stride_buf_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_DMODEL]
        # every block holds at least one valid position, so the running max stays finite
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / l_i[:, None]
    o_ptrs = Mid_O + cur_batch * stride_mid_ob + cur_heads[:, None] * stride_mid_oh + split_id * stride_mid_os
    tl.store(o_ptrs + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    lse_ptrs = Mid_Lse + cur_batch * stride_mid_lb + cur_heads * stride_mid_lh + split_id
    tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    Mid_O,
    Mid_Lse,
    O,
    Seq_lens,
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
    len_per_split = tl.cdiv(seq_len, num_kv_splits)

    offs_d = tl.arange(0, BLOCK_DMODEL)
    mask_d = offs_d < head_dim
    o_base = Mid_O + cur_batch * stride_mid_ob + cur_head * stride_mid_oh
    lse_base = Mid_Lse + cur_batch * stride_mid_lb + cur_head * stride_mid_lh

    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_DMODEL], dtype=tl.float32)
    for split_id in range(0, num_kv_splits):
        split_start = len_per_split * split_id
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
    tl.store(O + cur_batch * stride_ob + cur_head * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


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
) -> torch.Tensor:
    """One new query token per request attends to its whole sequence (`seq_lens[b]` positions,
    including the token just stored). q/o: [B, H, D]; k/v_buffer: [num_slots, KVH, D];
    req_to_token: [rows, max_ctx]; req_pool_indices/seq_lens: [B]. Writes `o` and returns it.

    `mid_o` ([B, H, num_kv_splits, D] fp32) and `mid_lse` ([B, H, num_kv_splits] fp32) are the
    stage-1 scratch buffers; pass them to reuse one allocation across layers.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert k_buffer.shape[2] == head_dim and v_buffer.shape == k_buffer.shape, (q.shape, k_buffer.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert o.shape == q.shape, (o.shape, q.shape)
    assert num_kv_splits >= 1
    if batch == 0:
        return o
    _check_launchable(q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, seq_lens)
    q = _unit_last_dim(q)
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1 and o.stride(-1) == 1
    assert req_to_token.stride(1) == 1
    if mid_o is None:
        mid_o = torch.empty((batch, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty((batch, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    assert mid_o.shape[:3] == (batch, num_heads, num_kv_splits) and mid_o.stride(-1) == 1, mid_o.shape
    assert mid_lse.shape == (batch, num_heads, num_kv_splits) and mid_lse.stride(-1) == 1, mid_lse.shape

    o_k = _interpreter_out(o)
    kv_group_num = num_heads // num_kv_heads
    block_dmodel = _pow2_at_least(head_dim)
    _decode_stage1_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        sm_scale * _LOG2E,
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
        BLOCK_H=_pow2_at_least(kv_group_num),
        BLOCK_N=_pow2_at_least(block_n),
        BLOCK_DMODEL=block_dmodel,
        DOT_PRECISION=_dot_precision(q.dtype),
        UPCAST_DOT=_upcast_dot(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    _decode_stage2_kernel[(batch, num_heads)](
        mid_o,
        mid_lse,
        o_k,
        seq_lens,
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
    return _finish_out(o, o_k)


# --------------------------------------------------------------------------------------------
# extend: new tokens attend to the cached prefix plus themselves (causal)
# --------------------------------------------------------------------------------------------


@triton.jit
def _extend_kernel(
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
    #    every new token comes after the whole prefix). Each block has >= 1 valid column.
    table_row = Req_to_token + row * stride_req_to_token
    for start_n in range(0, prefix_len, BLOCK_N):
        pos = start_n + offs_n
        mask_n = pos < prefix_len
        slots = tl.load(table_row + pos, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            K_Buffer + slots[None, :] * stride_buf_ks + cur_kv_head * stride_buf_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        v = tl.load(
            V_Buffer + slots[:, None] * stride_buf_vs + cur_kv_head * stride_buf_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    # 2) the new tokens themselves, causally; only blocks up to this query block's last row.
    #    Column 0 is visible to every row, so no row is ever fully masked.
    end_n = tl.minimum(ext_len, block_start + BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < end_n
        k = tl.load(
            K_Extend + (ext_start + cols[None, :]) * stride_kt + cur_kv_head * stride_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        visible = mask_n[None, :] & (offs_m[:, None] >= cols[None, :])
        qk = tl.where(visible, qk, float("-inf"))
        v = tl.load(
            V_Extend + (ext_start + cols[:, None]) * stride_vt + cur_kv_head * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        ).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

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
) -> torch.Tensor:
    """Prefill (possibly on top of a cached prefix) for a batch of requests of different lengths.

    q/o_extend: [T, H, D] and k/v_extend: [T, KVH, D] for the new tokens, request b's rows being
    `extend_start_loc[b] : extend_start_loc[b] + extend_seq_lens[b]`. The prefix (the first
    `prefix_lens[b]` positions of table row `req_pool_indices[b]`) is read from the pool; the new
    tokens' K/V are read from k/v_extend (they may also be in the pool already; that is not
    required). `seq_lens` (= prefix + extend) is accepted for interface parity and not needed.
    `max_len_extend` (host int) avoids a device sync when given. Writes `o_extend` and returns it.
    """
    del seq_lens
    num_tokens, num_heads, head_dim = q_extend.shape
    num_kv_heads = k_extend.shape[1]
    assert k_extend.shape == v_extend.shape == (num_tokens, num_kv_heads, head_dim), (q_extend.shape, k_extend.shape)
    assert k_buffer.shape[1:] == (num_kv_heads, head_dim) and v_buffer.shape == k_buffer.shape, k_buffer.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert o_extend.shape == q_extend.shape, (o_extend.shape, q_extend.shape)
    batch = extend_seq_lens.shape[0]
    if batch == 0 or num_tokens == 0:
        return o_extend
    _check_launchable(
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token, req_pool_indices,
        extend_seq_lens, extend_start_loc, prefix_lens,
    )
    q_extend, k_extend, v_extend = _unit_last_dim(q_extend), _unit_last_dim(k_extend), _unit_last_dim(v_extend)
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1 and o_extend.stride(-1) == 1
    assert req_to_token.stride(1) == 1
    if max_len_extend is None:
        max_len_extend = int(extend_seq_lens.max().item())
    if max_len_extend == 0:
        return o_extend

    o_k = _interpreter_out(o_extend)
    block_m = _pow2_at_least(min(block_m, triton.next_power_of_2(max_len_extend)))
    grid = (batch, num_heads, triton.cdiv(max_len_extend, block_m))
    _extend_kernel[grid](
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
        sm_scale * _LOG2E,
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
        BLOCK_N=_pow2_at_least(block_n),
        BLOCK_DMODEL=_pow2_at_least(head_dim),
        DOT_PRECISION=_dot_precision(q_extend.dtype),
        UPCAST_DOT=_upcast_dot(q_extend.dtype),
        num_warps=4 if head_dim <= 64 else 8,
        num_stages=1,
    )
    return _finish_out(o_extend, o_k)
