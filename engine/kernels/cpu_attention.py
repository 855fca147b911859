"""The CPU paged attention kernels (csrc/cpu_attention*.cpp), called per layer.

The extension is built and loaded by cpu_extension.py (`load()` here is its `load`). bf16 runs on
AVX512-BF16 dot products where the CPU has them (cpu_attention_bf16.cpp), else on fp32 FMAs.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu_extension import load, module_or_raise

__all__ = [
    "DTYPES",
    "HEAD_DIMS",
    "available",
    "decode_attention",
    "extend_attention",
    "load",
    "shares_rows",
    "supports",
]

HEAD_DIMS = (64, 128, 256)  # 256: Gemma 2 / Gemma 3
DTYPES = (torch.float32, torch.bfloat16)


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels handle attention on this device, dtype and head size."""
    return device.type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """`supports` and the extension is built (building it now if it is not cached)."""
    return supports(device, dtype, head_dim) and load() is not None


def shares_rows(dtype: torch.dtype) -> bool:
    """Whether a decode with several queries per slot row (`query_starts`) reads each row's K/V
    once for all of them: bf16 on the AVX512-BF16 kernels; the fp32-FMA kernels repeat the row per
    query (correct, but no fewer reads than one row each)."""
    module = load()
    return dtype == torch.bfloat16 and module is not None and bool(module.attention_bf16dot_built())


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    query_starts: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, D], lse [B, H] fp32) of B decode queries, query b over its slot row's first
    `lens[b]` slots.

    q `[B, H, D]`; k_buf/v_buf `[S, KVH, D]` (one layer of the pool); slots int64 `[R, L]`;
    lens int64 `[B]` (each >= 1). One query per slot row (R = B), or with `query_starts` int64
    `[R + 1]` row r's queries are `q[query_starts[r]:query_starts[r + 1]]` (a speculative verify's
    positions of one request: the row's K/V is read once for all of them, and each query's result
    is bit-identical to attending it alone). `softcap`: Gemma 2's attention-logit cap, applied to
    every scaled score (`cap * tanh(score / cap)`; None: none). Raises RuntimeError if the kernel
    is not built.
    """
    module = module_or_raise()
    cap = softcap or 0.0
    with torch.profiler.record_function("asyncllm::cpu_decode_attention"):  # named in profiles
        out, lse = module.decode_attention(q.contiguous(), k_buf, v_buf, slots, lens, scale, query_starts, cap)
    return out, lse


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves: `[T, H, D]`.

    q `[T, H, D]` (requests' new tokens back to back); slots int64 `[R, L]`, row r holding
    request r's `prefix_lens[r] + extend_lens[r]` slots (the new tokens' K/V already written);
    prefix_lens/extend_lens int64 `[R]` (extend >= 1); `softcap` as `decode_attention`'s. `window`
    > 0: a sliding-window layer, the token at position p sees keys p - window + 1 .. p only (the
    row's slots before its first token's window are never read: they may be released).
    """
    module = module_or_raise()
    cap = softcap or 0.0
    with torch.profiler.record_function("asyncllm::cpu_extend_attention"):
        return module.extend_attention(
            q.contiguous(), k_buf, v_buf, slots, prefix_lens, extend_lens, scale, cap, window
        )
