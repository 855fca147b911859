"""A mixture-of-experts layer's experts in a GGUF's own blocks, bf16 or fp32 models
(csrc/cpu_moe_quant.cpp).

A decode step of a MoE model reads its routed experts' weights: in bf16 3.5x the bytes a Q4_K
file stores them in, in fp32 7x. `QuantExperts` keeps each expert's gate|up and down in the block
forms the dense projections take (linear.pack_parts: Q4_0/Q4_1/Q4_K tiles, Q8_0, Q6_K/Q5_K, a
gate|up whose halves came in different kinds side by side) and runs a forward's experts in one
C++ call. Every product is what a `QuantLinear` runs for its rows: the small-batch block loops up
to the model's measured row bound, the blocks' dequantized tiles above it. So the weights are the
file's values exactly, and the experts need no dense copy (`FusedMoE` drops it).

Built only where every expert of this rank came with whole blocks (a tensor-parallel slice has
none) that a kernel form takes for the model's dtype on this CPU; otherwise the layer stays dense.
While loading, a kept projection's dense values are never written (a 30B MoE file's experts would
be ~60 GB in bf16); a layer that turns out dense gets them from the blocks kept so far (`held`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.kernels import cpu_extension, cpu_quant
from engine.layers.int4 import Q4Blocks, TiledQ4Weight
from engine.layers.linear import QuantParts, QuantWeight, native_blocks, pack_parts
from engine.layers.q8 import Q8Blocks, Q8Weight

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # an expert's checkpoint projections


class QuantExperts:
    """Experts `[start, start + count)` in blocks, filled one projection at a time as they load."""

    def __init__(self, start: int, count: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        self.start, self.count, self.dtype = start, count, dtype
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self._parts: dict[int, dict[str, Q4Blocks | Q8Blocks]] = {}  # an expert's projections until all three are in
        self._forms: dict[int, tuple[QuantWeight, QuantWeight]] = {}  # (gate|up, down) by expert
        self.native = None  # the C++ experts (cpu_moe_quant.cpp), once `finish` built them
        self.forms: list[tuple[QuantWeight, QuantWeight]] = []  # (gate|up, down) of each expert, once built

    @staticmethod
    def available(dtype: torch.dtype) -> bool:
        """Whether this CPU runs block forms for `dtype` activations with our vector loops."""
        return dtype in (torch.bfloat16, torch.float32) and cpu_quant.vectorized(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of every expert's blocks (once built)."""
        return sum(form.nbytes for forms in self.forms for form in forms)

    def add(self, expert: int, proj: str, blocks: Q4Blocks | Q8Blocks) -> bool:
        """Keep a loaded projection's blocks; False once an expert's blocks have no kernel form
        here (the layer then goes dense: `held` gives what was kept)."""
        parts = self._parts.setdefault(expert, {})
        parts[proj] = blocks
        if len(parts) < len(EXPERT_PROJS):
            return True
        w13 = pack_parts([parts["gate_proj"], parts["up_proj"]], self.dtype)
        w2 = pack_parts([parts["down_proj"]], self.dtype)
        ours = (TiledQ4Weight, Q8Weight, QuantParts)  # forms the C++ projections run (not torch's int4pack)
        if not (isinstance(w13, ours) and isinstance(w2, ours)):
            return False
        del self._parts[expert]
        self._forms[expert] = (w13, w2)
        return True

    def held(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """(expert, "gate_up" | "down" | a checkpoint projection, fp32 values) of every weight kept
        so far: the values a layer that goes dense copies in."""
        for e, (w13, w2) in self._forms.items():
            yield e, "gate_up", w13.dequantize(torch.float32)
            yield e, "down", w2.dequantize(torch.float32)
        for e, parts in self._parts.items():
            for proj, blocks in parts.items():
                yield e, proj, blocks.dequantize()

    def finish(self, row_bound: int) -> bool:
        """Build the C++ experts if all are in (products of more than `row_bound` rows per expert
        run the dequantized tiles); False (nothing built, `held` intact) otherwise."""
        if self._parts or len(self._forms) != self.count:
            return False
        native = cpu_extension.module_or_raise().QuantExperts(self.hidden_size, self.intermediate_size, row_bound)
        self.forms = [self._forms.pop(e) for e in range(self.start, self.start + self.count)]
        for forms in self.forms:
            args = []
            for form in forms:
                tensors, pieces = native_blocks(form)
                args += [tensors, [p for p, _ in pieces], [w for _, w in pieces]]
            native.add_expert(*args)
        self.native = native
        return True

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's gate|up `[E, 2I, H]` and down `[E, H, I]` in `dtype` (the exact values
        rounded once), for a layer that goes back to its dense experts."""
        return tuple(torch.stack([f[i].dequantize(dtype) for f in self.forms]) for i in range(2))

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of `weight * expert(x)` (ids relative to `start`)."""
        return self.native.forward(x, ids, weights)
