"""What every Triton attention kernel shares: the interpreter switch, launch checks, dtype
workarounds for the interpreter, block-size helpers and the online-softmax step.

`INTERPRET` is read once, when this module is first imported, because `triton.jit` reads
TRITON_INTERPRET when it decorates a kernel: setting the variable later changes nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Decided when the kernels are decorated: triton.jit reads TRITON_INTERPRET at import time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_launchable(
    *tensors: torch.Tensor,
    kernels: str = "Triton attention kernels",
    module: str = "engine.kernels.triton_attention",
    instead: str = "the torch or cpu attention backend",
) -> None:
    """Raise a RuntimeError that says what to do when a kernel would launch on CPU tensors."""
    if INTERPRET:
        return
    for t in tensors:
        if not t.is_cuda:
            raise RuntimeError(
                f"{kernels} need CUDA tensors (got a tensor on {t.device}); to run them on CPU set "
                f"TRITON_INTERPRET=1 before importing {module}, or use {instead}"
            )


def block_size(n: int, cap: int) -> int:
    """A power-of-two block covering `n` (at least 16, what tl.dot takes; at most `cap`)."""
    return min(cap, max(16, triton.next_power_of_2(n)))


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether bf16 tiles are widened to fp32 before each `tl.dot`.

    The interpreter's tl.dot multiplies bf16 operands' raw uint16 storage (seen in triton 3.7), so
    under the interpreter bf16 tiles are widened to fp32 (exact) before each dot. GPUs keep bf16.
    """
    return INTERPRET and dtype == torch.bfloat16


def interpreter_out(o: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel writes its output to: `o`, or an fp32 stand-in under the interpreter.

    The interpreter's fp32->bf16 cast truncates instead of rounding to nearest even as GPUs do;
    there, bf16 outputs are written to an fp32 buffer and rounded by torch (see `finish_out`).
    """
    if INTERPRET and o.dtype == torch.bfloat16:
        return torch.empty(o.shape, dtype=torch.float32, device=o.device)
    return o


def finish_out(o: torch.Tensor, o_kernel: torch.Tensor) -> torch.Tensor:
    """`o`, holding what the kernel wrote to `o_kernel` (rounded by torch if it was a stand-in)."""
    if o_kernel is not o:
        o.copy_(o_kernel)
    return o


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands: exact fp32 products (TF32 would cost ~1e-3 relative error); half types: ignored."""
    return "ieee" if dtype == torch.float32 or upcast_dot(dtype) else "tf32"


def pow2_at_least(n: int, floor: int = 16) -> int:
    """A block size: tl.dot needs every block dimension >= 16 on NVIDIA GPUs."""
    return max(floor, triton.next_power_of_2(n))


def unit_last_dim(t: torch.Tensor) -> torch.Tensor:
    """`t` with a unit stride on its last dim (the kernels address rows of D contiguous values)."""
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one block of base-2 scores `qk` [rows, BLOCK_N] (masked columns -inf; every row has at
    least one finite score overall) and its values `v` [BLOCK_N, D] into the running max, sum
    and output accumulator. Inlined by Triton into each kernel.

    A row may have no finite score yet (a sliding window's rows start at different keys, so a
    block can hide every key from some of them): its max is then taken as 0 for the exponents,
    so its weights stay exact zeros instead of NaN (-inf - -inf); a finite max is used as is."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def scaled_scores(qk, qk_scale, sm_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw dot products `qk` as base-2 scores: times `qk_scale` (sm_scale * log2(e)), or with
    `SOFTCAP` Gemma 2's `softcap * tanh(qk * sm_scale / softcap)` first (transformers' order:
    scale, cap, then the mask), then times log2(e). tanh(x) = 2 / (1 + exp(-2x)) - 1: exact
    limits (+-1) at large |x|, ~1e-7 absolute error near 0."""
    if SOFTCAP:
        x = qk * (sm_scale / softcap)
        return softcap * (2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0) * 1.4426950408889634
    return qk * qk_scale
