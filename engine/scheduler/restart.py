"""What a stopped scheduler leaves to the next one over the same runner.

An `Engine` may stop and start again over its loaded model: `Engine.generate_batch` does once per
call, and `async with engine:` blocks may follow one another. Each start builds new actors and a
new `Scheduler`, while the runner's KV pool and request table live on. The first version built a
new, empty prefix cache each time: the old tree's slots stayed allocated with no owner, and the
next scheduler's first idle memory check crashed it (a second `generate_batch` of any prompt).

So the stopped scheduler hands over (`hand_over`, on the engine's stop, once the device is idle):
its prefix cache when no request holds memory and the memory invariant holds (a later call's
prompts hit what earlier calls cached, as in vLLM's and SGLang's offline engines); otherwise (a
stop mid-run, a crash) it frees every slot and row and hands over nothing. The next scheduler
starts from that cache, or from empty pools, and never beside slots nobody owns.
"""

from __future__ import annotations

from engine.cache.base_prefix_cache import BasePrefixCache
from engine.scheduler.launched import MemoryLeakError
from engine.scheduler.scheduler import Scheduler


def hand_over(sched: Scheduler, keep: bool = True) -> BasePrefixCache | None:
    """`sched`'s prefix cache for the next scheduler over its runner (when `keep` and nothing is
    held), else None with the runner's pools freed (see the module docstring)."""
    if keep and sched.holds_nothing():
        sched.running_batch.filter_batch()
        try:
            sched.check_memory()  # logs a violation (the busy -> idle edge would have raised it)
            return sched.tree_cache
        except MemoryLeakError:
            pass
    for req in sched.reqs_by_rid.values():  # the runner's LoRA pool outlives this scheduler
        sched.lora.unpin(req)
    sched.reqs_by_rid.clear()
    sched.allocator.clear()
    sched.req_to_token_pool.clear()
    return None
