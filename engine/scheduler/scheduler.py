"""The scheduler's state machine: memory, the running batch, retraction, results (seeds 001, 004).

`Scheduler` is plain synchronous logic. It owns memory (the request table, the KV allocator, the radix tree)
and every request that holds any of it (running, chunked, in the last prefill). The waiting queue and the
admission decision belong to the `PrefillPlanner` (waiting_queue.py). A round of planning is three calls:

    budget = scheduler.prefill_budget()          # None: nothing to prefill this round
    plan = planner.plan(budget)                   # the PrefillAdder actor, or a direct call
    batch = scheduler.next_batch(plan)            # the prefill batch, else the decode batch

Requests it gives back (retracted, admitted but not placed) or ended itself (never fit the pool) wait in two
outboxes its owner empties each round (`take_requeue`, `take_self_aborted`). Driven by `SyncScheduler` (step.py)
or the `OverlapScheduler` actor; results finish requests by EOS, stop ids, length, stop strings (stop_strings.py).

Overlap contract (SGLang's): batch N+1 is planned while N runs, so results are processed one step late:
- a request finished by N (a stop string too) may sit in N+1; its extra token is dropped;
- a request retracted after N+1 was launched has a new `epoch`; N+1's token for the old epoch is dropped;
- memory freed while a batch is in flight may be reused by a later batch: the device stream runs
  batches in order, so the later batch's writes land after the in-flight batch's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from engine.cache.base_prefix_cache import BasePrefixCache
from engine.cache.swa_radix_cache import make_prefix_cache
from engine.constrained import CompiledGrammar
from engine.host_memory import trim_host_memory
from engine.model_executor.model_runner import GenerationBatchResult, ModelRunner
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.launched import LaunchedBatch, MemoryLeakError
from engine.scheduler.lora_admission import LoRAAdmission
from engine.scheduler.output import BatchTokenOut, PromptOutputs, StepLogprobs, take_embedding, take_prompt_logprobs
from engine.scheduler.policy import PrefillAdder, SchedulePolicy, admission_need, prompt_head
from engine.scheduler.req import Finished, FinishReason, Req
from engine.scheduler.retraction import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY,
    RETRACT_DECODE_STEPS,
    decode_need,
    retract_ratio,
)
from engine.scheduler.speculation import Speculation
from engine.scheduler.stop_strings import attach_stop_check
from engine.scheduler.waiting_queue import PrefillBudget, PrefillPlan, PrefillPlanner
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, runner: ModelRunner, args: ServerArgs, tokenizer: Any = None, prefix_cache: BasePrefixCache | None = None
    ) -> None:  # prefix_cache: what the last scheduler over `runner` left (restart.py); None: pools all free
        self.runner, self.args = runner, args
        self.tokenizer = tokenizer  # stop strings are checked here with it (None: by the output side only)
        self.page_size, self.vocab_size = args.page_size, runner.model_config.vocab_size
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.token_to_kv_pool_allocator
        self.tree_cache: BasePrefixCache = prefix_cache or make_prefix_cache(
            self.req_to_token_pool, self.allocator, args.page_size, args.disable_radix_cache
        )
        self.lora = LoRAAdmission.of(runner)  # adapters pinned by held requests (LoRA off: a no-op)
        chunk = args.chunked_prefill_size
        self.chunked_prefill_size = chunk if chunk is not None and chunk > 0 else None
        self.max_running_requests = min(args.max_running_requests, self.req_to_token_pool.size)
        self.running_batch: ScheduleBatch = self._new_batch([])
        spec = args.speculative_num_draft_tokens if args.speculative_algorithm else 0
        verify_rows = args.resolved_max_verify_tokens()
        self.speculation = Speculation(spec, verify_rows, self.req_to_token_pool, self.allocator) if spec else None
        self.chunked_req: Req | None = None
        self.last_batch: LaunchedBatch | None = None  # last launched extend, merged next round
        self.reqs_by_rid: dict[str, Req] = {}  # every request this scheduler holds
        self.num_waiting = 0  # the planner's queue length, as its owner last reported it
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.ran_since_idle = False  # a batch was planned since the scheduler was last idle
        self._requeue: list[Req] = []  # outbox: back to the waiting queue's head, in order
        self._self_aborted: list[Req] = []  # outbox: ended here, to be reported to their clients
        self.num_retractions = 0  # stats, from here on
        self.hit_tokens = self.prompt_tokens = self.generated_tokens = 0
        self.grammar_steps, self.grammar_mask_fill_s, self.grammar_mask_apply_s = 0, 0.0, 0.0  # masked batches
        self.started_at = time.perf_counter()

    def new_planner(self) -> PrefillPlanner:
        """A waiting queue with this scheduler's policy, reading this scheduler's prefix cache."""
        policy = SchedulePolicy(self.args.schedule_policy, self.tree_cache, not self.args.disable_radix_cache)
        return PrefillPlanner(policy, self.tree_cache, self.page_size)

    def new_req(
        self,
        rid: str,
        input_ids: list[int],
        params,
        seed: int,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        grammar: CompiledGrammar | None = None,
        logprob_start_len: int = -1,
        pooling: str | None = None,
    ) -> Req:
        """A `Req` for this model (its EOS ids and context length), under `grammar` if given."""
        cfg = self.runner.model_config
        return Req(
            rid,
            input_ids,
            params,
            seed=seed,
            eos_token_ids=cfg.eos_token_ids,
            max_context_len=self.runner.context_len,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            grammar=grammar,
            logprob_start_len=logprob_start_len,
            pooling=pooling,
        )

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.allocator, self.tree_cache, self.vocab_size)

    # ---- abort ----------------------------------------------------------------------------------

    def abort_request(
        self, rid: str, message: str | None, reason: FinishReason = FinishReason.ABORT, matched: int | str | None = None
    ) -> Req | None:
        """Finish a request this scheduler holds, freeing its memory now; None if it holds none
        by that rid (then it is waiting, or over)."""
        req = self.reqs_by_rid.pop(rid, None)
        if req is None or req.finished():
            return None
        message = message if reason is FinishReason.ABORT else None
        req.finished_reason = Finished(reason, matched=matched, message=message)
        if req is self.chunked_req:
            self.chunked_req = None
        self._release(req)
        return req

    def _release(self, req: Req) -> None:
        """Give back a request's row, KV (caching what is reusable) and adapter pin; never twice."""
        self.lora.unpin(req)
        if req.req_pool_idx is None:
            return
        self.tree_cache.cache_finished_req(req)
        req.req_pool_idx = None
        req.last_node = None

    # ---- planning -----------------------------------------------------------------------------

    def prefill_budget(self) -> PrefillBudget | None:
        """Start a round: merge the last prefill into the running batch, then say what a new
        prefill batch may take, or None when no prefill can happen this round."""
        joined: list[Req] = []
        if self.last_batch is not None and self.last_batch.mode.is_extend():
            # The previous prefill joins the running batch (minus a continuing chunk / finished reqs).
            prefilled = self.last_batch.reqs[: self.last_batch.num_extend]
            joined = [r for r in prefilled if not r.finished() and r is not self.chunked_req]
            self.last_batch = None
            if joined:
                self.running_batch.merge_batch(self._new_batch(joined))
        if self.num_waiting == 0 and self.chunked_req is None:
            return None
        self.running_batch.filter_batch()
        running = self.running_batch.reqs
        if len(running) >= self.max_running_requests and self.chunked_req is None:
            return None
        # Under overlap the previous prefill's result (which puts its prompts in the tree) is read
        # after this planning; its requests count as in flight for in-batch prefix sharing.
        in_flight = [*joined, self.chunked_req] if self.chunked_req is not None else joined
        if self.chunked_req is not None:
            self.tree_cache.cache_unfinished_req(self.chunked_req)
        rem_total = self.allocator.available_size() + self.tree_cache.evictable_size()
        rem_total -= PrefillAdder.running_reservation(running, self.new_token_ratio)
        mixed = len(running) if self.args.enable_mixed_chunk else 0  # one token each rides along
        chunk = self.chunked_prefill_size
        return PrefillBudget(
            rem_total_tokens=rem_total,
            rem_input_tokens=max(self.args.max_prefill_tokens - mixed, 1),
            rem_chunk_tokens=max(chunk - mixed, 1) if chunk is not None else None,
            max_new_reqs=self.max_running_requests - len(running),
            chunked_req=self.chunked_req,
            lora_in_use=self.lora.in_use(),
            max_loras=self.lora.max_loras,
            in_flight_heads=[h for h in map(prompt_head, in_flight) if h is not None],
        )

    def next_batch(self, plan: PrefillPlan | None) -> ScheduleBatch | None:
        """Finish the round: the planned prefill batch if it can be placed, else a decode batch."""
        batch = self._place_prefill(plan) if plan is not None else None
        if plan is not None:
            self.num_waiting = plan.num_waiting
        if batch is None:
            self.running_batch.filter_batch()
            if not self.running_batch.is_empty():
                batch = self.update_running_batch(self.running_batch)
        elif self.args.enable_mixed_chunk:
            self._mix_running(batch)
        if batch is not None:
            self.ran_since_idle = True
        elif self.ran_since_idle and self.is_idle():
            self.on_idle()
        return batch

    def _mix_running(self, batch: ScheduleBatch) -> None:
        """Let the running requests decode inside the prefill's forward (MIXED), when each has
        room for its token without retracting anyone (a retraction waits for a decode round)."""
        running = self.running_batch
        running.filter_batch()
        if running.reqs and self._has_room(running.reqs, 1) and running.prepare_for_decode(inputs_on_device=True):
            batch.mix_with_running(running)

    def on_idle(self) -> None:
        """The engine just went idle: the next burst starts from the initial `new_token_ratio`
        (SGLang's idle reset). A ratio raised by this burst's retractions, or decayed by its long
        decodes, says nothing about the next one. Only on the busy -> idle edge, so a ratio set
        while idle (`set_internal_state`) holds until the end of the next burst."""
        self.ran_since_idle = False
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        trim_host_memory()  # the burst's freed heap back to the OS

    def _place_prefill(self, plan: PrefillPlan) -> ScheduleBatch | None:
        """Lock the planned prefixes, evict, allocate; hand the requests back if they do not fit."""
        can_run = plan.reqs
        if not can_run:
            return None
        fresh = [r for r in can_run if r is not self.chunked_req]
        for req in fresh:
            self.tree_cache.inc_lock_ref(req.last_node)
        batch = self._new_batch(can_run)
        fits = not self.overcommits(plan)  # checked first: a plan handed back evicts nothing
        if fits:
            self._evict_for(sum(-(-r.extend_input_len // self.page_size) * self.page_size for r in can_run))
            fits = batch.prepare_for_extend()
        if not fits:
            for req in fresh:
                self.tree_cache.dec_lock_ref(req.last_node)
            self._requeue.extend(fresh)
            return None
        now = time.perf_counter()
        for req in fresh:
            self.reqs_by_rid[req.rid] = req
            req.mark_scheduled(now)
            self.lora.pin(req)
            attach_stop_check(req, self.tokenizer)
            self.tree_cache.record_hit(req.last_node)
        self.chunked_req = plan.new_chunked_req
        self.hit_tokens += plan.hit_tokens
        self.prompt_tokens += plan.input_tokens
        return batch

    def overcommits(self, plan: PrefillPlan) -> bool:
        """Whether a plan (its prefixes locked) takes room the running requests are reserved.

        The planner admits the first request of a round even past the total budget, so that one
        larger than what is free still runs once nothing else does. While requests are running it
        must wait: admitted now, it would soon be retracted (it has the least progress), re-admitted
        and retracted again, each time re-prefilled. A continued chunk was admitted earlier.
        """
        running = self.running_batch.reqs
        if not running or self.chunked_req in plan.reqs:
            return False
        room = self.allocator.available_size() + self.tree_cache.evictable_size()
        room -= PrefillAdder.running_reservation(running, self.new_token_ratio)
        return sum(admission_need(r, self.page_size) for r in plan.reqs) > room

    def _evict_for(self, need: int) -> None:
        short = need - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        """Make room for one more token per running request, then decode. If there is none,
        retract (`retract_one`) until those left have room for `RETRACT_DECODE_STEPS` more tokens
        each, and raise `new_token_ratio` so admission does not refill that room at once."""
        if not self._has_room(batch.reqs, 1):
            retracted = []
            while batch.reqs and not self._has_room(batch.reqs, RETRACT_DECODE_STEPS):
                if len(batch.reqs) == 1 and self._has_room(batch.reqs, 1):
                    break  # the last one decodes as long as it can (it may finish in time)
                retracted.append(self.retract_one(batch))
            self.num_retractions += len(retracted)
            self.new_token_ratio = max(self.new_token_ratio, retract_ratio(batch.reqs))
            log.info("retracted %d request(s); new_token_ratio=%.3f", len(retracted), self.new_token_ratio)
        else:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if batch.is_empty():
            return None
        if self.speculation is not None and self._verify(batch):
            return batch
        if not batch.prepare_for_decode(inputs_on_device=True):
            return None  # cannot happen after the checks above; be safe rather than crash
        return batch

    def _verify(self, batch: ScheduleBatch) -> bool:
        """Make `batch` a verify forward of this round's drafts, if any and if they fit."""
        assert self.speculation is not None
        drafts = self.speculation.drafts(batch.reqs)
        if not any(drafts):
            return False
        self._evict_for(sum(map(len, drafts)) + len(drafts))
        return batch.prepare_for_verify(drafts)

    def _has_room(self, reqs: list[Req], steps: int) -> bool:
        """Whether `reqs` can decode `steps` more tokens each, evicting cached KV if that helps."""
        need = decode_need(reqs, steps, self.page_size)
        self._evict_for(need)
        return self.allocator.available_size() >= need

    def retract_one(self, batch: ScheduleBatch) -> Req:
        """Send a request back to the waiting queue, freeing its KV: the one retracted fewest
        times so far, then the one with the least progress (SGLang's order, which alone would
        pick a request just re-admitted, stalled behind the others, again and again).

        A request alone in the batch that still cannot grow is aborted: it will never fit.
        """
        reqs = batch.reqs
        victim = min(reqs, key=lambda r: (r.epoch, len(r.output_ids), -len(r.origin_input_ids)))
        batch.filter_batch([i for i, r in enumerate(reqs) if r is not victim])
        # Alone and already holding (or needing) the whole pool: retracting it would only put its
        # own KV into the tree, re-admit it on that prefix and retract it again, forever.
        if not batch.reqs and victim.seqlen + self.page_size > self.allocator.size:
            self.abort_request(victim.rid, "the request does not fit in the KV cache pool")
            self._self_aborted.append(victim)
            return victim
        self._release(victim)
        self.reqs_by_rid.pop(victim.rid, None)
        victim.prefix_indices = torch.empty(0, dtype=torch.int64)
        victim.kv_committed_len = victim.kv_computed_len = 0
        victim.is_chunked = 0
        victim.epoch += 1
        victim.reset_prompt_outputs()
        self._requeue.append(victim)
        return victim

    def take_requeue(self) -> list[Req]:
        """Requests handed back since the last call, for the head of the waiting queue, in order."""
        reqs, self._requeue = self._requeue, []
        self.num_waiting += len(reqs)
        return reqs

    def take_self_aborted(self) -> list[Req]:
        """Requests ended by the scheduler since the last call (to be reported to their clients)."""
        reqs, self._self_aborted = self._self_aborted, []
        return reqs

    def launched(self, batch: ScheduleBatch) -> LaunchedBatch:
        reqs = list(batch.reqs)
        num_extend = len(reqs) - batch.mixed_decode_rows if batch.forward_mode.is_prefill() else 0
        mid_chunk = [i < num_extend and r.is_chunked > 0 for i, r in enumerate(reqs)]
        kv_lens = [r.kv_committed_len for r in reqs]
        mode = batch.forward_mode
        drafts = batch.spec_drafts if mode.is_verify() else []
        sync = self.speculation is not None  # the next round's drafts need this round's tokens
        lb = LaunchedBatch(batch, reqs, [r.epoch for r in reqs], kv_lens, mode, mid_chunk, num_extend, drafts, sync)
        if lb.mode.is_prefill():
            self.last_batch = lb
        return lb

    # ---- results ------------------------------------------------------------------------------

    def process_batch_result(self, lb: LaunchedBatch, result: GenerationBatchResult) -> BatchTokenOut:
        out = result.sampler_output
        if out.mask_fill_s or out.mask_apply_s:
            self.grammar_steps += 1
            self.grammar_mask_fill_s += out.mask_fill_s
            self.grammar_mask_apply_s += out.mask_apply_s
        logprobs = StepLogprobs(out)
        if lb.mode.is_verify():
            assert self.speculation is not None
            msg = self.speculation.process(lb, result, logprobs, self._finish)
            self.generated_tokens += len(msg.rids)
            return msg
        ids = result.next_token_ids_list()  # CUDA: from the step's pinned copy, no device-wide sync
        extras = PromptOutputs.of(result)  # prompt log-probs, pooled rows (None: the batch has neither)
        msg = BatchTokenOut()
        for i, req in enumerate(lb.reqs):
            if req.finished() or lb.epochs[i] != req.epoch:
                continue  # finished/aborted/retracted after this batch was launched
            req.kv_computed_len = max(req.kv_computed_len, lb.kv_lens[i])  # its KV is written now
            if extras is not None:
                extras.gather(i, req)
            if lb.mid_chunk[i]:
                continue  # a middle chunk: its sampled token means nothing
            prompt = take_prompt_logprobs(req) if i < lb.num_extend else None
            if req.sampling_params.max_new_tokens == 0:  # scoring or embedding: the prompt was the point
                req.finished_reason = Finished(FinishReason.LENGTH)
                msg.add(req, -1, prompt=prompt, embedding=take_embedding(req))
                self._finish(req)
                continue
            tok = ids[i]
            req.accept_token(tok)  # appends, advances its grammar, checks finish
            self.generated_tokens += 1
            lp, top = logprobs.of(i, req)
            if i < lb.num_extend and not req.finished():
                # Make the just-computed prompt shareable while the request decodes (SGLang does
                # the same); the request is re-pointed at the tree's slots.
                self.tree_cache.cache_unfinished_req(req)
            msg.add(req, tok, lp, top, prompt)
            if req.finished():
                self._finish(req)
        return msg

    def _finish(self, req: Req) -> None:
        self._release(req)
        self.reqs_by_rid.pop(req.rid, None)

    def fail_batch(self, lb: LaunchedBatch, error: BaseException) -> BatchTokenOut:
        """A forward raised: the requests in it end with an error; everyone else keeps going."""
        msg = BatchTokenOut()
        for req in lb.reqs:
            if self.abort_request(req.rid, f"internal error during forward: {error!r}") is not None:
                msg.add(req, -1)
        if self.last_batch is lb:
            self.last_batch = None
        return msg

    # ---- introspection ------------------------------------------------------------------------

    def holds_nothing(self) -> bool:
        """No request holds memory (waiting requests never do): the memory invariant must hold."""
        return self.running_batch.is_empty() and self.chunked_req is None and self.last_batch is None

    def is_idle(self) -> bool:
        return self.num_waiting == 0 and self.holds_nothing()

    def check_memory(self) -> None:
        """When no request holds memory: every KV slot is free or in the tree, every row free."""
        total, error = self.allocator.full_size, self.tree_cache.idle_error()  # None: the cache's own invariant holds
        avail, evictable = self.allocator.full_available_size(), self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        rows_free = self.req_to_token_pool.available_size()
        if avail + evictable + protected != total or rows_free != self.req_to_token_pool.size or protected:
            error = (
                f"memory leak: available={avail} evictable={evictable} protected={protected} total={total} "
                f"free_rows={rows_free}/{self.req_to_token_pool.size}"
            )
        if error:
            log.error(error)
            raise MemoryLeakError(error)

    def flush_cache(self, waiting_ok: bool = False) -> bool:
        if not (self.holds_nothing() if waiting_ok else self.is_idle()):  # waiting requests hold no KV
            return False
        self.tree_cache.reset()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        return True
