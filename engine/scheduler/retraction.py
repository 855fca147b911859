"""How much room decoding needs, and how retraction moves `new_token_ratio` (seed 004).

`Scheduler.update_running_batch` uses these. When the running batch cannot grow by one token,
requests are retracted (`Scheduler.retract_one`: fewest retractions so far, then least progress)
until those left can decode `RETRACT_DECODE_STEPS` more tokens each, and the ratio is raised
(`retract_ratio`) so the admission budget keeps that room for them. Retracting only enough for
one step leaves the pool full: the next page boundary retracts again, a request every few steps,
each one re-prefilled later.

`new_token_ratio` is the share of a running request's remaining max_new_tokens that the admission
budget reserves for it (policy.py, `PrefillAdder.running_reservation`). It starts at
`INIT_NEW_TOKEN_RATIO`, decays by `NEW_TOKEN_RATIO_DECAY` per decode step that needed no
retraction (down to `MIN_NEW_TOKEN_RATIO`), rises after a retraction, and is back at the initial
value once the engine goes idle: a burst's estimate says nothing about the next burst.
"""

from __future__ import annotations

from engine.scheduler.req import Req

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# SGLang's retract_decode_steps, same default: 20 tokens of slack per running request is little
# next to a pool of thousands, yet, unless an admission takes it, the next retraction is ~20 decode
# steps away instead of at the next page boundary.
RETRACT_DECODE_STEPS = 20


def decode_need(reqs: list[Req], steps: int, page_size: int) -> int:
    """KV slots `reqs` need to decode `steps` more tokens each, in whole pages.

    A request needs no more than it may still generate, and at least one token's worth (under
    overlap its last token may be in flight, so it can look done a step early). A request grows
    from its committed length: with pages, a new page is taken only at a page boundary.
    """
    need = 0
    for r in reqs:
        grow = max(1, min(steps, r.sampling_params.max_new_tokens - len(r.output_ids)))
        now = r.kv_committed_len
        need += (-(-(now + grow) // page_size) - -(-now // page_size)) * page_size
    return need


def retract_ratio(running: list[Req]) -> float:
    """The `new_token_ratio` a retraction calls for (SGLang's estimate): the requests left running
    are expected to use what they decoded so far plus `RETRACT_DECODE_STEPS` more, as a share of
    their max_new_tokens.

    The scheduler keeps the higher of this and its current ratio (SGLang takes this one as is): a
    retraction shows that the current ratio reserved too little, never too much.
    """
    total_max = sum(r.sampling_params.max_new_tokens for r in running) or 1
    decoded = sum(len(r.output_ids) for r in running)
    return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / total_max)
