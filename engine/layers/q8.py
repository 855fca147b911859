"""GGUF 8-bit (Q8_0) weights and their form for our small-batch CPU kernel.

The LM head of a small model is the largest single read of a decode step (SmolLM2-135M: 49152 x
576, 56.6 MB in bf16, 43% of a bs-1 step's bytes). GGUF files usually store it, tied to the
embedding, as Q8_0: 32 int8 codes and one fp16 scale per block, 30 MB. Our kernel
(engine/kernels/cpu_quant.py) reads those blocks as they are, so a few rows of logits cost about
half the bytes, computed from the file's exact values (the bf16 table rounds each d * q to 8
significant bits; this form does not). In an fp32 model the dense head holds 4 bytes a weight,
so the blocks are a quarter of its read. `linear.QuantLinear` uses it for up to a measured number
of rows and the dense form (oneDNN's in bf16) beyond.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import cpu_quant


@dataclass
class Q8Blocks:
    """W[n, k] = scale[n, k // 32] * q[n, k]: GGUF Q8_0, unpacked."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K // 32]

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (exactly gguf's own dequantization)."""
        n, k = self.q.shape
        return (self.q.float().view(n, k // cpu_quant.BLOCK, cpu_quant.BLOCK) * self.scale.unsqueeze(-1)).view(n, k)

    @staticmethod
    def cat(parts: list[Q8Blocks]) -> Q8Blocks:
        """Rows concatenated, as the fused q|k|v and gate|up weights are."""
        return Q8Blocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))

    def pack(self, dtype: torch.dtype = torch.bfloat16) -> Q8Weight | None:
        """Our kernel's form for a model computing in `dtype`, or None where it does not apply (no
        vectorized build for that dtype, K not a multiple of 64, scales not fp16)."""
        k = self.q.shape[1]
        if not (cpu_quant.vectorized(dtype) and k % cpu_quant.CHUNK == 0 and cpu_quant.exact_in_fp16(self.scale)):
            return None
        return Q8Weight(self.q.contiguous(), self.scale.to(torch.float16).contiguous())


@dataclass
class Q8Weight:
    """Q8_0 blocks as our kernel reads them: int8 codes [N, K], fp16 scales [N, K // 32]."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for a bf16 or fp32 x of shape [..., K]."""
        rows = x.numel() // self.in_features
        out = cpu_quant.q8_gemv(x.reshape(rows, self.in_features).contiguous(), self.codes, self.scales)
        return out.view(*x.shape[:-1], self.out_features)
