"""A minimal synchronous continuous-batching driver, for tests and the micro-benchmark.

Requests may join between steps; each step either prefills every waiting request that fits or
decodes the running batch, then drops finished requests and frees their memory. The actor-based
scheduler (engine/actors/) is the real one; this stays small on purpose.
"""

from __future__ import annotations

import itertools
import random

import torch

from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.model_executor.model_runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler.batch import Req, ScheduleBatch

_rid_counter = itertools.count()


def eos_token_ids(hf_config, tokenizer=None) -> frozenset[int]:
    """EOS ids as transformers' generate would use them (config, plus the tokenizer's)."""
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else ([ids] if ids is not None else []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def new_req(
    runner: ModelRunner,
    input_ids: list[int],
    params: SamplingParams,
    eos_ids: frozenset[int],
    rid: str | None = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
) -> Req:
    """Validate a request against the model and build its `Req` (typed errors on bad input)."""
    params.verify(runner.model_config.vocab_size)
    if not input_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    vocab = runner.model_config.vocab_size
    if min(input_ids) < 0 or max(input_ids) >= vocab:
        raise InvalidRequestError(f"token ids must lie in [0, {vocab})", "input_ids")
    if len(input_ids) >= runner.context_len:
        raise ContextLengthExceededError(
            f"the prompt has {len(input_ids)} tokens, but the context length is {runner.context_len}", "prompt"
        )
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return Req(
        rid or f"req-{next(_rid_counter)}",
        input_ids,
        params,
        seed=seed,
        eos_token_ids=eos_ids,
        max_context_len=runner.context_len,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
    )


class SyncDriver:
    def __init__(self, runner: ModelRunner, eos_ids: frozenset[int] = frozenset()) -> None:
        self.runner = runner
        self.eos_ids = eos_ids
        self.waiting: list[Req] = []
        self.running: ScheduleBatch | None = None

    def add_request(self, input_ids: list[int], params: SamplingParams, **kw) -> Req:
        req = new_req(self.runner, input_ids, params, self.eos_ids, **kw)
        self.waiting.append(req)
        return req

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        r = self.runner
        return ScheduleBatch.init_new(
            reqs, r.req_to_token_pool, r.token_to_kv_pool_allocator, None, r.model_config.vocab_size
        )

    def step(self) -> list[Req]:
        """Run one forward; return the requests that finished in it."""
        if self.waiting:
            batch = self._take_prefill()
            if batch is not None:
                return self._run(batch)
        if self.running is None or self.running.is_empty():
            return []
        if not self.running.prepare_for_decode():
            # The minimal driver does not retract: the newest request gives way.
            victim = self.running.reqs[-1]
            victim.abort("out of KV memory")
            self._release(victim)
            self.running.filter_batch()
            return [victim]
        return self._run(self.running)

    def _take_prefill(self) -> ScheduleBatch | None:
        alloc = self.runner.token_to_kv_pool_allocator
        budget = alloc.available_size()
        rows = self.runner.req_to_token_pool.available_size()
        chosen: list[Req] = []
        for req in self.waiting:
            req.init_next_round_input()
            need = req.extend_input_len + alloc.page_size
            if need > budget or len(chosen) >= rows:
                break
            budget -= need
            chosen.append(req)
        if not chosen:
            return None
        batch = self._new_batch(chosen)
        if not batch.prepare_for_extend():
            return None
        self.waiting = self.waiting[len(chosen) :]
        return batch

    def _run(self, batch: ScheduleBatch) -> list[Req]:
        result = self.runner.forward_batch_generation(batch.get_model_worker_batch())
        out = result.sampler_output
        ids = result.next_token_ids_list()
        finished = []
        for i, (req, tok) in enumerate(zip(batch.reqs, ids)):
            req.output_ids.append(tok)
            if req.return_logprob and out.logprobs is not None:
                req.output_logprobs.append(float(out.logprobs[i]))
                if req.top_logprobs_num and out.top_logprobs_idx is not None:
                    n = req.top_logprobs_num
                    req.output_top_logprobs.append(
                        list(zip(out.top_logprobs_idx[i, :n].tolist(), out.top_logprobs_val[i, :n].tolist()))
                    )
            req.check_finished()
            if req.finished():
                self._release(req)
                finished.append(req)
        batch.filter_batch()
        if batch is not self.running:
            if self.running is None or self.running.is_empty():
                self.running = batch
            else:
                self.running.merge_batch(batch)
        return finished

    def _release(self, req: Req) -> None:
        """Free a finished request's KV slots and its table row (no prefix cache here)."""
        pool = self.runner.req_to_token_pool
        slots = pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)
        self.runner.token_to_kv_pool_allocator.free(slots)
        pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def run_until_done(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.waiting and (self.running is None or self.running.is_empty()):
                return
            self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Req]:
        """Run prompts as one continuous batch to completion; returns their Reqs in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        self.run_until_done()
        return reqs
