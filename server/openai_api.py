"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

Each request becomes a `GenerationGroup` of `len(prompts) * n` engine generations; choice
`p * n + j` is prompt p's j-th sample (OpenAI's order). With a `seed`, sample j uses seed + j so
the n choices differ yet the whole response is reproducible. Usage counts each prompt once and
sums the completions. An engine-side abort has no OpenAI finish reason: it becomes an error
(status from `errors.abort_error`; mid-stream, an SSE `{"error": ...}` event before [DONE]).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from engine import InvalidRequestError, ResultBuilder, SamplingParams
from server.errors import ApiError, abort_error
from server.generation import GenerationGroup, GenSpec
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ImageUrlPart,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from server.request_body import read_json
from server.sse import send_done, send_event, sse_stream
from server.state import STATE, ServerState

MAX_N = 128
# The engine's names for what OpenAI calls differently, so a 400 names the field the client sent.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
# A token id as OpenAI's logit_bias keys spell it: ASCII digits, no leading zeros (int() would also
# take " 1", "1_0", non-ASCII digits and "01", and "01" next to "1" would silently collide). A minus sign is let
# through so a negative id gets verify()'s range message.
_TOKEN_ID = re.compile(r"-?(?:0|[1-9][0-9]{0,17})")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
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


def _sampling(state: ServerState, req: Any, max_tokens: int | None, max_param: str = "max_tokens") -> SamplingParams:
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
        logit_bias=_logit_bias(req.logit_bias),
    )
    try:
        sp.verify(state.engine.model_info.vocab_size)
    except InvalidRequestError as e:
        param = _PARAM_NAMES.get(e.param or "", e.param)
        raise ApiError(400, e.message.replace(e.param or "\0", param or ""), param=param) from None
    return sp


def _samples(sp: SamplingParams, n: int) -> list[SamplingParams]:
    if sp.seed is None:
        return [sp] * n
    return [msgspec.structs.replace(sp, seed=sp.seed + j) for j in range(n)]


def _finish_reason(out_reason: str | None) -> str | None:
    return out_reason if out_reason in (None, "stop", "length") else "stop"


def _check_done(state: ServerState, out: ResultBuilder) -> str:
    last = out.last
    if last is None or last.finish_reason is None:
        raise ApiError(500, "the generation ended without a finish reason", type="server_error")
    if last.finish_reason == "abort":
        raise abort_error(last.error, state.engine.healthy)
    return last.finish_reason


def _usage(prompt_outs: list[Any], outs: list[ResultBuilder] | list[Any], detail: bool = True) -> Usage:
    """prompt_outs: one delta-like per distinct prompt; outs: one per choice (with completion_tokens)."""
    prompt = sum(d.prompt_tokens for d in prompt_outs if d is not None)
    cached = sum(d.cached_tokens for d in prompt_outs if d is not None)
    completion = sum(d.completion_tokens for d in outs if d is not None)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached) if detail else None)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- logprobs ---------------------------------------------------------------------------------


