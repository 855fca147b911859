"""Random GGUF-style quantized blocks for the block-kernel tests (bf16 and fp32 activations):
codes in range and fp16-exact scales (and offsets), as a GGUF file stores them."""

from __future__ import annotations

import torch

from engine.layers.int4 import Q4Blocks
from engine.layers.q8 import Q8Blocks


def random_q4(n: int, k: int, seed: int) -> Q4Blocks:
    """Q4_1-like blocks of 32: codes 0..15, positive scales, non-positive offsets."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    offset = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    return Q4Blocks(q, scale, offset, 32)


def random_q8(n: int, k: int, seed: int) -> Q8Blocks:
    """Q8_0 blocks of 32: codes -127..127, non-negative scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return Q8Blocks(q, (torch.rand(n, k // 32, generator=g) * 0.02).half().float())
