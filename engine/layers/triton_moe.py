"""A Triton fused-MoE path for GPUs: the experts of `FusedMoE` (moe.py) as two grouped GEMMs.

The (token, choice) pairs are sorted by expert and each expert's run padded to a whole number of
`BLOCK_M`-row blocks (`align_pairs`, torch ops on the device: no host read of the group sizes,
so a CUDA graph can capture it; the buffer is sized for the worst case). Each program of
`moe_gemm_kernel` takes one block, so one expert, and one block of output columns:

- gate|up: `h[pair] = x[token(pair)] @ w13[e].T`, `[pairs, 2I]`, the rows gathered in the kernel;
- the activation (`act_fn`: silu or gelu, and mul) in torch;
- down: `y[pair] = (act[pair] @ w2[e].T) * weight(pair)`, `[pairs, H]`;
- `out[t] = sum over t's choices of y`: the pairs are numbered `t * top_k + k`, so a reshape and a
  sum (a fixed order: deterministic).

Pairs whose expert is not on this rank (expert parallelism) go to a bucket whose blocks are
skipped, leaving their rows zero. Launching needs CUDA tensors, or `TRITON_INTERPRET=1` set
before this module is first imported (tests/moe_triton_checks.py runs it on CPU that way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_attention.common import block_size, check_launchable, upcast_dot

BLOCK_M = 16  # pairs per block: decode batches route few tokens to each expert; tl.dot needs >= 16


@triton.jit
def moe_gemm_kernel(
    A,
    W,
    C,
    SortedPairs,
    BlockExpert,
    Weights,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    num_pairs,
    N,
    K,
    TOP_K: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[pair, n] = sum_k A[row(pair), k] * W[e, n, k] (* Weights[pair]) for the block's pairs."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedPairs + offs_m)
    valid = (pairs < num_pairs) & (e >= 0)  # padding and another rank's experts: nothing to do
    e = tl.maximum(e, 0)
    a_rows = pairs // TOP_K if A_BY_TOKEN else pairs
    a_rows = tl.where(valid, a_rows, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            A + a_rows[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            W + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(Weights + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_rows = tl.where(valid, pairs, 0)
    tl.store(
        C + c_rows[:, None] * stride_cm + offs_n[None, :],
        acc.to(C.dtype.element_ty),
        mask=valid[:, None] & (offs_n[None, :] < N),
    )


def align_pairs(
    ids: torch.Tensor, expert_start: int, num_local: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert): the pairs `t * top_k + k` grouped by local expert, each
    expert's run padded to whole blocks with the sentinel `ids.numel()`; each block's local expert,
    -1 for blocks of no local expert (another rank's pairs, or past the end)."""
    flat = ids.flatten().long() - expert_start
    num_pairs = flat.numel()
    flat = torch.where((flat >= 0) & (flat < num_local), flat, num_local)  # the bucket of the others
    counts = torch.bincount(flat, minlength=num_local + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    grouped = flat[order]
    first_of_group = torch.cumsum(counts, 0) - counts
    dest = starts[grouped] + torch.arange(num_pairs, device=ids.device) - first_of_group[grouped]
    max_blocks = triton.cdiv(num_pairs, block_m) + num_local + 1
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int64, device=ids.device)
    sorted_pairs[dest] = order
    block_starts = torch.arange(max_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1)
    return sorted_pairs, block_expert.to(torch.int32)


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    weights: torch.Tensor | None,
    top_k: int,
    by_token: bool,
) -> None:
    n, k = w.shape[1], w.shape[2]
    upcast = upcast_dot(a.dtype)
    precision = "ieee" if a.dtype == torch.float32 or upcast else "tf32"
    block_n = block_size(n, 64)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    moe_gemm_kernel[grid](
        a,
        w,
        out,
        sorted_pairs,
        block_expert,
        weights if weights is not None else out,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        out.shape[0],  # the pairs: the sentinel in sorted_pairs
        n,
        k,
        TOP_K=top_k,
        A_BY_TOKEN=by_token,
        MUL_WEIGHT=weights is not None,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_size(k, 64),
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act_fn,
    expert_start: int = 0,
) -> torch.Tensor:
    """Sum over each token's chosen experts held here of `weight * expert(x)`, `[T, H]` in x's dtype."""
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    check_launchable(
        x, w13, w2, kernels="The Triton MoE kernels", module="engine.layers.triton_moe", instead="the torch experts"
    )
    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    sorted_pairs, block_expert = align_pairs(ids, expert_start, w13.shape[0])
    gate_up = torch.zeros(num_pairs, w13.shape[1], device=x.device, dtype=x.dtype)
    _gemm(x, w13, gate_up, sorted_pairs, block_expert, None, top_k, by_token=True)
    h = act_fn(gate_up).contiguous()
    y = torch.zeros(num_pairs, w2.shape[1], device=x.device, dtype=torch.float32)
    _gemm(h, w2, y, sorted_pairs, block_expert, weights.flatten().float().contiguous(), top_k, by_token=False)
    return y.view(tokens, top_k, -1).sum(1).to(x.dtype)


__all__ = ["BLOCK_M", "align_pairs", "fused_experts", "moe_gemm_kernel"]
