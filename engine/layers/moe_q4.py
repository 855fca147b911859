"""A mixture-of-experts layer's experts in 4 bits: a GGUF's own Q4_0/Q4_1 blocks for fp32 decodes.

An fp32 MoE decode step reads the routed experts' weights, 4 bytes a weight in the dense form; a
GGUF stores them in 4.5-5 bits. `Q4Experts` keeps every expert's gate|up and down blocks in the
tiled layout of the 4-bit CPU kernels (engine/kernels/cpu_quant.py), stacked over the experts, and
`csrc/cpu_moe.cpp`'s `moe_experts_q4` runs a forward's experts from them in one call: the weights'
exact values (an exact conversion of each code), fp32 sums in q4_gemv_f32's order.

The layer keeps its dense experts too (prefills run them: the 4-bit loops are compute-bound past a
few rows), as the dense projections keep both forms (linear.QuantLinear); the 4-bit form costs
about a sixth of the fp32 one on top. Built only when every expert of this rank came with 4-bit
blocks whose shape the kernel takes (K a multiple of 64, scales and offsets exact in fp16), on a
CPU whose fp32 4-bit loops are vectorized; otherwise the layer stays dense only.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_quant
from engine.layers.int4 import Q4Blocks, TiledQ4Weight

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # an expert's checkpoint projections


class Q4Experts:
    """4-bit experts `[start, start + count)`, filled one projection at a time as they load."""

    def __init__(self, start: int, count: int, intermediate_size: int) -> None:
        self.start, self.count, self.intermediate_size = start, count, intermediate_size
        self._parts: dict[int, dict[str, Q4Blocks]] = {}  # an expert's projections until all three are in
        self._packed: dict[int, tuple[cpu_quant.Q4Packed, cpu_quant.Q4Packed]] = {}  # (w13, w2) by expert
        self.complete = True  # False once some projection came without blocks (or cannot be packed)
        self.w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # codes, scales, offsets
        self.w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def available() -> bool:
        return cpu_quant.vectorized(torch.float32)

    def add(self, expert: int, proj: str, blocks: Q4Blocks | None) -> None:
        """A loaded projection's blocks (None: it came dense only)."""
        if blocks is None or not self.complete:
            self.complete = False
            self._parts.clear()
            return
        parts = self._parts.setdefault(expert, {})
        parts[proj] = blocks
        if len(parts) < len(EXPERT_PROJS):
            return
        del self._parts[expert]
        w13 = Q4Blocks.cat([parts["gate_proj"], parts["up_proj"]]).pack(torch.float32)
        w2 = parts["down_proj"].pack(torch.float32)
        # the experts' kernel reads fp16 scales only (Q4_K experts stay dense)
        fp16_tiles = isinstance(w13, TiledQ4Weight) and isinstance(w2, TiledQ4Weight)
        if not fp16_tiles or w13.tiles.k_form or w2.tiles.k_form:
            self.complete = False
            return
        self._packed[expert] = (w13.tiles, w2.tiles)

    def finish(self) -> bool:
        """Stack the experts' arrays once all are in; False (and nothing kept) otherwise."""
        ready = self.complete and not self._parts and len(self._packed) == self.count
        if ready:
            order = [self._packed[e] for e in range(self.start, self.start + self.count)]
            for i, name in enumerate(("w13", "w2")):
                arrays = tuple(torch.stack([getattr(p[i], a) for p in order]) for a in ("codes", "scales", "offsets"))
                setattr(self, name, arrays)
        self._parts.clear()
        self._packed.clear()
        return ready

    def run(self, kernel, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of `weight * expert(x)` (ids relative to `start`)."""
        return kernel.moe_experts_q4(x, *self.w13, *self.w2, self.intermediate_size, ids, weights)
