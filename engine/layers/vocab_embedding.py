"""The token embedding table (its weight doubles as the LM head's when the model ties them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """`weight[input_ids]`: a fresh `[num_tokens, hidden]` tensor (the forward's residual stream)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype), False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)
