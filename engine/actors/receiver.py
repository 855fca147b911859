"""Receiver: the engine's front door and the end of its output pipeline.

`submit()` runs in the caller's task: it validates sampling parameters, tokenizes text or chat
messages with the model's chat template, registers the request's output stream, and forwards the
tokenized request. A structured-output request needs its grammar compiled first: callers that
can await do it with `compile_grammar` (so a bad spec raises before anything streams); others
leave it to the grammar queue (`compiling`), a task per request that forwards it once compiled.
Validation errors are raised right there, typed, so a caller (or the HTTP
layer mapping them to 400) never waits on a request that was never going to run.
Its mailbox receives text deltas (routed to the per-request streams) and control replies.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from typing import Any

import msgspec

from engine.actors.messages import AbortReq, BatchStrOut, ControlReply, RegisterReq, StreamDelta, TokenizedGenerateReq
from engine.actors.runtime import Actor
from engine.api import Prompt, PromptLogprobs
from engine.constrained import CompiledGrammar, GrammarBackend
from engine.errors import (
    ContextLengthExceededError,
    EngineError,
    EngineUnhealthyError,
    InvalidRequestError,
    RequestTooLargeError,
)
from engine.sampling import SamplingParams
from engine.scheduler.req import resolve_logprob_start_len

DETOKENIZE_CONTEXT = 5  # prompt ids given to the detokenizer so the first token keeps its space


class Receiver(Actor):
    accepts = (BatchStrOut, ControlReply)

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        context_len: int,
        pool_tokens: int,
        grammar_backend: GrammarBackend | None = None,
        grammar_compile_timeout: float | None = None,
        pooling_method: str = "last",
        is_embedding: bool = False,
    ) -> None:
        super().__init__("receiver")
        self.pooling_method = pooling_method  # how embedding requests pool (ServerArgs.pooling_method)
        self.is_embedding = is_embedding  # an embedding-only engine refuses generation
        self.grammar_backend = grammar_backend  # None: structured output is off
        self.grammar_compile_timeout = grammar_compile_timeout
        self.compiling: dict[str, asyncio.Task[None]] = {}  # the grammar queue, by rid
        self.pool_tokens = pool_tokens
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.dispatcher: Actor | None = None  # TokenizedGenerateReq, AbortReq, control messages
        self.output: Actor | None = None  # RegisterReq
        self.streams: dict[str, asyncio.Queue[StreamDelta]] = {}
        self.pending: dict[int, asyncio.Future[ControlReply]] = {}
        self._ids = itertools.count()
        # Multi-LoRA: the adapters a request may name, with their radix cache keys (None: LoRA
        # off), kept by the Engine's load/unload calls; the adapter of each open request (its
        # stream's rid) that named one, so an unload in use is refused (engine/lora_operations.py)
        self.loras: dict[str, int] | None = None
        self.lora_of: dict[str, str] = {}

    def tokenize(self, prompt: Prompt, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", "prompt")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("prompt must be a string, a list of token ids or a list of messages", "prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise InvalidRequestError(f"token ids must lie in [0, {self.vocab_size})", "input_ids")
            return list(prompt)
        if all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt):
            try:
                ids = self.tokenizer.apply_chat_template(
                    prompt, add_generation_prompt=True, tokenize=True, return_dict=False, **(chat_template_kwargs or {})
                )
            except Exception as e:  # a template error is the caller's bad input
                raise InvalidRequestError(f"cannot apply the chat template: {e}", "messages") from e
            return list(ids)
        raise InvalidRequestError("prompt must be a string, a list of token ids or a list of messages", "prompt")

    async def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar of `params` (None without one), compiled in the grammar backend's
        threads, never on the event loop. Raises InvalidRequestError naming the field for a bad
        spec, GrammarCompileTimeoutError past `grammar_compile_timeout`."""
        spec = params.grammar_spec()
        if spec is None:
            return None
        return await self._backend_for(spec[0]).compile_async(*spec, timeout=self.grammar_compile_timeout)

    def _backend_for(self, field: str) -> GrammarBackend:
        """The grammar backend, or an InvalidRequestError naming `field` when it is switched off."""
        if self.grammar_backend is None:
            raise InvalidRequestError("structured output is disabled on this engine (grammar_backend='none')", field)
        return self.grammar_backend

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        grammar: CompiledGrammar | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        logprob_start_len: int = -1,
        embed: bool = False,
        lora_path: str | None = None,
    ) -> tuple[str, asyncio.Queue[StreamDelta]]:
        """Validate and enqueue one request; returns its rid and the queue its deltas arrive on.

        A request with a grammar spec but no compiled `grammar` (a caller that could not await
        `compile_grammar`) waits in the grammar queue: a task compiles it and then forwards the
        request; a spec that fails ends the stream with an `abort` delta carrying the error.
        """
        if embed:  # a prefill and nothing else: its final delta carries the pooled embedding
            params = msgspec.structs.replace(params, max_new_tokens=0, min_new_tokens=0)
        elif self.is_embedding:
            raise InvalidRequestError("this engine serves embeddings only (is_embedding): use encode", "model")
        params.verify(self.vocab_size)
        lora_key = self.lora_key(lora_path)
        if not 0 <= top_logprobs_num <= 20:
            raise InvalidRequestError("top_logprobs_num must be between 0 and 20", "top_logprobs")
        spec = params.grammar_spec()
        if spec is not None and grammar is None:
            self._backend_for(spec[0])  # the grammar queue needs one
        ids = self.tokenize(prompt, chat_template_kwargs)
        if len(ids) >= self.context_len:
            raise ContextLengthExceededError(
                f"the prompt has {len(ids)} tokens, but the model's context length is {self.context_len}", "prompt"
            )
        if len(ids) >= self.pool_tokens:
            raise RequestTooLargeError(
                f"the prompt has {len(ids)} tokens but the KV cache pool holds only {self.pool_tokens}", "prompt"
            )
        rid = rid if rid is not None else f"req-{next(self._ids)}-{random.getrandbits(32):08x}"
        if rid in self.streams:
            raise InvalidRequestError(f"a request with rid {rid!r} is already running", "rid")
        return_logprob = return_logprob or top_logprobs_num > 0
        start = resolve_logprob_start_len(logprob_start_len, len(ids), return_logprob)
        queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        if params.max_new_tokens == 0 and start >= len(ids) - 1 and not embed:
            # Nothing to generate or score: finished before it starts (SGLang's answer); the one
            # prompt position asked for, if any, is the first, which is never scored.
            prompt = PromptLogprobs(ids[start:], [None], [None] if top_logprobs_num else None) if start >= 0 else None
            queue.put_nowait(
                StreamDelta(rid, "", [], finish_reason="length", prompt_tokens=len(ids), input_logprobs=prompt)
            )
            return rid, queue
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.streams[rid] = queue
        pooling = self.pooling_method if embed else None
        req = TokenizedGenerateReq(
            rid, ids, params, seed, return_logprob, top_logprobs_num, start, pooling, grammar, lora_path, lora_key
        )
        if lora_path is not None:
            self.lora_of[rid] = lora_path
        if spec is not None and grammar is None:
            self.compiling[rid] = asyncio.get_running_loop().create_task(self._compile_then_forward(req))
        else:
            self._forward(req)
        return rid, queue

    def lora_key(self, lora_path: str | None) -> int:
        """The radix cache key of the adapter a request names (0: the base model); an
        InvalidRequestError on `lora_path` when LoRA is off or no such adapter is loaded."""
        if lora_path is None:
            return 0
        if self.loras is None:
            raise InvalidRequestError("LoRA is not enabled on this engine (enable_lora)", "lora_path")
        if not isinstance(lora_path, str) or lora_path not in self.loras:
            known = ", ".join(sorted(self.loras)) or "none"
            raise InvalidRequestError(f"unknown LoRA adapter {lora_path!r} (loaded: {known})", "lora_path")
        return self.loras[lora_path]

    def lora_users(self, name: str) -> int:
        """Open requests on adapter `name` (waiting or running); forgets the closed ones."""
        self.lora_of = {rid: n for rid, n in self.lora_of.items() if rid in self.streams or rid in self.compiling}
        return sum(1 for n in self.lora_of.values() if n == name)

    def _forward(self, req: TokenizedGenerateReq) -> None:
        params = req.sampling_params
        context = req.input_ids[-DETOKENIZE_CONTEXT:]
        self.output.send(RegisterReq(req.rid, context, params.skip_special_tokens, params.stop_strs))
        self.dispatcher.send(req)

    async def _compile_then_forward(self, req: TokenizedGenerateReq) -> None:
        """The grammar queue: the request waits here, off the scheduler's path, until its
        grammar is compiled; requests without a grammar never wait behind it."""
        try:
            req.grammar = await self.compile_grammar(req.sampling_params)
        except EngineError as e:
            self._end(req.rid, str(e), len(req.input_ids))
            return
        finally:
            self.compiling.pop(req.rid, None)
        if req.rid in self.streams:  # not closed while it compiled
            self._forward(req)

    def _end(self, rid: str, error: str, prompt_tokens: int = 0) -> None:
        """End a stream that never reached the scheduler with an `abort` delta."""
        queue = self.streams.pop(rid, None)
        if queue is not None:
            queue.put_nowait(StreamDelta(rid, "", [], finish_reason="abort", error=error, prompt_tokens=prompt_tokens))

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        """Abort `rid`; its stream stays open and gets the final (abort) delta."""
        task = self.compiling.pop(rid, None)
        if task is not None:  # still in the grammar queue: nothing downstream knows it
            task.cancel()
            self._end(rid, message)
            return
        self.dispatcher.send(AbortReq(rid, message))

    def close_stream(self, rid: str, message: str = "the client stopped reading") -> None:
        """The consumer of `rid` went away: forget its stream and abort the request."""
        task = self.compiling.pop(rid, None)
        if task is not None:
            task.cancel()
            self.streams.pop(rid, None)
            return
        if self.streams.pop(rid, None) is not None and self.dispatcher.running:
            self.dispatcher.send(AbortReq(rid, message))

    async def control(self, make_msg: Callable[[int], msgspec.Struct], timeout: float = 30.0) -> ControlReply:
        """Send a control message built by `make_msg(reply_id)` and await its reply."""
        reply_id = next(self._ids)
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self.pending[reply_id] = fut
        try:
            self.dispatcher.send(make_msg(reply_id))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.pending.pop(reply_id, None)

    async def handle(self, msg: msgspec.Struct) -> None:
        if isinstance(msg, ControlReply):
            fut = self.pending.get(msg.reply_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return
        for delta in msg.deltas:
            queue = self.streams.get(delta.rid)
            if queue is None:
                continue  # the consumer went away
            queue.put_nowait(delta)
            if delta.finish_reason is not None:
                self.streams.pop(delta.rid, None)
                self.lora_of.pop(delta.rid, None)

    def fail_all(self, message: str) -> None:
        """End every open stream with an error (the engine lost a stage)."""
        for task in self.compiling.values():
            task.cancel()
        self.compiling.clear()
        for rid, queue in list(self.streams.items()):
            queue.put_nowait(StreamDelta(rid=rid, text="", token_ids=[], finish_reason="abort", error=message))
        self.streams.clear()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(EngineUnhealthyError(message))
