"""Choosing the next prefill: schedule policy and the token budgets of `PrefillAdder` (seed 001).

`SchedulePolicy` orders the waiting queue (LPM: longest cached prefix first, falling back to FCFS
when the queue is long because matching every request each step would cost more than it saves;
FCFS; LOF: longest output first; random).

In-batch prefix sharing (LPM, as SGLang's "in-batch prefix caching"): requests that arrive
together with a common prompt head (say 64 users of one system prompt) find nothing in the
radix tree yet, so admitting them together would compute that prefix once per request. When a
request's first `IN_BATCH_PREFIX_LEN` tokens equal those of a request ahead of it (one that is
computing its prompt now, its KV not yet in the tree, or one earlier in this round's order with a
short cached match), it is *deferred*: it waits until the leader's prompt is in the tree, then
matches all of it (also when the leader is a chunked prefill that has cached only part so far).
`PrefillAdder` then walks that order and admits requests while three budgets hold:

- rem_total_tokens: free + evictable KV minus what the running decodes will still need
  (their remaining max_new_tokens, clipped, times `new_token_ratio`), minus the evictable tokens
  the admitted prefixes will lock (a locked prefix stops being evictable: without this, a request
  just retracted would count its own cached KV as room for itself and be re-admitted at once);
- rem_input_tokens: `max_prefill_tokens` of new prompt tokens per prefill batch;
- rem_chunk_tokens: `chunked_prefill_size`; a prompt longer than what is left is cut into a
  chunk and continued first next round (only one chunked request at a time).

Both read the radix tree (`match_prefix`) but never keep a lock or free anything: the scheduler,
which owns memory, locks the admitted requests' prefixes when it applies the plan
(waiting_queue.py). To measure what those locks will take from the evictable pool, `PrefillAdder`
locks and unlocks at once (`locked_prefix_tokens`), which leaves the tree as it was; it runs inside
the scheduler's plan round trip, while nothing else touches the tree.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.cache.base_prefix_cache import BasePrefixCache, PrefixNode
from engine.scheduler.req import Req
from engine.server_args import SCHEDULE_POLICIES

# A running request's future need is estimated from at most this many of its remaining tokens.
CLIP_MAX_NEW_TOKENS = 4096
LPM_FALLBACK_QUEUE_LEN = 128
# Requests whose first this-many tokens are equal share a prefix worth waiting one round for.
IN_BATCH_PREFIX_LEN = 32


def admission_need(req: Req, page_size: int) -> int:
    """What admitting `req` takes from the total budget: its whole uncached prompt (every chunk of
    it, in pages) and its remaining max_new_tokens (clipped)."""
    uncached = len(req.origin_input_ids) + len(req.output_ids) - len(req.prefix_indices)
    remaining = min(req.sampling_params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
    return -(-uncached // page_size) * page_size + remaining


def prompt_head(req: Req) -> tuple[int, ...] | None:
    """The key under which requests count as sharing a prefix; None for short prompts. It starts
    with the request's LoRA cache key: requests on different adapters never share a prefix."""
    ids = req.fill_ids
    return (req.lora_key, *ids[:IN_BATCH_PREFIX_LEN]) if len(ids) > IN_BATCH_PREFIX_LEN else None


class SchedulePolicy:
    POLICIES = SCHEDULE_POLICIES

    def __init__(self, policy: str, tree_cache: BasePrefixCache, radix_enabled: bool) -> None:
        if policy not in self.POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; use one of {self.POLICIES}")
        self.policy = policy
        self.tree_cache = tree_cache
        self.radix_enabled = radix_enabled

    def calc_priority(self, waiting: list[Req], in_flight_heads: Iterable[tuple[int, ...] | None] = ()) -> set[int]:
        """Reorder `waiting` in place; return the ids of requests deferred for prefix sharing.

        `in_flight_heads`: the `prompt_head`s of requests whose prompt is being computed now and
        is not in the tree yet. Deferred requests are sorted last and must not be admitted this round.
        """
        policy = self.policy
        if policy == "lpm" and (not self.radix_enabled or len(waiting) > LPM_FALLBACK_QUEUE_LEN):
            policy = "fcfs"
        deferred: set[int] = set()
        if policy == "lpm":
            for req in waiting:
                req.init_next_round_input(self.tree_cache)
            waiting.sort(key=lambda r: -len(r.prefix_indices))
            # Leaders: requests computing their prompt head now or ahead in this order. A waiting
            # request with a long cached match is not computing its head, so it leads no one.
            leaders = set(in_flight_heads) - {None}
            for req in waiting:
                if (head := prompt_head(req)) is None:
                    continue
                if head in leaders:
                    deferred.add(id(req))
                elif len(req.prefix_indices) <= IN_BATCH_PREFIX_LEN:
                    leaders.add(head)
            if deferred:
                waiting.sort(key=lambda r: id(r) in deferred)  # stable: LPM order within each part
        elif policy == "lof":
            waiting.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            random.shuffle(waiting)
        # fcfs: arrival order, as queued
        return deferred


