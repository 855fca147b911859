"""The in-process API: `async with Engine(model=..., **options) as engine`.

Builds the pipeline of actors around one ModelRunner:

    Engine.generate/stream -> Receiver.submit -> Dispatcher -> PrefillAdderActor (waiting queue)
        <-> OverlapScheduler (memory, running batch; the device stream) -> OutputProcessor
        -> Receiver -> the request's stream

and supervises it: if an actor dies, open requests end with an error and `healthy` turns False.
The data types it takes and returns are in engine/api.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch
import uvloop

from engine.actors.overlap_scheduler import OverlapScheduler
from engine.actors.pipeline import build_pipeline
from engine.actors.receiver import Receiver
from engine.actors.supervisor import ActorSystem
from engine.api import (
    EmbeddingResult,
    GenerateResult,
    ModelInfo,
    Prompt,
    RequestStream,
    ResultBuilder,
    StepRecord,
    StreamDelta,
)
from engine.cache.base_prefix_cache import BasePrefixCache
from engine.constrained import GrammarBackend, JsonBounds
from engine.device import DeviceStream, make_device_stream
from engine.device.cpu_threads import default_torch_threads
from engine.distributed.driver import TPDriver
from engine.errors import EngineError, EngineUnhealthyError
from engine.lora_operations import LoRAOperations
from engine.model_executor.model_runner import ModelRunner
from engine.operations import EngineOperations
from engine.profiler import EngineProfiler
from engine.recorder.ring import FlightRecorder, make_header
from engine.sampling import SamplingParams
from engine.scheduler.restart import hand_over
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)

STREAM_CLOSE_TIMEOUT_S = 10.0
ENGINE_STOPPED = "engine stopped"  # the error of the abort delta that ends streams left open by stop()


class Engine(EngineOperations, LoRAOperations):
    def __init__(self, model: str = "smollm2-135m", **options: Any) -> None:
        self.args = ServerArgs(model_path=model, **options)
        self._runner: ModelRunner | None = None
        self._tokenizer = None
        self._grammar_backend: GrammarBackend | None = None
        self._loop_threads: int | None = None  # the event-loop thread's torch threads before start()
        self._forward_threads: int | None = None
        self._profiler: EngineProfiler | None = None
        self._recorder: FlightRecorder | None = None
        self._system: ActorSystem | None = None
        self._receiver: Receiver | None = None
        self._scheduler: OverlapScheduler | None = None
        self._stream: DeviceStream | None = None
        self._died: asyncio.Event | None = None
        self._tp: TPDriver | None = None  # tensor parallelism: rank 0's side of the group
        self._prefix_cache: BasePrefixCache | None = None  # the last run's, kept for the next start()
        self.death_reason: str | None = None  # why the engine turned unhealthy, once it has

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> Engine:
        args = self.args
        device = args.resolved_device()
        on_cpu = device.type == "cpu"
        if args.tp_size > 1 and self._runner is None and self._tp is None:  # loaded below
            self._tp = TPDriver(args)
        threads = args.torch_threads
        if on_cpu and threads is None:  # the tensor-parallel ranks on this host share its cores
            threads = self._tp.threads if self._tp is not None else default_torch_threads()
        self._stream = make_device_stream(device, threads)
        if self._runner is None:  # loading is slow and blocking: keep the event loop free
            # On a CPU the model loads on the forward's own thread. OpenMP (libgomp) keeps a
            # worker pool per thread that runs parallel regions; once a second thread has one
            # (loading in an executor thread did), it throttles every pool's spin-waiting, and
            # the forward's small parallel regions ran ~1.35x slower (a 32-row oneDNN linear:
            # 55 vs 41 ms per 300; M0 decode steps at batch 9-32: 38 vs 29 ms).
            load = self._stream.launch(self._load) if on_cpu else asyncio.to_thread(self._load)
            try:
                self._runner, self._tokenizer, self._grammar_backend = await load
            except BaseException:
                await self._stream.aclose()
                self._stream = None
                raise
        runner = self._runner
        if on_cpu and self._loop_threads is None:
            # The forward runs on the stream's thread; this (event-loop) thread only does small
            # host-side bookkeeping. With torch's default here, those small ops would start a
            # second OpenMP team spinning on the forward's cores (single stream: 48.6 -> 67.8
            # tok/s once it is 1). Restored by stop().
            self._loop_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        self._forward_threads = await self._stream.launch(torch.get_num_threads)
        log.info(
            "torch threads: %d for the forward, %d for the event loop", self._forward_threads, torch.get_num_threads()
        )
        cache, self._prefix_cache = self._prefix_cache, None
        pipeline = build_pipeline(runner, args, self._stream, self._tokenizer, self._grammar_backend, cache)
        self._died = asyncio.Event()
        self._system = ActorSystem(on_crash=self._on_crash)
        for actor in pipeline.actors:
            self._system.add(actor)
        scheduler = pipeline.scheduler
        self._receiver, self._scheduler = pipeline.receiver, scheduler
        if args.flight_recorder_size > 0:
            header = make_header(args, runner, scheduler.enable_overlap, self._forward_threads)
            self._recorder = FlightRecorder(args.flight_recorder_size, header, args.resolved_flight_recorder_dir())
            pipeline.attach_recorder(self._recorder)
        self._profiler = EngineProfiler(self._stream, lambda: scheduler.num_forwards, args.profile_dir)
        scheduler.on_forward = self._profiler.note_forward
        self._system.start_all()
        if self._tp is not None:
            self._tp.watch(self._system)
        return self

    def _load(self) -> tuple[ModelRunner, Any, GrammarBackend | None]:
        if self._tp is not None:
            runner = self._tp.load()
        else:
            runner = ModelRunner(self.args)
        tokenizer = runner.source.load_tokenizer()
        grammar_backend = None
        if self.args.grammar_backend == "xgrammar":  # the vocabulary's tables: ~0.1 s, once
            cfg = runner.model_config
            bounds = JsonBounds(max_string_length=self.args.constrained_json_max_string_length)
            grammar_backend = GrammarBackend(tokenizer, cfg.vocab_size, cfg.eos_token_ids, json_bounds=bounds)
        return runner, tokenizer, grammar_backend

    async def stop(self) -> None:
        if self._profiler is not None:  # a running profile is written while the stream still runs
            await self._profiler.close()
            self._profiler = None
        healthy, ran = self.healthy, self._system is not None
        if self._system is not None:
            try:
                await self._system.stop_all()
            finally:
                self._system = None
                # Stopped actors never answer again: a stream still open (mid-generation, never
                # iterated, or waiting in the grammar queue) would block its reader forever.
                # After stop_all, so deltas already on their way (the Receiver drains its
                # mailbox as it stops) still reach their streams first.
                if self._receiver is not None:
                    self._receiver.fail_all(ENGINE_STOPPED)
        if self._stream is not None:
            try:  # bounded: a device that hangs (the watchdog's case) must not hang shutdown too
                await asyncio.wait_for(self._stream.aclose(), STREAM_CLOSE_TIMEOUT_S)
            except TimeoutError:
                log.error("the device stream did not drain within %s s; abandoning it", STREAM_CLOSE_TIMEOUT_S)
            self._stream = None
        if ran and self._scheduler is not None:  # the device is idle now: the pools can be handed over
            # kept for a next start() on one rank (a restart of tensor parallelism is new ranks, new KV)
            self._prefix_cache = hand_over(self._scheduler.sched, keep=healthy and self._tp is None)
        if self._tp is not None:
            await asyncio.to_thread(self._tp.stop, healthy)
            self._tp = None
            self._runner = None  # rank 0's side of the stopped group: the next start() loads a new one
        if self._loop_threads is not None:
            torch.set_num_threads(self._loop_threads)
            self._loop_threads = None

    async def __aenter__(self) -> Engine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def healthy(self) -> bool:
        return self._system is not None and self._system.healthy

    def _on_crash(self, name: str, exc: BaseException) -> None:
        log.error("actor %s crashed: %r; failing open requests", name, exc)
        reason = f"engine error in {name}: {exc!r}"
        if self._receiver is not None:  # its streams are plain queues: this works even if it crashed
            self._receiver.fail_all(reason)
        if self.death_reason is None:
            self.death_reason = reason
        if self._recorder is not None:
            try:
                self._recorder.dump(reason)
            except OSError:
                log.exception("cannot write the flight recorder's dump")
        if self._died is not None:
            self._died.set()

    async def wait_unhealthy(self) -> str:
        """Return once the engine has died (an actor crashed, the watchdog fired): why. A server
        waits on this to exit non-zero so that its supervisor restarts it."""
        if self._died is None:
            raise EngineUnhealthyError("the engine is not started (use `async with Engine(...)`)")
        await self._died.wait()
        return self.death_reason or "unknown"

    def _check(self) -> Receiver:
        if self._system is None or self._receiver is None:
            raise EngineUnhealthyError("the engine is not started (use `async with Engine(...)`)")
        if not self._system.healthy:
            raise EngineUnhealthyError(f"the engine is unhealthy: {self._system.crashed[-1][1]!r}")
        return self._receiver

    # ---- the model ----------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        """The loaded model's facts (after `start()`)."""
        runner = self._loaded()
        cfg = runner.model_config
        return ModelInfo(
            model_path=self.args.model_path,
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            context_len=runner.context_len,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
            max_total_tokens=runner.token_to_kv_pool_allocator.size,
            max_running_requests=self.args.max_running_requests,
            eos_token_ids=tuple(sorted(cfg.eos_token_ids)),
            hidden_size=cfg.hidden_size,
            is_embedding=self.args.is_embedding,
            weight_version=self.weight_version,
        )

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (after `start()`); read-only by convention."""
        self._loaded()
        return self._tokenizer

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` in the model's tokenizer."""
        self._loaded()
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def _loaded(self) -> ModelRunner:
        if self._runner is None:
            raise EngineUnhealthyError("the engine is not started (use `async with Engine(...)`)")
        return self._runner

    def recent_steps(self) -> list[StepRecord]:
        """The latest forwards (up to a few thousand), oldest first."""
        return list(self._scheduler.steps) if self._scheduler is not None else []

    # ---- requests -----------------------------------------------------------------------------

    def open_stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        *,
        lora_path: str | None = None,
    ) -> RequestStream:
        """Validate and enqueue one request *now*; returns the stream its deltas arrive on.

        Typed errors (bad sampling value, prompt too long) raise here, before anything is
        streamed, so a server can map them to a status before it commits to a streaming 200. A
        grammar not yet compiled waits in the receiver's grammar queue, and its errors come as
        the stream's `abort` delta: `await submit(...)` raises them instead. The
        caller owns the result: iterate it to the end or `aclose()` it (which aborts the request
        and frees its memory), also when it was never iterated.
        """
        receiver = self._check()
        rid, queue = receiver.submit(
            prompt,
            params or SamplingParams(),
            rid,
            return_logprob,
            top_logprobs_num,
            None,
            None,
            logprob_start_len,
            lora_path=lora_path,
        )
        return RequestStream(rid, queue, receiver.close_stream)

    async def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        chat_template_kwargs: dict[str, Any] | None = None,
        logprob_start_len: int = -1,
        *,
        lora_path: str | None = None,
    ) -> RequestStream:
        """`open_stream`, awaiting the request's grammar (json_schema / regex / ebnf) first.

        The grammar compiles in the grammar backend's threads (the event loop keeps serving
        everyone else); a bad spec raises InvalidRequestError naming its field and a compile past
        `grammar_compile_timeout` raises GrammarCompileTimeoutError, both before anything is
        enqueued. `chat_template_kwargs` go to the chat template (e.g. `tools` for a template
        that renders them). What `generate`, `stream` and the server use.

        Log-probs (SGLang's): `return_logprob` reports each output token's, `top_logprobs_num`
        the N most likely tokens at each step too; `logprob_start_len` = k >= 0 also scores the
        prompt from position k on, in the prefill forward (the first delta's `input_logprobs`);
        -1 reports only the last prompt position (unscored). With `max_new_tokens=0` the
        request only scores its prompt. `lora_path`: the name of a loaded LoRA adapter to run
        the request under (None: the base model); an unknown one is an InvalidRequestError.
        """
        receiver = self._check()
        params = params or SamplingParams()
        params.verify(receiver.vocab_size)  # before a compile is queued for a request that cannot run
        receiver.lora_key(lora_path)
        grammar = await receiver.compile_grammar(params)
        receiver = self._check()  # the engine may have died while it compiled
        rid, queue = receiver.submit(
            prompt,
            params,
            rid,
            return_logprob,
            top_logprobs_num,
            grammar,
            chat_template_kwargs,
            logprob_start_len,
            lora_path=lora_path,
        )
        return RequestStream(rid, queue, receiver.close_stream)

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        *,
        lora_path: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Deltas of one request as they come; the last carries `finish_reason`.

        Leaving the iteration early (break, cancellation, a dropped consumer) aborts the request
        and frees its memory. Errors surface on the first `anext()`; use `open_stream` to have
        them at once.
        """
        stream = await self.submit(
            prompt, params, rid, return_logprob, top_logprobs_num, None, logprob_start_len, lora_path=lora_path
        )
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        *,
        lora_path: str | None = None,
    ) -> GenerateResult:
        builder = ResultBuilder()
        stream = await self.submit(
            prompt, params, rid, return_logprob, top_logprobs_num, None, logprob_start_len, lora_path=lora_path
        )
        try:
            async for delta in stream:
                builder.add(delta)
        finally:
            await stream.aclose()
        return builder.result(return_logprob or top_logprobs_num > 0, top_logprobs_num > 0)

    async def encode(
        self, prompts: Prompt | Sequence[Prompt], rid: str | None = None
    ) -> EmbeddingResult | list[EmbeddingResult]:
        """Embeddings (SGLang's `encode`): each prompt's final hidden states pooled by the
        engine's `pooling_method` and L2-normalised. A prompt is a prefill and nothing else,
        batched with whatever else runs and sharing the prefix cache like any prefill. A list of
        prompts (strings, token-id lists or chat messages) gives a list, in order; a token-id list
        alone is one prompt. Leaving early (cancellation) aborts what still runs."""
        many = isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], (int, dict))
        items: list[Prompt] = list(prompts) if many else [prompts]  # type: ignore[arg-type]
        receiver = self._check()
        streams: list[RequestStream] = []
        try:
            for k, p in enumerate(items):
                r = None if rid is None else (f"{rid}-{k}" if many else rid)
                r, queue = receiver.submit(p, SamplingParams(max_new_tokens=0), r, embed=True)
                streams.append(RequestStream(r, queue, receiver.close_stream))
            results = [await _embedding_of(s) for s in streams]
        finally:
            for s in streams:
                await s.aclose()
        return results if many else results[0]

    async def abort(self, rid: str) -> None:
        """Abort a running or queued request; its memory is freed when this returns."""
        receiver = self._check()
        known = rid in receiver.streams
        receiver.abort(rid)
        if known:  # wait for the scheduler to confirm (it frees before replying)
            async with asyncio.timeout(30):
                while rid in receiver.streams:
                    await asyncio.sleep(0.001)

    def generate_batch(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerateResult]:
        """Synchronous convenience for offline scripts: run prompts concurrently, return in order."""
        if self._system is not None:
            raise RuntimeError("generate_batch is for synchronous code; inside the event loop use `await generate()`")
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)

        async def main() -> list[GenerateResult]:
            async with self:
                return list(await asyncio.gather(*(self.generate(p, sp) for p, sp in zip(prompts, plist))))

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())


async def _embedding_of(stream: RequestStream) -> EmbeddingResult:
    last = None
    async for delta in stream:
        last = delta
    if last is None or last.finish_reason == "abort" or last.embedding is None:
        raise EngineError(last.error if last is not None and last.error else "the embedding request ended without one")
    return EmbeddingResult(last.rid, last.embedding, last.prompt_tokens, last.cached_tokens)
