"""Prompt log-probs, scored in the prefill forward that computes the prompt.

The model keeps the final hidden states of the rows the scheduler asked for
(`ForwardBatch.prompt_hidden`, see `PromptLogprobPlan`); here they go through the LM head a slice
of `SLICE_ROWS` at a time, so a long prompt never holds a `[prompt_len, vocab]` logits tensor:
at most `[SLICE_ROWS, vocab]` float32 (about 100 MB at a 49k vocabulary) and its log-softmax.

Log-probs are raw (the model's log_softmax, no bias, penalties or temperature), as the sampler
reports output log-probs and as transformers computes them for an evaluation harness. Under tensor
parallelism every rank runs the same slices (the head's gather is a collective); only rank 0 gets
values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_executor.forward_batch_info import PromptLogprobPlan

SLICE_ROWS = 512


@dataclass
class PromptLogprobsOut:
    """Per scored row, in the plan's order: the log-prob of its target token and, when the plan
    asked for them, the top-N (values, ids)."""

    counts: list[int]  # rows per request of the batch, in batch order (the plan's)
    values: torch.Tensor  # [R] float32
    top_val: torch.Tensor | None = None  # [R, N] float32
    top_idx: torch.Tensor | None = None  # [R, N] int64


def score_prompt(model, hidden: torch.Tensor, plan: PromptLogprobPlan) -> PromptLogprobsOut | None:
    """Score `hidden` (the plan's rows, pre-norm) against the plan's targets; None on a rank that
    receives no logits."""
    targets = torch.tensor(plan.targets, dtype=torch.int64, device=hidden.device)
    values, top_vals, top_idxs = [], [], []
    for lo in range(0, hidden.shape[0], SLICE_ROWS):
        logits = model.compute_logits(hidden[lo : lo + SLICE_ROWS])
        if logits is None:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        del logits
        values.append(logprobs.gather(1, targets[lo : lo + SLICE_ROWS, None]).squeeze(1))
        if plan.top_n:
            val, idx = logprobs.topk(plan.top_n, dim=-1)
            top_vals.append(val)
            top_idxs.append(idx)
    if not values:
        return None
    return PromptLogprobsOut(
        plan.counts,
        torch.cat(values),
        torch.cat(top_vals) if top_vals else None,
        torch.cat(top_idxs) if top_idxs else None,
    )
