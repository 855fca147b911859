"""OpenAI-compatible endpoints: /v1/completions and /v1/models here, /v1/chat/completions in
server/openai_chat.py, what they share in server/openai_common.py.

Each request becomes a `GenerationGroup` of `len(prompts) * n` engine generations.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from engine import PromptLogprobs
from server.errors import ApiError, abort_error
from server.generation import GenerationGroup, GenSpec
from server.openai_chat import chat_completions
from server.openai_common import (
    check_done,
    finish_reason,
    new_id,
    response_metadata,
    samples,
    sampling_params,
    usage_of,
)
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from server.request_body import read_json
from server.sse import send_done, send_event, sse_stream
from server.state import STATE, ServerState
from server.structured import incomplete_json_warning, schema_param


def _completion_logprobs(
    state: ServerState,
    ids: list[int],
    lps: list[float | None],
    tops: list | None,
    want_top: bool,
    offset: int,
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs over `ids`. Each top_logprobs dict holds the N most likely tokens
    and, as OpenAI's does, the chosen token too (so up to N + 1 entries); a position without a
    log-prob (a prompt's first token) is null there and in token_logprobs."""
    tokens = [state.token_text(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top = None
    if want_top:
        top = []
        for tok, lp, row in zip(tokens, lps, tops or [None] * len(ids)):
            if row is None or lp is None:
                top.append(None)
                continue
            d = {state.token_text(t): v for t, v in row}
            d.setdefault(tok, lp)
            top.append(d)
    return CompletionLogprobs(tokens, list(lps), top, offsets)


def _echo_logprobs(state: ServerState, prompt: PromptLogprobs | None, want_top: bool) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs (its first token has none)."""
    if prompt is None:  # the engine always sends them when asked; never answer with a silent gap
        raise ApiError(500, "the prompt's log-probs are missing", type="server_error")
    return _completion_logprobs(state, prompt.ids, prompt.values, prompt.top, want_top, 0)


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    top = a.top_logprobs + b.top_logprobs if a.top_logprobs is not None and b.top_logprobs is not None else None
    return CompletionLogprobs(
        a.tokens + b.tokens, a.token_logprobs + b.token_logprobs, top, a.text_offset + b.text_offset
    )


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
    lora = state.check_model(req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise ApiError(400, "best_of is not supported (use n)", param="best_of")
    want_lp = req.logprobs is not None
    if want_lp and not 0 <= req.logprobs <= 20:
        raise ApiError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
    # echo + logprobs scores the prompt too (what evaluation harnesses read); with max_tokens 0 it
    # only scores it, as OpenAI's legacy API allowed
    score_only = req.echo and req.max_tokens == 0
    sp = sampling_params(state, req, 16 if req.max_tokens is None else 1 if score_only else req.max_tokens)
    if score_only:
        sp = msgspec.structs.replace(sp, max_new_tokens=0)
    prompts = _completion_prompts(req.prompt)
    n = req.n or 1
    rid = new_id("cmpl")
    start = 0 if req.echo and want_lp else -1
    specs = [
        GenSpec(p, s, f"{rid}-{pi * n + j}", want_lp, req.logprobs or 0, logprob_start_len=start, lora_path=lora)
        for pi, p in enumerate(prompts)
        for j, s in enumerate(samples(sp, n))
    ]
    echo = [(p if isinstance(p, str) else state.engine.detokenize(p)) if req.echo else "" for p in prompts]
    group = GenerationGroup(state, specs, lambda p: schema_param(p, req.response_format))
    created, model = int(time.time()), lora or state.config.model_name
    if req.stream:
        return await _stream_completion(request, state, req, group, rid, created, echo, n)
    async with group:
        outs = await group.collect()
    choices = []
    for i, out in enumerate(outs):
        reason = check_done(state, out)
        prefix = echo[i // n]
        lp = None
        if want_lp:
            lp = _completion_logprobs(
                state, out.token_ids, out.logprobs, out.top_logprobs, bool(req.logprobs), len(prefix)
            )
            if req.echo:
                lp = _joined(_echo_logprobs(state, out.input_logprobs, bool(req.logprobs)), lp)
        choice = CompletionChoice(i, prefix + out.full_text, lp, finish_reason(reason))
        if warning := incomplete_json_warning(req.response_format, choice.finish_reason, out.full_text):
            choice.structured_output_warning = warning
        choices.append(choice)
    usage = usage_of([outs[pi * n].last for pi in range(len(prompts))], [o.last for o in outs])
    body = CompletionResponse(rid, created, model, choices, usage, metadata=response_metadata(state, outs[0]))
    return web.json_response(body=msgspec.json.encode(body))


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
    model = group.specs[0].lora_path or state.config.model_name  # the model the request named
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    last: dict[int, Any] = {}
    offsets = {i: len(echo[i // n]) for i in range(len(group.specs))}
    # With logprobs the echoed prompt waits for its log-probs, which come with the first delta.
    echo_first = req.echo and req.logprobs is not None
    async with group, sse_stream(request) as resp:
        if req.echo and not echo_first:
            for i in range(len(group.specs)):
                await send_event(resp, CompletionResponse(rid, created, model, [CompletionChoice(i, echo[i // n])]))
        async for i, d in group:
            last[i] = d
            if d.finish_reason == "abort":  # sse_stream sends the error event and [DONE]
                raise abort_error(d.error, state.engine.healthy)
            if echo_first and d.input_logprobs is not None:
                prompt_lp = _echo_logprobs(state, d.input_logprobs, bool(req.logprobs))
                await send_event(
                    resp, CompletionResponse(rid, created, model, [CompletionChoice(i, echo[i // n], prompt_lp)])
                )
            lp = None
            if req.logprobs is not None and d.token_ids:
                lp = _completion_logprobs(
                    state, d.token_ids, d.logprobs or [], d.top_logprobs or [], bool(req.logprobs), offsets[i]
                )
                offsets[i] += sum(len(t) for t in lp.tokens)
            if not d.text and lp is None and d.finish_reason is None:
                continue
            choice = CompletionChoice(i, d.text, lp, finish_reason(d.finish_reason))
            await send_event(resp, CompletionResponse(rid, created, model, [choice]))
        else:
            if include_usage:
                firsts = [last.get(pi * n) for pi in range(len(group.specs) // n)]
                usage = usage_of(firsts, list(last.values()))
                await send_event(resp, CompletionResponse(rid, created, model, [], usage))
        await send_done(resp)
    return resp


# ---- /v1/chat/completions ---------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cfg = state.config
    created = int(state.engine_started_at)
    card = ModelCard(cfg.model_name, created, cfg.model_path, state.context_len)
    # each loaded LoRA adapter is a model too (a request names it as `model`), vLLM's shape
    names = state.engine.lora_adapters()
    adapters = [ModelCard(name, created, name, state.context_len, parent=cfg.model_name) for name in names]
    return web.json_response(body=msgspec.json.encode(ModelList([card, *adapters])))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
