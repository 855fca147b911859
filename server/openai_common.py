"""What the OpenAI endpoints share: request fields -> SamplingParams (validated, errors naming
OpenAI's fields), the n samples of a request, finish reasons, usage and chat log-probs.

Choice `p * n + j` is prompt p's j-th sample (OpenAI's order). With a `seed`, sample j uses
seed + j so the n choices differ yet the whole response is reproducible. Usage counts each
prompt once and sums the completions. An engine-side abort has no OpenAI finish reason: it
becomes an error (status from `errors.abort_error`; mid-stream, an SSE `{"error": ...}` event
before [DONE]).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec

from engine import InvalidRequestError, ResultBuilder, SamplingParams
from server.errors import ApiError, abort_error
from server.protocol import (
    ChoiceLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from server.state import ServerState
from server.structured import grammar_fields, schema_param

MAX_N = 128
# The engine's names for what OpenAI calls differently, so a 400 names the field the client sent.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
# A token id as OpenAI's logit_bias keys spell it: ASCII digits, no leading zeros (int() would also
# take " 1", "1_0", non-ASCII digits and "01", and "01" next to "1" would silently collide). A minus sign is let
# through so a negative id gets verify()'s range message.
_TOKEN_ID = re.compile(r"-?(?:0|[1-9][0-9]{0,17})")


def logit_bias_map(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys, hence strings) -> the engine's int keys.

    Only the key syntax is checked here; the ranges (ids within the vocabulary, biases in
    [-100, 100]) and the entry bound are the engine's `SamplingParams.verify`, so every entry
    point refuses the same things. The body-size limit bounds the keys parsed before that.
    """
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise ApiError(400, f"logit_bias keys must be token ids (integers), got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


def sampling_params(
    state: ServerState, req: Any, max_tokens: int | None, max_param: str = "max_tokens"
) -> SamplingParams:
    """OpenAI fields -> the engine's SamplingParams, validated here to name OpenAI's fields.

    max_tokens below 1 is a 400, as OpenAI and vLLM answer it (the native API and the engine take
    max_new_tokens=0 as "generate nothing").
    """
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{max_param} must be at least 1, got {max_tokens}", param=max_param)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    sp = SamplingParams(
        max_new_tokens=state.context_len if max_tokens is None else max_tokens,
        min_new_tokens=req.min_tokens or 0,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        seed=req.seed,
        logit_bias=logit_bias_map(req.logit_bias),
        **grammar_fields(req.response_format, req.regex, req.ebnf),
    )
    try:
        sp.verify(state.engine.model_info.vocab_size)
    except InvalidRequestError as e:
        param = _PARAM_NAMES.get(e.param or "", schema_param(e.param, req.response_format))
        raise ApiError(400, e.message.replace(e.param or "\0", param or ""), param=param) from None
    return sp


def samples(sp: SamplingParams, n: int) -> list[SamplingParams]:
    if sp.seed is None:
        return [sp] * n
    return [msgspec.structs.replace(sp, seed=sp.seed + j) for j in range(n)]


def finish_reason(out_reason: str | None) -> str | None:
    return out_reason if out_reason in (None, "stop", "length") else "stop"


def check_done(state: ServerState, out: ResultBuilder) -> str:
    last = out.last
    if last is None or last.finish_reason is None:
        raise ApiError(500, "the generation ended without a finish reason", type="server_error")
    if last.finish_reason == "abort":
        raise abort_error(last.error, state.engine.healthy)
    return last.finish_reason


def usage_of(prompt_outs: list[Any], outs: list[ResultBuilder] | list[Any], detail: bool = True) -> Usage:
    """prompt_outs: one delta-like per distinct prompt; outs: one per choice (with completion_tokens)."""
    prompt = sum(d.prompt_tokens for d in prompt_outs if d is not None)
    cached = sum(d.cached_tokens for d in prompt_outs if d is not None)
    completion = sum(d.completion_tokens for d in outs if d is not None)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached) if detail else None)


def response_metadata(state: ServerState, out: ResultBuilder) -> dict[str, str]:
    """A non-streaming response's `metadata` (SGLang's): the version of the weights that produced
    `out`'s last token, or the serving one where it produced none."""
    version = out.weight_versions[-1] if out.weight_versions else out.last.weight_version if out.last else ""
    return {"weight_version": version or state.engine.weight_version}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- logprobs ---------------------------------------------------------------------------------


def chat_logprobs(state: ServerState, ids: list[int], lps: list[float], tops: list) -> ChoiceLogprobs:
    def top(t: int, lp: float) -> TopLogprob:
        s = state.token_text(t)
        return TopLogprob(s, lp, list(s.encode()))

    content = []
    for k, (t, lp) in enumerate(zip(ids, lps)):
        s = state.token_text(t)
        row = tops[k] if k < len(tops) else []
        content.append(TokenLogprob(s, lp, list(s.encode()), [top(a, b) for a, b in row]))
    return ChoiceLogprobs(content)
