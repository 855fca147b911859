"""Rejection sampling of drafts for a request that samples (temperature > 0).

An n-gram draft is a point mass: the drafter proposes token d with probability 1. Speculative
sampling then accepts d with probability p(d) (p: the target's sampling distribution at that
position, after temperature, top-k, top-p and min-p); on a rejection it draws from the residual
max(0, p - q) renormalised, which is p without d; after every draft is accepted it draws the
next token from p at the last position. Each emitted token is then distributed exactly as when
sampling one token per forward (Leviathan et al., 2023; Chen et al., 2023), so speculation
changes how fast a sampled request decodes, never what it samples.

Randomness stays a pure function of (seed, step): the draw at output position t uses the same
counter stream a decode at step t would (`counter_uniforms`), and the acceptance test at step t
uses a separate stream (`ACCEPT_STREAM` added to the step), independent of that draw.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.sampling.counter_rng import counter_uniforms
from engine.sampling.sampler import SamplingBatchInfo, filtered_probs

ACCEPT_STREAM = 1 << 40  # step offset of the acceptance uniforms: far from any real step


def sample_drafted(logits: Tensor, drafts: list[int], info: SamplingBatchInfo, row: int) -> tuple[int, int]:
    """(next token, accepted drafts) for batch row `row`, whose verify forward produced `logits`
    (`[len(drafts) + 1, V]`: its last token's position, then each draft's). Its step in `info` is
    the one after the last draft (the batch counts the drafts' KV as generated)."""
    n = logits.shape[0]
    pick = torch.full((n,), row, dtype=torch.int64, device=logits.device)
    probs = filtered_probs(
        logits.float(), info.temperatures[pick], info.top_ps[pick], info.top_ks[pick], info.min_ps[pick], info
    )
    first_step = int(info.steps[row]) - len(drafts)  # the step a decode of this position would have
    seeds = info.seeds[pick]
    steps = torch.arange(first_step, first_step + n, dtype=torch.int64, device=logits.device)
    vocab = probs.shape[-1]
    draft_ids = torch.tensor(drafts, dtype=torch.int64, device=logits.device)
    p_draft = (probs[:-1].gather(1, draft_ids[:, None])[:, 0] / probs[:-1].sum(-1)).tolist()
    accept_u = counter_uniforms(seeds[:-1], steps[:-1] + ACCEPT_STREAM, 1)[:, 0].tolist()
    accepted = 0
    while accepted < len(drafts) and accept_u[accepted] < p_draft[accepted]:
        accepted += 1
    at = probs[accepted : accepted + 1].clone()
    if accepted < len(drafts):  # rejected: the residual, p without the draft
        at[0, drafts[accepted]] = 0.0
    exponentials = counter_uniforms(seeds[accepted : accepted + 1], steps[accepted : accepted + 1], vocab)
    return int(at.div_(exponentials.log_().neg_()).argmax(dim=-1)), accepted
