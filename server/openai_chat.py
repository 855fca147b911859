"""/v1/chat/completions: messages through the model's chat template, structured output
(response_format, server/structured.py), tool calling (server/tool_parsers/) and reasoning
models (server/reasoning.py).

Reasoning comes off the output first: the tool-call parser only ever sees the content after the
`<think>` block (`_split_reasoning`, and `reasoners` before `parsers` when streaming).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from engine import SamplingParams
from server.errors import ApiError, abort_error
from server.generation import GenerationGroup, GenSpec
from server.openai_common import (
    chat_logprobs,
    check_done,
    finish_reason,
    new_id,
    response_metadata,
    samples,
    sampling_params,
    usage_of,
)
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    FunctionCall,
    FunctionCallDelta,
    ImageUrlPart,
    ToolCallChunk,
    ToolCallOut,
    Usage,
)
from server.reasoning import ReasoningFormat, StreamingReasoningParser, reasoning_format, split
from server.request_body import read_json
from server.sse import send_done, send_event, sse_stream
from server.state import STATE, ServerState
from server.structured import incomplete_json_warning, schema_param
from server.tool_parsers import StreamingToolParser, ToolCallDelta, ToolPlan, parse_tool_request


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The chat template's input from OpenAI messages (developer -> system, text parts joined;
    images refused): what /v1/chat/completions renders and /tokenize counts."""
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    out = []
    for k, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            if any(isinstance(p, ImageUrlPart) for p in content):
                raise ApiError(400, "image content is not supported by this model", param=f"messages[{k}].content")
            content = "\n".join(p.text for p in content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if (value := getattr(m, key)) is not None:
                msg[key] = value
        out.append(msg)
    return out


def _with_tools(
    state: ServerState, req: ChatCompletionRequest, messages: list[dict[str, Any]], sp: SamplingParams
) -> tuple[ToolPlan | None, list[dict[str, Any]], dict[str, Any] | None, SamplingParams]:
    """Tool calling: the tools rendered into the prompt (by the chat template when it supports
    them, else the generic system message), and the output constrained where tool_choice asks.
    Returns the plan (None: no tools, or tool_choice "none"), messages, chat-template kwargs and
    sampling params."""
    tool_format = state.tool_format  # --tool-call-parser, or detected from the chat template
    plan = parse_tool_request(req.tools, req.tool_choice, req.parallel_tool_calls, tool_format)
    if plan is None:
        return None, messages, None, sp
    messages, template_kwargs = plan.render(messages, tool_format)
    if tool_format.keep_special_tokens and plan.choice != "none":  # its call marker is a special token
        sp = msgspec.structs.replace(sp, skip_special_tokens=False)
    constraint = plan.grammar(tool_format)  # a tool schema xgrammar cannot take is a 400 naming it
    if constraint is not None:
        if sp.grammar_spec() is not None:
            raise ApiError(
                400,
                f"tool_choice {plan.choice!r} constrains the output; it cannot be combined with "
                "response_format (json), regex or ebnf",
                param="response_format" if req.response_format else "regex" if req.regex else "ebnf",
            )
        kind, spec = constraint
        sp = msgspec.structs.replace(sp, **{kind: spec})
    return (None if plan.choice == "none" else plan), messages, template_kwargs, sp


# apply_chat_template's own parameters and the template's `messages`: the server sets them, so a
# request cannot through chat_template_kwargs (they would clash, or swap the template itself).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _template_kwargs(req: ChatCompletionRequest, tool_kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The client's chat_template_kwargs plus those tool calling renders (`tools` for a native
    template). A key in both is a 400, not a silent winner: the tool parser and grammar follow the
    `tools` field, so a template shown other tools would prompt calls the server cannot parse."""
    user = req.chat_template_kwargs
    if not user:
        return tool_kwargs
    for key in user:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ApiError(400, f"chat_template_kwargs cannot set {key!r}", param="chat_template_kwargs")
    clash = sorted(user.keys() & (tool_kwargs or {}).keys())
    if clash:
        raise ApiError(
            400,
            f"chat_template_kwargs sets {', '.join(clash)}, which the request's tools already give the "
            "chat template; send the tools in `tools` only",
            param="chat_template_kwargs",
        )
    return {**user, **(tool_kwargs or {})}


def _split_reasoning(
    state: ServerState, fmt: ReasoningFormat | None, text: str
) -> tuple[str | None, str | msgspec.UnsetType | None]:
    """(content, reasoning_content) of a whole output. Without --reasoning-parser the content is
    the text as before and reasoning_content is left out; with one, empty parts are null (SGLang's
    answer, e.g. an unterminated block at max_tokens has content null)."""
    if fmt is None:
        return text, None if state.config.reasoning_parser else msgspec.UNSET
    reasoning, content = split(fmt, text)
    return content or None, reasoning or None


def _rename(req: ChatCompletionRequest, tool_grammar: bool) -> Callable[[str | None], str | None]:
    """An engine error's field -> the client's: a tool grammar that does not compile is `tools`."""
    if tool_grammar:
        return lambda p: "tools" if p in ("json_schema", "ebnf", "regex") else p
    return lambda p: schema_param(p, req.response_format)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, ChatCompletionRequest)
    lora = state.check_model(req.model)  # a LoRA adapter's name, or None: the base model
    top = req.top_logprobs or 0
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if not 0 <= top <= 20:
        raise ApiError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
    if req.max_completion_tokens is not None:
        sp = sampling_params(state, req, req.max_completion_tokens, "max_completion_tokens")
    else:
        sp = sampling_params(state, req, req.max_tokens)
    user_grammar = sp.grammar_spec() is not None
    plan, messages, tool_kwargs, sp = _with_tools(state, req, chat_messages(req.messages), sp)
    template_kwargs = _template_kwargs(req, tool_kwargs)
    fmt = reasoning_format(state.config.reasoning_parser, req.separate_reasoning, req.chat_template_kwargs)
    n = req.n or 1
    rid = new_id("chatcmpl")
    specs = [
        GenSpec(messages, s, f"{rid}-{j}", req.logprobs, top, template_kwargs, lora_path=lora)
        for j, s in enumerate(samples(sp, n))
    ]
    group = GenerationGroup(state, specs, _rename(req, not user_grammar and sp.grammar_spec() is not None))
    created, model = int(time.time()), lora or state.config.model_name
    if req.stream:
        return await _stream_chat(request, state, req, group, rid, created, plan, fmt)
    async with group:
        outs = await group.collect()
    choices = []
    for i, out in enumerate(outs):
        reason = finish_reason(check_done(state, out))
        lp = chat_logprobs(state, out.token_ids, out.logprobs, out.top_logprobs) if req.logprobs else None
        content, reasoning = _split_reasoning(state, fmt, out.full_text)
        message = AssistantMessage(content, reasoning_content=reasoning)
        if plan is not None:  # tool calls are parsed from the content, the reasoning taken off
            parsed = plan.parse(content or "", state.tool_format)
            calls = [ToolCallOut(c.id, FunctionCall(c.name, c.arguments)) for c in parsed.tool_calls]
            message = AssistantMessage(parsed.content, tool_calls=calls or None, reasoning_content=reasoning)
            reason = "tool_calls" if calls else reason
        choice = ChatChoice(i, message, lp, reason)
        if warning := incomplete_json_warning(req.response_format, reason, out.full_text):
            choice.structured_output_warning = warning
        choices.append(choice)
    usage = usage_of([outs[0].last], [o.last for o in outs])
    body = ChatCompletionResponse(rid, created, model, choices, usage, metadata=response_metadata(state, outs[0]))
    return web.json_response(body=msgspec.json.encode(body))


def _tool_chunk(event: ToolCallDelta) -> ChatDelta:
    first = event.id is not None
    function = FunctionCallDelta(event.name, event.arguments if event.arguments or first else None)
    return ChatDelta(tool_calls=[ToolCallChunk(event.index, event.id, "function" if first else None, function)])


async def _stream_chat(
    request: web.Request,
    state: ServerState,
    req: ChatCompletionRequest,
    group: GenerationGroup,
    rid: str,
    created: int,
    plan: ToolPlan | None,
    fmt: ReasoningFormat | None,
) -> web.StreamResponse:
    model = group.specs[0].lora_path or state.config.model_name  # the model the request named
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    parsers = [plan.stream_parser(state.tool_format) if plan else None for _ in group.specs]
    reasoners = [StreamingReasoningParser(fmt) if fmt else None for _ in group.specs]

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(rid, created, model, choices, usage)

    def reasoning_deltas(i: int, text: str, done: bool) -> tuple[list[ChatDelta], str]:
        """The step's reasoning piece as its own delta, and the content left for `deltas`."""
        reasoner = reasoners[i]
        if reasoner is None:
            return [], text
        piece = reasoner.feed(text)
        if done:
            tail = reasoner.finish()
            piece = piece._replace(reasoning=piece.reasoning + tail.reasoning, content=piece.content + tail.content)
        return ([ChatDelta(reasoning_content=piece.reasoning)] if piece.reasoning else []), piece.content

    def deltas(parser: StreamingToolParser | None, text: str, done: bool) -> list[ChatDelta]:
        if parser is None:
            return [ChatDelta(content=text)] if text else []
        events = parser.feed(text) if text else []
        events += parser.finish() if done else []
        return [_tool_chunk(e.tool_call) if e.tool_call else ChatDelta(content=e.content) for e in events]

    last: dict[int, Any] = {}
    texts = [""] * len(group.specs)  # each choice's whole text, for the final chunk's JSON check
    async with group, sse_stream(request) as resp:
        for i in range(len(group.specs)):
            await send_event(resp, chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))]))
        async for i, d in group:
            last[i] = d
            texts[i] += d.text
            if d.finish_reason == "abort":  # sse_stream sends the error event and [DONE]
                raise abort_error(d.error, state.engine.healthy)
            lp = None
            if req.logprobs and d.token_ids:
                lp = chat_logprobs(state, d.token_ids, d.logprobs or [], d.top_logprobs or [])
            done = d.finish_reason is not None
            out, content = reasoning_deltas(i, d.text, done)
            out += deltas(parsers[i], content, done)
            if lp is not None and not out:
                out = [ChatDelta()]
            for k, delta in enumerate(out):  # the step's log-probs ride on its first chunk
                await send_event(resp, chunk([ChatChunkChoice(i, delta, lp if k == 0 else None)]))
            if d.finish_reason is not None:
                reason = finish_reason(d.finish_reason)
                if parsers[i] is not None and parsers[i].tool_calls:
                    reason = "tool_calls"
                final = ChatChunkChoice(i, ChatDelta(), None, reason)
                if warning := incomplete_json_warning(req.response_format, reason, texts[i]):
                    final.structured_output_warning = warning
                await send_event(resp, chunk([final]))
        else:
            if include_usage:
                await send_event(resp, chunk([], usage_of([last.get(0)], list(last.values()))))
        await send_done(resp)
    return resp
