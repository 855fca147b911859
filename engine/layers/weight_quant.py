"""Weight-only quantization of a bf16 checkpoint as it loads (`--torchao-config`, SGLang's flag
and value names): `int8wo` and `int4wo-<group>`.

Why: a decode step of a few streams reads every weight once, so its time is the weights' bytes
over the memory bandwidth; a 1B-class model in bf16 reads ~2 GB a token. Stored in 8 or 4 bits
the same step reads about a half or a quarter of that. GGUF files arrive quantized; this gives a
Hugging Face checkpoint the same forms, computed here instead of by llama.cpp's converter:

- `int8wo`: GGUF's Q8_0 (32 int8 codes and one fp16 scale per 32 weights along a row, symmetric:
  scale = max |w| / 127), read by our Q8_0 kernel (engine/kernels/cpu_quant.py). Finer than
  torchao's per-channel int8 (one scale per row): the same bytes to within 6%, less error.
- `int4wo-G` (G in 32, 64, 128, 256; torchao's default is 128): asymmetric 4-bit groups of G
  weights along a row (scale = (max - min) / 15, offset = min, both fp16, as GGUF's Q4_1 at
  G = 32), read by our tiled 4-bit kernel.

What runs: exactly what a GGUF of that form runs (linear.QuantLinear). Every decoder-layer
projection keeps its quantized form for a forward of up to the measured crossover rows
(int4_crossover.py) and its dense form (the model's dtype), whose values are the quantized
weights dequantized, above it, so a prefill and a decode compute with the same weights. The embedding, the LM head,
norms and MoE experts stay as stored. The kernels run bf16 or fp32 on a CPU (fp32: the exact
quantized values, so transformers on the same values is the reference, and on a CPU without
bf16 instructions the decode reads an eighth or a quarter of the dense fp32 bytes); on another
device or dtype, or with deterministic inference (dense only), the model computes densely with
the quantized values. One rank only (ServerArgs refuses tensor parallelism: a row-parallel slice
would put the groups at other columns). A GGUF is refused: it is quantized already.
Weight updates: `update_weights_from_disk` quantizes the new checkpoint as it loads;
`update_weights_from_tensor` serves a trainer's values as given (dense), as for a GGUF.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import cpu_quant
from engine.layers.int4 import Q4Blocks
from engine.layers.q8 import Q8Blocks

INT4_GROUP_SIZES = (32, 64, 128, 256)
TORCHAO_CONFIGS = ("int8wo", *(f"int4wo-{g}" for g in INT4_GROUP_SIZES))


@dataclass(frozen=True)
class WeightOnlyQuant:
    """One `--torchao-config` value: `bits` 8 or 4, `group_size` weights per scale."""

    bits: int
    group_size: int

    @classmethod
    def parse(cls, spec: str | None) -> WeightOnlyQuant | None:
        """The config `spec` names (None or "" for none); ValueError for any other value."""
        if not spec:
            return None
        if spec not in TORCHAO_CONFIGS:
            raise ValueError(f"torchao_config {spec!r} is not supported; use one of {', '.join(TORCHAO_CONFIGS)}")
        if spec == "int8wo":
            return cls(8, cpu_quant.BLOCK)
        return cls(4, int(spec.removeprefix("int4wo-")))

    def applies_to(self, weight: torch.Tensor) -> bool:
        """Whether this 2-D weight `[out, in]` can take the kernel's form (K a multiple of 64 and
        of the group size); others stay dense."""
        k = weight.shape[-1]
        return weight.dim() == 2 and k % cpu_quant.CHUNK == 0 and k % self.group_size == 0

    def quantize(self, weight: torch.Tensor) -> Q8Blocks | Q4Blocks:
        """The blocks of `weight` (any float dtype, `[out, in]`); `.dequantize()` gives the values
        the model then computes with."""
        w = weight.detach().float()
        return quantize_q8(w) if self.bits == 8 else quantize_q4(w, self.group_size)


def quantize_q8(w: torch.Tensor) -> Q8Blocks:
    """Q8_0 as llama.cpp writes it: per 32 weights d = max|w| / 127 (as fp16), q = round(w / d)."""
    n, k = w.shape
    groups = w.view(n, k // cpu_quant.BLOCK, cpu_quant.BLOCK)
    scale = (groups.abs().amax(dim=-1) / 127.0).to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(groups / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return Q8Blocks(q.view(n, k), scale)


def quantize_q4(w: torch.Tensor, group_size: int) -> Q4Blocks:
    """Asymmetric 4-bit groups: offset = min, scale = (max - min) / 15 (both as fp16, which the
    kernel reads exactly), q = round((w - offset) / scale) in 0..15."""
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    offset = lo.to(torch.float16).float()
    scale = ((hi - offset) / 15.0).to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - offset.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    return Q4Blocks(q.view(n, k), scale, offset, group_size)
