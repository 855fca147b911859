"""The token embedding table (its weight doubles as the LM head's when the model ties them).

Under tensor parallelism each rank holds `shard.vocab_rows` rows starting at `shard.vocab_start`
(engine/distributed/sharding.py): a token outside the shard looks up zeros there, and the
all-reduce over ranks leaves each token's one real row.

`multiplier` (Granite's `embedding_multiplier`, Gemma's sqrt(hidden)) scales the looked-up rows,
in the model's dtype; `multiplier_in_dtype` (Gemma) rounds the multiplier to that dtype first, as
transformers' Gemma does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import TPGroup


class VocabEmbedding(nn.Module):
    """`weight[input_ids]`: a fresh `[num_tokens, hidden]` tensor (the forward's residual stream)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
        vocab_start: int = 0,
        multiplier: float = 1.0,
        multiplier_in_dtype: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype), False)
        self.tp = tp if tp is not None else TPGroup.single()
        self.vocab_start = vocab_start
        self.multiplier: float | torch.Tensor = multiplier
        if multiplier_in_dtype and multiplier != 1.0:
            self.multiplier = torch.tensor(multiplier, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            x = F.embedding(input_ids, self.weight)
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.weight.shape[0])
            x = F.embedding(local.masked_fill(outside, 0), self.weight)
            x.masked_fill_(outside.unsqueeze(-1), 0)
            x = self.tp.all_reduce(x)
        return x if isinstance(self.multiplier, float) and self.multiplier == 1.0 else x * self.multiplier

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)
