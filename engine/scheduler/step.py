"""One synchronous scheduler step: plan -> run -> process, with no event loop and no actors.

`SyncScheduler` puts the scheduler, its waiting queue and the model runner in one thread. The
`OverlapScheduler` actor composes the very same calls (`Scheduler.prefill_budget`, the planner,
`Scheduler.next_batch`, `Scheduler.launched`, `ModelRunner.forward_batch_generation`,
`Scheduler.process_batch_result`); it only puts the planner behind the PrefillAdder's mailbox and
the forward on the device stream. Tests drive scheduling decisions step by step with it,
`bench.step_profile` times its forwards, and `bench.one_batch`/`bench.gpu` measure static batches.

`run_until_idle(overlap=True)` reproduces the overlap schedule exactly (batch N+1 is planned
before N's result is processed) without asyncio.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from collections.abc import Callable

import msgspec
import torch

from engine.api import StepRecord
from engine.constrained import GrammarBackend
from engine.errors import ContextLengthExceededError, InvalidRequestError, RequestTooLargeError
from engine.model_executor.forward_batch_info import ModelWorkerBatch
from engine.model_executor.model_runner import GenerationBatchResult, ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler.launched import LaunchedBatch
from engine.scheduler.output import BatchTokenOut
from engine.scheduler.req import Req, resolve_logprob_start_len
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.waiting_queue import PrefillPlanner
from engine.server_args import ServerArgs

_rids = itertools.count()

# Profiler annotation of every forward: FORWARD_ANNOTATION + "extend" | "decode" | "mixed".
FORWARD_ANNOTATION = "forward:"
TimedResult = tuple[GenerationBatchResult, float, float]


def run_batch(runner: ModelRunner, batch: ModelWorkerBatch) -> TimedResult:
    """The "run" of a step: the forward (with sampling), and when it started and ended on this
    thread. Annotated for torch.profiler traces (`FORWARD_ANNOTATION` + the mode)."""
    with torch.profiler.record_function(FORWARD_ANNOTATION + batch.forward_mode.name.lower()):
        t0 = time.perf_counter()
        result = runner.forward_batch_generation(batch)
        return result, t0, time.perf_counter()


def plan_next_batch(scheduler: Scheduler, planner: PrefillPlanner) -> LaunchedBatch | None:
    """Plan one batch with a local planner: budget -> plan -> batch; None when nothing can run."""
    scheduler.num_waiting = len(planner)
    budget = scheduler.prefill_budget()
    batch = scheduler.next_batch(planner.plan(budget) if budget is not None else None)
    planner.requeue(scheduler.take_requeue())
    return scheduler.launched(batch) if batch is not None else None


class SyncScheduler:
    """A scheduler, its waiting queue and a model runner driven step by step in one thread."""

    def __init__(self, runner: ModelRunner, args: ServerArgs | None = None) -> None:
        self.runner = runner
        self.scheduler = Scheduler(runner, args or runner.args)
        self.planner = self.scheduler.new_planner()
        self.steps: list[StepRecord] = []  # one record per forward, in order
        # Called with each forward's ModelWorkerBatch before it runs (tests count prefill tokens).
        self.on_forward: Callable[..., None] | None = None

    @functools.cached_property
    def grammar_backend(self) -> GrammarBackend:
        """The grammar compiler for this model, built on first use (structured-output requests)."""
        cfg = self.runner.model_config
        return GrammarBackend(self.runner.source.load_tokenizer(), cfg.vocab_size, cfg.eos_token_ids)

    @classmethod
    def from_args(cls, args: ServerArgs) -> SyncScheduler:
        return cls(ModelRunner(args), args)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        seed: int | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        pooling: str | None = None,
        lora_path: str | None = None,
    ) -> Req:
        """Validate and queue one request (typed errors on bad input, as `Engine` raises them).
        `pooling` makes it an embedding request (a prefill only, `max_new_tokens` 0); `lora_path`
        runs it on that registered LoRA adapter."""
        params.verify(self.runner.model_config.vocab_size)
        if not input_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.runner.model_config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise InvalidRequestError(f"token ids must lie in [0, {vocab})", "input_ids")
        if len(input_ids) >= self.runner.context_len:
            raise ContextLengthExceededError(
                f"the prompt has {len(input_ids)} tokens, but the context length is {self.runner.context_len}",
                "prompt",
            )
        if len(input_ids) + self.scheduler.page_size > self.scheduler.allocator.size:
            raise RequestTooLargeError(f"the prompt has {len(input_ids)} tokens; the KV pool is smaller", "prompt")
        seed = seed if seed is not None else params.seed if params.seed is not None else random.getrandbits(63)
        spec = params.grammar_spec()
        grammar = self.grammar_backend.compile(*spec) if spec is not None else None  # blocking: no loop here
        return_logprob = return_logprob or top_logprobs_num > 0
        start = resolve_logprob_start_len(logprob_start_len, len(input_ids), return_logprob)
        if pooling is not None:
            params = msgspec.structs.replace(params, max_new_tokens=0, min_new_tokens=0)
        req = self.scheduler.new_req(
            rid or f"req-{next(_rids)}",
            input_ids,
            params,
            seed,
            return_logprob,
            top_logprobs_num,
            grammar,
            start,
            pooling,
        )
        if lora_path is not None:
            lora = self.runner.lora
            if lora is None:
                raise InvalidRequestError("LoRA is not enabled on this engine (enable_lora)", "lora_path")
            req.lora_path, req.lora_key = lora_path, lora.registry.cache_key(lora_path)  # unknown: LoRAError
        self.add(req)
        return req

    def add(self, req: Req) -> None:
        """Queue an already built request. One with stop strings has them checked by the scheduler
        (in the step whose token completes one, as in the Engine): the tokenizer is loaded then."""
        if req.sampling_params.stop_strs and self.scheduler.tokenizer is None:
            self.scheduler.tokenizer = self.runner.source.load_tokenizer()
        self.planner.add(req)

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        """Abort a request wherever it is; returns it if it was live."""
        req = self.scheduler.abort_request(rid, message)
        if req is None and (req := self.planner.remove(rid)) is not None:
            req.abort(message)
        return req

    # ---- the step -----------------------------------------------------------------------------

    def plan(self) -> LaunchedBatch | None:
        return plan_next_batch(self.scheduler, self.planner)

    def run(self, lb: LaunchedBatch) -> GenerationBatchResult:
        batch = lb.batch.get_model_worker_batch()
        if self.on_forward is not None:
            self.on_forward(batch)
        result, t0, _ = run_batch(self.runner, batch)
        result.next_token_ids_list()  # synchronous: the step ends when its ids are on the host
        t1 = time.perf_counter()
        self.steps.append(StepRecord(lb.mode.name, len(lb.reqs), int(batch.out_cache_loc.numel()), t0, t1))
        return result

    def process(self, lb: LaunchedBatch, result: GenerationBatchResult) -> BatchTokenOut:
        return self.scheduler.process_batch_result(lb, result)

    def step(self) -> BatchTokenOut | None:
        """Plan, run and process one batch; None when there was nothing to run."""
        lb = self.plan()
        return None if lb is None else self.process(lb, self.run(lb))

    def has_work(self) -> bool:
        return len(self.planner) > 0 or not self.scheduler.holds_nothing()

    def run_until_idle(
        self, overlap: bool = False, max_steps: int = 1_000_000, on_step: Callable[[int], None] | None = None
    ) -> int:
        """Step until no request is left; returns the number of forwards run.

        With `overlap`, batch N+1 is planned before N's result is processed, as the overlap
        scheduler does. `on_step(n)` runs after each step (tests add requests mid-run there).
        """
        pending: tuple[LaunchedBatch, GenerationBatchResult] | None = None
        steps = 0
        for _ in range(max_steps):
            if overlap and pending is not None and pending[0].needs_sync:
                self.process(*pending)  # as the overlap scheduler: its next batch needs these tokens
                pending = None
            lb = self.plan()
            launched = None if lb is None else (lb, self.run(lb))
            steps += launched is not None
            if overlap:
                if pending is not None:
                    self.process(*pending)
                pending = launched
            elif launched is not None:
                self.process(*launched)
            if on_step is not None:
                on_step(steps)
            if launched is None and pending is None and not self.has_work():
                return steps
        raise RuntimeError(f"the scheduler did not go idle within {max_steps} steps")

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Req]:
        """Run prompts as one continuous batch to completion; returns their Reqs in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        self.run_until_idle()
        return reqs