def _completion_logprobs(
    state: ServerState, ids: list[int], lps: list[float], tops: list, want_top: bool, offset: int
) -> CompletionLogprobs:
    tokens = [state.token_text(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top = [{state.token_text(t): lp for t, lp in row} for row in tops] if want_top else None
    return CompletionLogprobs(tokens, list(lps), top, offsets)


def _chat_logprobs(state: ServerState, ids: list[int], lps: list[float], tops: list) -> ChoiceLogprobs:
    def top(t: int, lp: float) -> TopLogprob:
        s = state.token_text(t)
        return TopLogprob(s, lp, list(s.encode()))

    content = []
    for k, (t, lp) in enumerate(zip(ids, lps)):
        s = state.token_text(t)
        row = tops[k] if k < len(tops) else []
        content.append(TokenLogprob(s, lp, list(s.encode()), [top(a, b) for a, b in row]))
    return ChoiceLogprobs(content)


# ---- /v1/completions --------------------------------------------------------------------------


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        return list(prompt)
    raise ApiError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        param="prompt",
    )


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, CompletionRequest)
    state.check_model(req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise ApiError(400, "best_of is not supported (use n)", param="best_of")
    want_lp = req.logprobs is not None
    if want_lp and not 0 <= req.logprobs <= 20:
        raise ApiError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
    sp = _sampling(state, req, 16 if req.max_tokens is None else req.max_tokens)
    prompts = _completion_prompts(req.prompt)
    n = req.n or 1
    rid = _new_id("cmpl")
    specs = [
        GenSpec(p, s, f"{rid}-{pi * n + j}", want_lp, req.logprobs or 0)
        for pi, p in enumerate(prompts)
        for j, s in enumerate(_samples(sp, n))
    ]
    echo = [(p if isinstance(p, str) else state.engine.detokenize(p)) if req.echo else "" for p in prompts]
    group = GenerationGroup(state, specs)
    created, model = int(time.time()), state.config.model_name
    if req.stream:
        return await _stream_completion(request, state, req, group, rid, created, echo, n)
    async with group:
        outs = await group.collect()
    choices = []
    for i, out in enumerate(outs):
        reason = _check_done(state, out)
        prefix = echo[i // n]
        lp = (
            _completion_logprobs(state, out.token_ids, out.logprobs, out.top_logprobs, bool(req.logprobs), len(prefix))
            if want_lp
            else None
        )
        choices.append(CompletionChoice(i, prefix + out.full_text, lp, _finish_reason(reason)))
    usage = _usage([outs[pi * n].last for pi in range(len(prompts))], [o.last for o in outs])
    return web.json_response(body=msgspec.json.encode(CompletionResponse(rid, created, model, choices, usage)))


async def _stream_completion(
    request: web.Request,
    state: ServerState,
    req: CompletionRequest,
    group: GenerationGroup,
    rid: str,
    created: int,
    echo: list[str],
    n: int,
) -> web.StreamResponse:
    model = state.config.model_name
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    last: dict[int, Any] = {}
    offsets = {i: len(echo[i // n]) for i in range(len(group.specs))}
    async with group, sse_stream(request) as resp:
        if req.echo:
            for i in range(len(group.specs)):
                await send_event(resp, CompletionResponse(rid, created, model, [CompletionChoice(i, echo[i // n])]))
        async for i, d in group:
            last[i] = d
            if d.finish_reason == "abort":  # sse_stream sends the error event and [DONE]
                raise abort_error(d.error, state.engine.healthy)
            lp = None
            if req.logprobs is not None and d.token_ids:
                lp = _completion_logprobs(
                    state, d.token_ids, d.logprobs or [], d.top_logprobs or [], bool(req.logprobs), offsets[i]
                )
                offsets[i] += sum(len(t) for t in lp.tokens)
            if not d.text and lp is None and d.finish_reason is None:
                continue
            choice = CompletionChoice(i, d.text, lp, _finish_reason(d.finish_reason))
            await send_event(resp, CompletionResponse(rid, created, model, [choice]))
        else:
            if include_usage:
                firsts = [last.get(pi * n) for pi in range(len(group.specs) // n)]
                usage = _usage(firsts, list(last.values()))
                await send_event(resp, CompletionResponse(rid, created, model, [], usage))
        await send_done(resp)
    return resp


# ---- /v1/chat/completions ---------------------------------------------------------------------


def _chat_prompt(req: ChatCompletionRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    out = []
    for k, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(isinstance(p, ImageUrlPart) for p in content):
                raise ApiError(400, "image content is not supported by this model", param=f"messages[{k}].content")
            content = "\n".join(p.text for p in content)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or ""})
    return out


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, ChatCompletionRequest)
    state.check_model(req.model)
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise ApiError(400, "only response_format {'type': 'text'} is supported", param="response_format")
    if req.tools and req.tool_choice != "none":
        raise ApiError(400, "tool calling is not supported", param="tools")
    top = req.top_logprobs or 0
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if not 0 <= top <= 20:
        raise ApiError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
    if req.max_completion_tokens is not None:
        sp = _sampling(state, req, req.max_completion_tokens, "max_completion_tokens")
    else:
        sp = _sampling(state, req, req.max_tokens)
    messages = _chat_prompt(req)
    n = req.n or 1
    rid = _new_id("chatcmpl")
    specs = [GenSpec(messages, s, f"{rid}-{j}", req.logprobs, top) for j, s in enumerate(_samples(sp, n))]
    group = GenerationGroup(state, specs)
    created, model = int(time.time()), state.config.model_name
    if req.stream:
        return await _stream_chat(request, state, req, group, rid, created)
    async with group:
        outs = await group.collect()
    choices = []
    for i, out in enumerate(outs):
        reason = _check_done(state, out)
        lp = _chat_logprobs(state, out.token_ids, out.logprobs, out.top_logprobs) if req.logprobs else None
        choices.append(ChatChoice(i, AssistantMessage(out.full_text), lp, _finish_reason(reason)))
    usage = _usage([outs[0].last], [o.last for o in outs])
    return web.json_response(body=msgspec.json.encode(ChatCompletionResponse(rid, created, model, choices, usage)))


async def _stream_chat(
    request: web.Request, state: ServerState, req: ChatCompletionRequest, group: GenerationGroup, rid: str, created: int
) -> web.StreamResponse:
    model = state.config.model_name
    include_usage = req.stream_options is not None and req.stream_options.include_usage

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(rid, created, model, choices, usage)

    last: dict[int, Any] = {}
    async with group, sse_stream(request) as resp:
        for i in range(len(group.specs)):
            await send_event(resp, chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))]))
        async for i, d in group:
            last[i] = d
            if d.finish_reason == "abort":  # sse_stream sends the error event and [DONE]
                raise abort_error(d.error, state.engine.healthy)
            lp = None
            if req.logprobs and d.token_ids:
                lp = _chat_logprobs(state, d.token_ids, d.logprobs or [], d.top_logprobs or [])
            if d.text or lp is not None:
                await send_event(resp, chunk([ChatChunkChoice(i, ChatDelta(content=d.text), lp)]))
            if d.finish_reason is not None:
                await send_event(resp, chunk([ChatChunkChoice(i, ChatDelta(), None, _finish_reason(d.finish_reason))]))
        else:
            if include_usage:
                await send_event(resp, chunk([], _usage([last.get(0)], list(last.values()))))
        await send_done(resp)
    return resp


# ---- /v1/models -------------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cfg = state.config
    card = ModelCard(cfg.model_name, int(state.engine_started_at), cfg.model_path, state.context_len)
    return web.json_response(body=msgspec.json.encode(ModelList([card])))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
