"""fp32 products of a few rows on CPUs (csrc/cpu_gemv.cpp): the projections of an fp32 decode step.

A decode step of a small batch reads every weight once: its time is the bytes over the memory
bandwidth. torch's `F.linear` gives 1-8 fp32 rows to MKL, which streamed the weights at 6-11 GB/s
on one thread of a 2-core AMD Zen 3 (AVX2) whose two threads read 30 GB/s; this loop reads each
weight row once for all the rows, on every thread (27 GB/s for one row there). `DenseLinear` takes
it for inputs of at most `MAX_ROWS` rows when the model is fp32 on a CPU (linear.finalize_linear).

Each output is a fixed-order sum over its row (independent of the thread count and of the other
rows), within fp32 rounding of MKL's: greedy tokens stay transformers' (tests/test_cpu_gemv.py).
"""

from __future__ import annotations

import torch

from engine.kernels.cpu_extension import load, module_or_raise

__all__ = ["MAX_ROWS", "available", "available_for", "gemv", "gemv_groups"]

# Rows the loop takes. Measured over the default model's projections, 2 threads: 1, 2, 4, 8 rows
# in 20, 20, 29, 49 ms against MKL's 50, 91, 81, 66; MKL wins from about 16.
MAX_ROWS = 8


def available(weight: torch.Tensor) -> bool:
    """Whether a projection holding `weight` can use the loop: fp32 on a CPU, the extension built."""
    return available_for(weight.dtype, weight.device)


def available_for(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether projections holding `dtype` weights on `device` can use the loop."""
    return device.type == "cpu" and dtype == torch.float32 and load() is not None


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for an fp32 `[M, K]` x with 1 <= M <= MAX_ROWS, `w` `[N, K]`."""
    return module_or_raise().gemv_f32(x, w, bias)


def gemv_groups(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gemv` for any number of rows, MAX_ROWS at a time: each row's result is the same bits as
    alone (deterministic inference's decode projections, linear.BatchInvariantLinear)."""
    if x.shape[0] <= MAX_ROWS:
        return gemv(x, w, bias) if x.shape[0] else x.new_empty(0, w.shape[0])
    return torch.cat([gemv(x[i : i + MAX_ROWS], w, bias) for i in range(0, x.shape[0], MAX_ROWS)])
