"""The two-level scales of llama.cpp's K-quants (Q4_K, Q5_K, Q6_K), kept as factors for our kernels.

A K-quant stores each small group's scale (and, for Q4_K and Q5_K, its minimum) as a small integer `sc`
(`m`) and each 256 weights' fp16 `d` (`dmin`): scale = d * sc, offset = -(dmin * m). The products
are exact in fp32 but not in fp16, so the 4-bit kernel's fp16-scale form (int4.py `Q4Blocks.pack`)
cannot hold them; the kernels' K forms (engine/kernels/cpu_quant.py `q4k_pack`, `q8_gemv` with
supers) read the factors and multiply them per block, which also reads fewer scale bytes. The
block dataclasses carry these factors next to their exact fp32 scales; rows permute and
concatenate alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class SuperScales:
    """scale[n, g] = d[n, g // per] * sc[n, g]; offset[n, g] = -(dmin[n, g // per] * m[n, g]) (Q4_K
    and Q5_K only), with `per` groups in 256 weights."""

    d: torch.Tensor  # float32 [N, K // 256], fp16 values
    sc: torch.Tensor  # uint8 (Q4_K, Q5_K: 0..63) or int8 (Q6_K) [N, K // group]
    dmin: torch.Tensor | None = None  # float32 [N, K // 256], fp16 values
    m: torch.Tensor | None = None  # uint8 [N, K // group], 0..63

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SuperScales:
        """The same factors with `fn` (a row permutation over dim 0) applied to each array."""
        return SuperScales(*(None if t is None else fn(t) for t in (self.d, self.sc, self.dmin, self.m)))

    @staticmethod
    def cat(parts: list[SuperScales | None]) -> SuperScales | None:
        """Rows concatenated; None unless every part has factors of one kind."""
        first = parts[0]
        if first is None or any(p is None or (p.m is None) != (first.m is None) for p in parts):
            return None
        fields = zip(*((p.d, p.sc, p.dmin, p.m) for p in parts if p is not None))
        return SuperScales(*(None if f[0] is None else torch.cat(f) for f in fields))
