"""Greedy verification of drafts: which drafted tokens the target model agrees with.

A verify forward runs each request's last token followed by its drafts (k + 1 query tokens over
its KV, an ordinary extend) and returns the argmax at every position. Draft j is accepted while
it equals the argmax after the tokens before it; the argmax at the first disagreement (or after
the last draft) is the next token the target would have produced anyway. So a greedy request
emits exactly the tokens plain decoding would (accepted + 1 per forward), only in fewer forwards.

Requests that do not speculate ride in the same forward with no drafts: their one position is
sampled by the ordinary sampler (temperature, penalties, grammar, logprobs all apply).
"""

from __future__ import annotations


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
