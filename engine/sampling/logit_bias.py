"""OpenAI's `logit_bias`: per-request additive biases on chosen token ids, batched sparsely.

A request's map `{token id: bias}` is turned into two numpy arrays once, when the request is
created (`LogitBias.from_params`), because the map never changes and the scheduler rebuilds the
batch's sampling state every step. Per step, `pack_logit_bias` concatenates the arrays of the rows
that have one into a flat index (row * vocab + token) and a value vector: numpy work proportional
to the entries, one Python iteration per *biased* row, none per token. The sampler then adds them
to a float32 copy of the logits with one `index_add_`, on whatever device the logits live.

The representation is sparse on purpose: entries per request are bounded
(`MAX_LOGIT_BIAS_ENTRIES`), so a step costs O(entries in the batch), never O(batch * vocab).
Dict keys are unique, so no index repeats within a row and `index_add_` is deterministic on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class LogitBias:
    """One request's bias as arrays: `tokens` int64 [N] and `values` float32 [N], N >= 1."""

    tokens: np.ndarray
    values: np.ndarray

    @classmethod
    def from_params(cls, params: SamplingParams) -> LogitBias | None:
        """The arrays of a *verified* request's `logit_bias` (None when it has none or it is empty)."""
        bias = params.logit_bias
        if not bias:
            return None
        n = len(bias)
        return cls(np.fromiter(bias.keys(), np.int64, n), np.fromiter(bias.values(), np.float32, n))


def pack_logit_bias(biases: Sequence[LogitBias | None], vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(flat index row * vocab_size + token [M] int64, values [M] float32) over the batch's rows.

    None when no row has a bias. Ids outside [0, vocab_size) are dropped rather than trusted:
    `verify` rejects them at submit, and an out-of-range flat index would bias the *next* row's
    token (or fault the device) instead of failing loudly.
    """
    rows = [(i, b) for i, b in enumerate(biases) if b is not None]
    if not rows:
        return None
    tokens = np.concatenate([b.tokens for _, b in rows])
    values = np.concatenate([b.values for _, b in rows])
    row_ids = np.repeat(np.fromiter((i for i, _ in rows), np.int64, len(rows)), [len(b.tokens) for _, b in rows])
    keep = (tokens >= 0) & (tokens < vocab_size)
    if not keep.all():
        tokens, values, row_ids = tokens[keep], values[keep], row_ids[keep]
        if tokens.size == 0:
            return None
    return row_ids * vocab_size + tokens, values


def apply_logit_bias(logits: Tensor, index: Tensor, values: Tensor) -> Tensor:
    """A float32, contiguous copy of `logits` [B, V] with `values` added at the flat `index`.

    The input is never modified (under CUDA graphs it is the graph's static output buffer). Rows
    without a bias come out equal to `logits.float()`, bit for bit.
    """
    x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    x.view(-1).index_add_(0, index, values)
    return x
