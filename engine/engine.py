"""The in-process API: `async with Engine(model=..., **options) as engine`.

Builds the pipeline of actors around one ModelRunner:

    Engine.generate/stream -> Receiver.submit -> Dispatcher -> OverlapScheduler
        -> (device stream) -> OutputProcessor -> Receiver -> the request's stream

and supervises it: if an actor dies, open requests end with an error and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvloop

from engine.actors.dispatcher import Dispatcher
from engine.actors.messages import (
    SCHEDULER_INPUTS, AbortReq, FlushCacheReq, GetInternalStateReq, SetInternalStateReq, StreamDelta,
)  # fmt: skip
from engine.actors.output_processor import OutputProcessor
from engine.actors.receiver import Prompt, Receiver
from engine.actors.supervisor import ActorSystem
from engine.actors.scheduler import Scheduler
from engine.actors.scheduler_actor import OverlapScheduler
from engine.device_stream import make_device_stream
from engine.driver import eos_token_ids
from engine.errors import EngineUnhealthyError
from engine.model_executor.model_runner import ModelRunner
from engine.sampling import SamplingParams
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)


@dataclass
class GenerateResult:
    rid: str
    text: str
    token_ids: list[int]  # output tokens only
    finish_reason: str  # 'stop' | 'length' | 'abort'
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    matched_stop: int | str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class RequestStream:
    """The deltas of one submitted request (see `Engine.open_stream`); the last has `finish_reason`.

    A class rather than an async generator so that `aclose()` aborts even a stream that was never
    iterated (an unstarted generator's `finally` never runs).
    """

    def __init__(self, engine: Engine, receiver: Receiver, rid: str, queue: asyncio.Queue[StreamDelta]) -> None:
        self.rid = rid
        self.finished = False
        self._engine, self._receiver, self._queue = engine, receiver, queue

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished:
            raise StopAsyncIteration
        delta = await self._queue.get()
        self.finished = delta.finish_reason is not None
        return delta

    async def aclose(self) -> None:
        """Abort the request unless it already finished; idempotent, never blocks."""
        if self.finished:
            return
        self.finished = True
        self._receiver.streams.pop(self.rid, None)
        if self._engine.healthy:
            self._receiver.dispatcher.send(AbortReq(self.rid, "the client stopped reading"))


class Engine:
    def __init__(self, model: str = "smollm2-135m", **options: Any) -> None:
        self.args = ServerArgs(model_path=model, **options)
        self.runner: ModelRunner | None = None
        self.tokenizer = None
        self.system: ActorSystem | None = None
        self.receiver: Receiver | None = None
        self.scheduler_actor: OverlapScheduler | None = None
        self._stream = None

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> Engine:
        if self.runner is None:  # loading is slow and blocking: keep the event loop free
            self.runner, self.tokenizer = await asyncio.to_thread(self._load)
        runner, args = self.runner, self.args
        cfg = runner.model_config
        self._stream = make_device_stream(runner.device, args.torch_threads)
        self.system = ActorSystem(on_crash=self._on_crash)
        self.receiver = Receiver(
            self.tokenizer, cfg.vocab_size, runner.context_len, runner.token_to_kv_pool_allocator.size
        )
        # Wiring: actors only hold references to the mailboxes they send to.
        dispatcher_routes: dict[type, Any] = {}
        dispatcher = Dispatcher(dispatcher_routes)
        output = OutputProcessor(self.tokenizer, self.receiver, dispatcher)
        sched = OverlapScheduler(
            Scheduler(runner, args), self._stream, output, self.receiver,
            eos_token_ids(runner.source.hf_config, self.tokenizer), args.resolved_enable_overlap(),
        )  # fmt: skip
        dispatcher_routes.update({t: sched for t in SCHEDULER_INPUTS})
        self.receiver.dispatcher, self.receiver.output = dispatcher, output
        self.scheduler_actor = sched
        for actor in (self.receiver, dispatcher, output, sched):
            self.system.add(actor)
        self.system.start_all()
        return self

    def _load(self):
        runner = ModelRunner(self.args)
        return runner, runner.source.load_tokenizer()

    async def stop(self) -> None:
        if self.system is not None:
            await self.system.stop_all()
            self.system = None
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    async def __aenter__(self) -> Engine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def healthy(self) -> bool:
        return self.system is not None and self.system.healthy

    def _on_crash(self, name: str, exc: BaseException) -> None:
        log.error("actor %s crashed: %r; failing open requests", name, exc)
        if self.receiver is not None and name != "receiver":
            self.receiver.fail_all(f"engine error in {name}: {exc!r}")

    def _check(self) -> Receiver:
        if self.system is None or self.receiver is None:
            raise EngineUnhealthyError("the engine is not started (use `async with Engine(...)`)")
        if not self.system.healthy:
            raise EngineUnhealthyError(f"the engine is unhealthy: {self.system.crashed[-1][1]!r}")
        return self.receiver

    # ---- requests -----------------------------------------------------------------------------

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, rid: str | None = None,
                     return_logprob: bool = False, top_logprobs_num: int = 0) -> AsyncIterator[StreamDelta]:  # fmt: skip
        """Deltas of one request as they come; the last carries `finish_reason`.

        Leaving the iteration early (break, cancellation, a dropped consumer) aborts the request
        and frees its memory.
        """
        receiver = self._check()
        rid, queue = receiver.submit(prompt, params or SamplingParams(), rid, return_logprob, top_logprobs_num)
        finished = False
        try:
            while True:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            if not finished:
                receiver.streams.pop(rid, None)
                if self.healthy:
                    receiver.dispatcher.send(AbortReq(rid, "the client stopped reading"))

    def open_stream(self, prompt: Prompt, params: SamplingParams | None = None, rid: str | None = None,
                    return_logprob: bool = False, top_logprobs_num: int = 0) -> RequestStream:  # fmt: skip
        """Like `stream()`, but validates and enqueues the request *now*, before returning.

        `stream()` is an async generator, so its typed errors (bad sampling value, prompt too long)
        only surface on the first `anext()`, i.e. after the first token. A server must map them to
        a status before it commits to a streaming 200, hence this eager form. The caller owns the
        result: iterate it to the end or `aclose()` it (which aborts the request and frees its
        memory), also when it was never iterated.
        """
        receiver = self._check()
        rid, queue = receiver.submit(prompt, params or SamplingParams(), rid, return_logprob, top_logprobs_num)
        return RequestStream(self, receiver, rid, queue)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, rid: str | None = None,
                       return_logprob: bool = False, top_logprobs_num: int = 0) -> GenerateResult:  # fmt: skip
        text, ids, lps, tops = [], [], [], []
        last: StreamDelta | None = None
        async for delta in self.stream(prompt, params, rid, return_logprob, top_logprobs_num):
            text.append(delta.text)
            ids.extend(delta.token_ids)
            lps.extend(delta.logprobs or [])
            tops.extend(delta.top_logprobs or [])
            last = delta
        assert last is not None
        return GenerateResult(
            rid=last.rid, text="".join(text), token_ids=ids, finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
            cached_tokens=last.cached_tokens, matched_stop=last.matched_stop, error=last.error,
            logprobs=lps if return_logprob or top_logprobs_num else None,
            top_logprobs=tops if top_logprobs_num else None,
        )  # fmt: skip

    async def abort(self, rid: str) -> None:
        """Abort a running or queued request; its memory is freed when this returns."""
        receiver = self._check()
        queue = receiver.streams.get(rid)
        receiver.dispatcher.send(AbortReq(rid))
        if queue is not None:  # wait for the scheduler to confirm (it frees before replying)
            async with asyncio.timeout(30):
                while rid in receiver.streams:
                    await asyncio.sleep(0.001)

    async def flush_cache(self) -> bool:
        reply = await self._check().control(FlushCacheReq)
        return reply.ok

    async def get_internal_state(self) -> dict[str, Any]:
        reply = await self._check().control(GetInternalStateReq)
        state = dict(reply.payload)
        state["healthy"] = self.healthy
        state["actors"] = [s.name + ":" + s.state for s in self.system.stats()] if self.system else []
        return state

    async def set_internal_state(self, **state: Any) -> dict[str, Any]:
        reply = await self._check().control(lambda rid: SetInternalStateReq(rid, state))
        if not reply.ok:
            from engine.errors import InvalidRequestError

            raise InvalidRequestError(reply.error or "cannot set internal state", "state")
        return dict(reply.payload)

    def generate_batch(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                       ) -> list[GenerateResult]:  # fmt: skip
        """Synchronous convenience for offline scripts: run prompts concurrently, return in order."""
        if self.system is not None:
            raise RuntimeError("generate_batch is for synchronous code; inside the event loop use `await generate()`")
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)

        async def main() -> list[GenerateResult]:
            async with self:
                return list(await asyncio.gather(*(self.generate(p, sp) for p, sp in zip(prompts, plist))))

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
