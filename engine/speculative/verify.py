"""Greedy verification of drafts: which drafted tokens the target model agrees with.

A verify forward runs each request's last token followed by its drafts (k + 1 query tokens over
its KV, an ordinary extend) and returns the argmax at every position. Draft j is accepted while
it equals the argmax after the tokens before it; the argmax at the first disagreement (or after
the last draft) is the next token the target would have produced anyway. So a greedy request
emits exactly the tokens plain decoding would (accepted + 1 per forward), only in fewer forwards.

A request that samples (temperature > 0) checks its drafts by rejection sampling instead
(engine/sampling/speculative_sampling.py): what it samples is distributed as without drafts.

Requests that do not speculate ride in the same forward with no drafts: their one position is
sampled by the ordinary sampler (temperature, penalties, grammar, logprobs all apply).
"""

from __future__ import annotations

from torch import Tensor

from engine.sampling import SamplingBatchInfo, greedy_ids
from engine.sampling.speculative_sampling import sample_drafted


def verify_batch(
    logits: Tensor, input_ids: list[int], extend_lens: list[int], sampled: list[int], info: SamplingBatchInfo
) -> tuple[list[int], list[int]]:
    """(next token, accepted drafts) per request of a verify forward (`logits`: every position's):
    greedy requests by argmax agreement, sampling ones by rejection sampling."""
    next_ids, accepted = accept_drafts(input_ids, extend_lens, greedy_ids(logits).tolist(), sampled)
    if info.is_all_greedy:
        return next_ids, accepted
    rows = range(len(extend_lens)) if info.sample_indices is None else info.sample_indices.tolist()
    starts = [0]
    for n in extend_lens:
        starts.append(starts[-1] + n)
    for i in rows:
        n = extend_lens[i]
        if n > 1:
            drafts = input_ids[starts[i] + 1 : starts[i] + n]
            next_ids[i], accepted[i] = sample_drafted(logits[starts[i] : starts[i] + n], drafts, info, i)
    return next_ids, accepted


def accept_drafts(
    input_ids: list[int], extend_lens: list[int], argmax_ids: list[int], sampled: list[int]
) -> tuple[list[int], list[int]]:
    """(next token, accepted draft count) per request.

    `input_ids` / `argmax_ids`: the forward's flat tokens and the argmax at each; request i owns
    `extend_lens[i]` of them: its last token, then its drafts. `sampled[i]`: the sampler's pick at
    request i's last position, the next token of a request that drafted nothing.
    """
    next_ids, accepted = [], []
    start = 0
    for i, n in enumerate(extend_lens):
        if n == 1:
            next_ids.append(sampled[i])
            accepted.append(0)
        else:
            drafts, guess = input_ids[start + 1 : start + n], argmax_ids[start : start + n]
            a = 0
            while a < len(drafts) and drafts[a] == guess[a]:
                a += 1
            next_ids.append(guess[a])
            accepted.append(a)
        start += n
    return next_ids, accepted
