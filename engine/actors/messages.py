"""Messages between the engine's actors: tagged msgspec Structs, so every mailbox's union can be
decoded from msgpack the day a boundary becomes a process boundary.

Flow (SGLang's names where they exist):
  Engine/Receiver --TokenizedGenerateReq/AbortReq/control--> Dispatcher --> Scheduler
  Scheduler --BatchTokenOut--> OutputProcessor --BatchStrOut/ControlReply--> Receiver
  OutputProcessor --StopStrMatched--> Dispatcher --> Scheduler (a stop string ended a request)
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.sampling import SamplingParams


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # resolved: the user's seed, or one drawn at submission
    return_logprob: bool = False
    top_logprobs_num: int = 0


class AbortReq(msgspec.Struct, tag=True):
    rid: str
    message: str = "aborted by the client"


class StopStrMatched(msgspec.Struct, tag=True):
    """The output processor saw a stop string complete: the scheduler finishes and frees the req."""

    rid: str
    matched: str


class FlushCacheReq(msgspec.Struct, tag=True):
    reply_id: int


class GetInternalStateReq(msgspec.Struct, tag=True):
    reply_id: int


class SetInternalStateReq(msgspec.Struct, tag=True):
    reply_id: int
    state: dict[str, Any]


class ControlReply(msgspec.Struct, tag=True):
    reply_id: int
    ok: bool
    payload: dict[str, Any] = {}
    error: str | None = None


class BatchTokenOut(msgspec.Struct, tag=True):
    """One forward's results for the requests that produced (or ended with) a token.

    Per request: the new token id (-1 when a request ended without one, e.g. an abort), the
    finish reason ('stop' | 'length' | 'abort' | None), matched stop token, error message,
    prompt length, cached tokens, and optional logprobs.
    """

    rids: list[str]
    token_ids: list[int]
    finish_reasons: list[str | None]
    matched: list[int | None]
    messages: list[str | None]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class RegisterReq(msgspec.Struct, tag=True):
    """Receiver -> OutputProcessor, before the request reaches the scheduler: how to detokenize it."""

    rid: str
    prompt_ids: list[int]  # the prompt's last few ids: context for the first token's leading space
    skip_special_tokens: bool
    stop_strs: list[str]


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


class BatchStrOut(msgspec.Struct, tag=True):
    deltas: list[StreamDelta]


SCHEDULER_INPUTS = (
    TokenizedGenerateReq, AbortReq, StopStrMatched, FlushCacheReq, GetInternalStateReq, SetInternalStateReq,
)  # fmt: skip
