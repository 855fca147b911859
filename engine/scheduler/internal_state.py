"""The scheduler's run-time state for operators: what `get_internal_state` reports
(`scheduler_state`), and the knobs `set_internal_state` may change (`check_internal_state`):
which exist and what values they take, checked by the caller before anything is sent, so a bad
one is an InvalidRequestError naming it and changes nothing."""

from __future__ import annotations

import time
from typing import Any

from engine.cache.swa_pool import SWATokenToKVPoolAllocator
from engine.errors import InvalidRequestError
from engine.scheduler.scheduler import Scheduler


def check_internal_state(state: dict) -> dict[str, int | float]:
    """The settable scheduler knobs in `state`, validated: InvalidRequestError names a bad one."""
    out: dict[str, int | float] = {}
    for key, value in state.items():
        if key == "max_running_requests":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"max_running_requests must be an integer >= 1, got {value!r}", key)
        elif key == "new_token_ratio":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise InvalidRequestError(f"new_token_ratio must be a number in [0, 1], got {value!r}", key)
            value = float(value)
        else:
            settable = ["max_running_requests", "new_token_ratio"]
            raise InvalidRequestError(f"cannot set {key!r}; settable: {settable}", key)
        out[key] = value
    return out


def scheduler_state(sched: Scheduler) -> dict[str, Any]:
    """The scheduler's counters and memory, as `get_internal_state` reports them."""
    elapsed = max(time.perf_counter() - sched.started_at, 1e-9)
    size = sched.allocator.size
    available, evictable = sched.allocator.available_size(), sched.tree_cache.evictable_size()
    swa = sched.allocator if isinstance(sched.allocator, SWATokenToKVPoolAllocator) else None
    return {
        "running_requests": len([r for r in sched.running_batch.reqs if not r.finished()]),
        "waiting_requests": sched.num_waiting + (1 if sched.chunked_req is not None else 0),
        "total_tokens": size,
        "available_tokens": available,
        "evictable_tokens": evictable,
        "protected_tokens": sched.tree_cache.protected_size(),
        "token_usage": 1.0 - (available + evictable) / size,
        "cache_hit_rate": sched.hit_tokens / sched.prompt_tokens if sched.prompt_tokens else 0.0,
        "new_token_ratio": sched.new_token_ratio,
        "num_retractions": sched.num_retractions,
        "generated_tokens": sched.generated_tokens,
        "gen_throughput": sched.generated_tokens / elapsed,
        "max_running_requests": sched.max_running_requests,
        "grammar_steps": sched.grammar_steps,
        "grammar_mask_fill_s": sched.grammar_mask_fill_s,
        "grammar_mask_apply_s": sched.grammar_mask_apply_s,
        "page_size": sched.page_size,
        # hybrid SWA memory (engine/cache/swa_pool.py): the local layers' pool (None: off)
        "swa_tokens": swa.swa.size if swa is not None else None,
        "swa_used_tokens": swa.swa_used() if swa is not None else None,
        "radix_cache": not sched.args.disable_radix_cache,
        # n-gram speculative decoding: verify forwards, drafted and accepted tokens (None: off)
        "speculative": sched.speculation.stats() if sched.speculation is not None else None,
    }
