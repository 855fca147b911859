"""The waiting queue and the admission decision: which waiting requests prefill next.

`PrefillPlanner` owns the waiting queue. Each round the scheduler, which owns memory and the
running batch, states what it can afford in a `PrefillBudget` (free + evictable KV minus what the
running decodes will still need, the prefill token limits, free request rows, the chunked
request to continue first, the prompt heads being computed now); the planner orders the queue by
the schedule policy, walks it with a `PrefillAdder` and answers with a `PrefillPlan`: the requests
to prefill (each with its prefix match: `prefix_indices`, `last_node`), removed from the queue.

The scheduler then applies the plan (`Scheduler.next_batch`): it locks the matched prefixes,
evicts, allocates, and hands back any request it could not place after all. In the engine the
planner lives in the PrefillAdder actor and budget and plan travel as messages; in a synchronous
step (`SyncScheduler`) the same object is called directly.

Requests in the queue hold no memory (no request row, no KV, no tree lock): that is what lets
a waiting request be dropped anywhere, at once.
"""

from __future__ import annotations

import msgspec

from engine.cache.base_prefix_cache import BasePrefixCache
from engine.scheduler.policy import PrefillAdder, SchedulePolicy
from engine.scheduler.req import Req


class PrefillBudget(msgspec.Struct, frozen=True):
    """What the scheduler can afford for the next prefill batch (see policy.py for each budget)."""

    rem_total_tokens: int
    rem_input_tokens: int
    rem_chunk_tokens: int | None
    max_new_reqs: int
    # The request whose prompt is being prefilled chunk by chunk: it continues first. Owned by the
    # scheduler throughout (it holds memory); the planner only sizes its next chunk.
    chunked_req: Req | None = None
    # `prompt_head`s of requests whose prompt is being computed now (not in the tree yet).
    in_flight_heads: list[tuple[int, ...]] = []
    # Multi-LoRA (scheduler/lora_admission.py): the adapters held requests pin now, and how many
    # distinct adapters a batch may have (0: LoRA off)
    lora_in_use: list[str] = []
    max_loras: int = 0


class PrefillPlan(msgspec.Struct):
    """The planner's answer: requests to prefill now, in batch order (a continued chunk first)."""

    reqs: list[Req]
    new_chunked_req: Req | None  # the request cut into a chunk this round (continues next round)
    hit_tokens: int  # prompt tokens the admitted requests found in the prefix cache
    input_tokens: int  # prompt tokens of the admitted requests (cached + to compute)
    num_waiting: int  # queue length after this plan


class PrefillPlanner:
    """The waiting queue and its admission decision (SGLang's `get_new_batch_prefill`, minus
    memory: locking, eviction and allocation stay with the scheduler)."""

    def __init__(self, policy: SchedulePolicy, tree_cache: BasePrefixCache, page_size: int) -> None:
        self.policy = policy
        self.tree_cache = tree_cache  # read (prefix matches) only while planning
        self.page_size = page_size
        self.waiting: list[Req] = []

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def requeue(self, reqs: list[Req]) -> None:
        """Put requests back at the head of the queue, in order (retracted, or not placed)."""
        self.waiting[:0] = reqs

    def remove(self, rid: str) -> Req | None:
        """Take a waiting request out of the queue (abort, stop string); None if it is not here."""
        for i, req in enumerate(self.waiting):
            if req.rid == rid:
                return self.waiting.pop(i)
        return None

    def plan(self, budget: PrefillBudget) -> PrefillPlan:
        deferred = self.policy.calc_priority(self.waiting, budget.in_flight_heads)
        adder = PrefillAdder(
            tree_cache=self.tree_cache,
            page_size=self.page_size,
            rem_total_tokens=budget.rem_total_tokens,
            rem_input_tokens=budget.rem_input_tokens,
            rem_chunk_tokens=budget.rem_chunk_tokens,
            max_new_reqs=budget.max_new_reqs,
        )
        if budget.chunked_req is not None:
            adder.add_chunked_req(budget.chunked_req)
        loras = set(budget.lora_in_use)
        if adder.new_chunked_req is None:
            for req in self.waiting:
                if id(req) in deferred:
                    break  # deferred requests come last: wait for their leader's prefix
                if budget.max_loras and req.lora_path not in loras and req.lora_path is not None:
                    if len(loras) >= budget.max_loras:
                        continue  # no slot for its adapter this round (SGLang skips it)
                admitted = adder.add_one_req(req)
                if adder.can_run_list and adder.can_run_list[-1] is req and req.lora_path is not None:
                    loras.add(req.lora_path)
                if not admitted:
                    break
        admitted = {id(r) for r in adder.can_run_list}
        if admitted:
            self.waiting = [r for r in self.waiting if id(r) not in admitted]
        return PrefillPlan(
            adder.can_run_list, adder.new_chunked_req, adder.log_hit_tokens, adder.log_input_tokens, len(self.waiting)
        )
