"""The engine's public data types: what a caller sends, what comes back, what the model is.

Everything a user of `Engine` (the HTTP server included) handles is defined here and exported
from `engine`; nothing in this module knows about actors, the scheduler or the model runner.

- `Prompt`: text, token ids, or chat messages (the model's chat template is applied).
- `StreamDelta`: one increment of one request's output; the last one has `finish_reason`.
- `RequestStream`: the deltas of one submitted request; closing it early aborts the request.
- `GenerateResult` and `ResultBuilder`: a whole output, folded from its deltas (one fold for the
  in-process API and the server).
- `ModelInfo`: the served model's facts (architecture, context length, vocabulary, dtype...).
- `StepRecord`: one forward's timing, for benchmarks and diagnosis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

Prompt = str | list[int] | list[dict[str, Any]]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """A request's prompt log-probs (SGLang's input_token_logprobs / input_top_logprobs): the
    prompt's ids from `logprob_start_len` on; each one's log-prob given the ones before it, None
    for the first (not scored: SGLang's convention, and OpenAI's for a prompt's first token); and
    the top-N (id, log-prob) pairs of each position's distribution, None for the first (`top` is
    None when none were asked for). Raw log-probs of the model, as for output tokens."""

    ids: list[int]
    values: list[float | None]
    top: list[list[tuple[int, float]] | None] | None = None


class StreamDelta(msgspec.Struct):
    """One increment of one request's output, as the user sees it."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta: 'stop' | 'length' | 'abort'
    error: str | None = None  # the abort message, when the engine ended the request
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    matched_stop: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    queue_time: float | None = None  # seconds in the waiting queue before its first prefill
    # n-gram speculation so far (None: the request did not speculate): verify forwards in which
    # it had drafts, drafts verified, drafts accepted. Tokens per verify forward =
    # (spec_accepted_tokens + spec_verify_ct) / spec_verify_ct.
    spec_verify_ct: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    # On the first delta of a request that asked for prompt log-probs (`logprob_start_len`)
    input_logprobs: PromptLogprobs | None = None
    # On the final delta of an embedding request (`Engine.encode`): pooled, L2-normalised
    embedding: list[float] | None = None
    weight_version: str = ""  # the weights that produced this delta's tokens (SGLang's meta_info field)


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
    spec_verify_ct: int | None = None  # as StreamDelta's, at the end
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    input_logprobs: PromptLogprobs | None = None  # prompt log-probs, when asked for
    # The weights of the last token; `weight_versions` lists every version the output's tokens
    # came from, in order: more than one only when a weight update landed while the request was
    # paused (retract / in_place), which is never hidden
    weight_version: str = ""
    weight_versions: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EmbeddingResult:
    """One prompt's embedding (`Engine.encode`): the model's final hidden states pooled as the
    engine's `pooling_method` says, L2-normalised."""

    rid: str
    embedding: list[float]
    prompt_tokens: int
    cached_tokens: int


@dataclass
class ResultBuilder:
    """Folds one request's deltas, in order, into its whole output."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: PromptLogprobs | None = None
    weight_versions: list[str] = field(default_factory=list)
    last: StreamDelta | None = None

    def add(self, delta: StreamDelta) -> None:
        if delta.input_logprobs is not None:
            self.input_logprobs = delta.input_logprobs
        v = delta.weight_version
        if delta.token_ids and v and (not self.weight_versions or self.weight_versions[-1] != v):
            self.weight_versions.append(v)
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        self.top_logprobs.extend(delta.top_logprobs or [])
        self.last = delta

    @property
    def full_text(self) -> str:
        return "".join(self.text)

    def result(self, with_logprobs: bool = False, with_top_logprobs: bool = False) -> GenerateResult:
        """The whole output; call after the final delta (the one with a finish_reason)."""
        last = self.last
        if last is None or last.finish_reason is None:
            raise RuntimeError("the request has not finished: no final delta yet")
        return GenerateResult(
            rid=last.rid,
            text=self.full_text,
            token_ids=self.token_ids,
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            cached_tokens=last.cached_tokens,
            matched_stop=last.matched_stop,
            error=last.error,
            logprobs=self.logprobs if with_logprobs else None,
            top_logprobs=self.top_logprobs if with_top_logprobs else None,
            spec_verify_ct=last.spec_verify_ct,
            spec_draft_tokens=last.spec_draft_tokens,
            spec_accepted_tokens=last.spec_accepted_tokens,
            input_logprobs=self.input_logprobs,
            weight_version=self.weight_versions[-1] if self.weight_versions else last.weight_version,
            weight_versions=list(self.weight_versions),
        )


class RequestStream:
    """The deltas of one submitted request (see `Engine.open_stream`); the last has `finish_reason`.

    A class rather than an async generator so that `aclose()` aborts even a stream that was never
    iterated (an unstarted generator's `finally` never runs). `on_close` is the engine's abort:
    called once, only if the request had not finished.
    """

    def __init__(self, rid: str, queue: asyncio.Queue[StreamDelta], on_close: Callable[[str], None]) -> None:
        self.rid = rid
        self.finished = False
        self._queue = queue
        self._on_close = on_close

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
        self._on_close(self.rid)


@dataclass(frozen=True)
class ModelInfo:
    """The served model, as loaded (what `/get_model_info` reports)."""

    model_path: str
    architecture: str
    vocab_size: int
    context_len: int
    dtype: str  # "bfloat16", "float32", ...
    device: str  # "cpu", "cuda:0", ...
    max_total_tokens: int  # KV pool size in tokens
    max_running_requests: int
    eos_token_ids: tuple[int, ...]
    hidden_size: int = 0  # the length of an embedding (Engine.encode)
    is_embedding: bool = False  # serves embeddings only (ServerArgs.is_embedding)
    weight_version: str = "default"  # of the weights serving now (after the last weight update)


class StepRecord(msgspec.Struct, frozen=True):
    """One forward: its mode, size, and when it ran (time.perf_counter seconds, measured on the
    thread that ran it; on CUDA that is when it was enqueued, not when the device ran it)."""

    mode: str  # "EXTEND" | "DECODE" | "MIXED"
    batch_size: int
    num_tokens: int  # tokens whose KV this forward wrote
    start: float
    end: float