@dataclass
class PrefillAdder:
    tree_cache: BasePrefixCache
    page_size: int
    rem_total_tokens: int
    rem_input_tokens: int
    rem_chunk_tokens: int | None
    max_new_reqs: int
    can_run_list: list[Req] = field(default_factory=list)
    new_chunked_req: Req | None = None
    log_hit_tokens: int = 0
    log_input_tokens: int = 0
    admitted_nodes: list[PrefixNode] = field(default_factory=list)  # prefixes the plan will lock

    @staticmethod
    def running_reservation(running: list[Req], new_token_ratio: float) -> int:
        """Tokens the running decodes are expected to still need."""
        return sum(
            int(min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * new_token_ratio)
            for r in running
        )

    def _page_ceil(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue the chunked request first; returns it if it still needs more chunks."""
        req.init_next_round_input()  # no re-match: it keeps its own (partly uncached) prefix
        return self._add(req)

    def locked_prefix_tokens(self, extra: PrefixNode = None) -> int:
        """Evictable tokens that the prefixes admitted so far (and `extra`'s) will lock.

        Measured as the drop in `evictable_size()` while they are all locked, so a prefix shared
        by several admitted requests counts once and one already locked by a running request
        counts zero. The locks are released before returning.
        """
        nodes = [*self.admitted_nodes, extra] if extra is not None else self.admitted_nodes
        if not nodes:
            return 0
        before = self.tree_cache.evictable_size()
        for node in nodes:
            self.tree_cache.inc_lock_ref(node)
        locked = before - self.tree_cache.evictable_size()
        for node in reversed(nodes):
            self.tree_cache.dec_lock_ref(node)
        return locked

    def add_one_req(self, req: Req) -> bool:
        """Try to admit a waiting request; False means stop adding (a budget is exhausted)."""
        if len(self.can_run_list) >= self.max_new_reqs:
            return False
        req.init_next_round_input(self.tree_cache)
        total_need = admission_need(req, self.page_size)
        rem_total = self.rem_total_tokens - self.locked_prefix_tokens(req.last_node)
        if total_need > rem_total and self.can_run_list:
            return False  # the first may exceed it: see `Scheduler.overcommits`
        if self._page_ceil(req.extend_input_len) + self.page_size > rem_total:
            return False  # not even its prompt fits now
        if req.extend_input_len > self.rem_input_tokens and self.can_run_list:
            return False
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return False
        if not req.output_ids:  # first admission: what the prefix cache saved us (retries excluded)
            req.cached_tokens = len(req.prefix_indices)
        self.log_hit_tokens += len(req.prefix_indices)
        self.log_input_tokens += len(req.prefix_indices) + req.extend_input_len
        self._add(req)
        if req.last_node is not None:
            self.admitted_nodes.append(req.last_node)
        self.rem_total_tokens -= min(req.sampling_params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
        return self.new_chunked_req is None

    def _add(self, req: Req) -> Req | None:
        extend = req.extend_input_len
        if self.rem_chunk_tokens is not None and extend > self.rem_chunk_tokens:
            # Cut a page-aligned chunk; the rest continues next round.
            chunk = self.rem_chunk_tokens // self.page_size * self.page_size
            if chunk <= 0:
                return None
            req.extend_input_len = chunk
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + chunk]
            req.is_chunked += 1
            self.new_chunked_req = req
        else:
            req.is_chunked = 0
        self.can_run_list.append(req)
        n = req.extend_input_len
        self.rem_total_tokens -= self._page_ceil(n)
        self.rem_input_tokens -= n
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= n
        return self.new_chunked_req
