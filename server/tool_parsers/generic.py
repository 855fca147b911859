"""The generic envelope, for chat templates that do not render tools (SmolLM2's): the system message describes the tools
and the reply format, and a JSON schema forces one envelope, `{"tool_call": CALL}`, `{"tool_calls": [CALL, ...]}` or
`{"response": "..."}`, so even a model never trained on tools replies parseably."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from server.json_text import complete_items, decode_string, strict_loads
from server.tool_parsers.base import (
    Obj,
    ParsedOutput,
    Step,
    StreamEvent,
    StreamingToolParser,
    ToolFormat,
    closed_object,
    content_events,
)
from server.tool_parsers.plan import ToolPlan, arguments_of, openai_tool, text_of

_RESPONSE_START = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"response"[ \t\n\r]*:[ \t\n\r]*"')  # a plain answer's envelope
_CALLS_START = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"tool_calls"[ \t\n\r]*:[ \t\n\r]*\[')  # parallel calls' envelope
_RULES = {
    "auto": "Call a tool when it helps with the user's request; otherwise answer directly.",
    "required": "You must call a tool.",
}


class GenericFormat(ToolFormat):
    name = "generic"
    native = False
    # A model never trained on tools, constrained to `{"tool_calls": [CALL, ...]}` with a call required, repeats the
    # same call until max_tokens (the grammar lets it go on, nothing tells it to stop): a client that asked for a
    # required call without asking for parallel calls wants one call, so it gets the `{"tool_call": CALL}` envelope.
    # Explicit parallel_tool_calls: true keeps the array, as asked.
    single_forced_call = True

    def render(self, plan: ToolPlan, messages: list[Obj]) -> tuple[list[Obj], Obj | None]:
        """Text turns in the envelope format, read like the replies asked for; the tools in the system message."""
        names: dict[str, str] = {}  # tool_call_id -> function name, for the tool results
        out: list[Obj] = []
        for m in messages:
            for call in m.get("tool_calls") or ():
                names[call.get("id")] = (call.get("function") or {}).get("name")
            out.append(_render(plan, m, names))
        if plan.choice != "none":  # ours goes after the client's system message, in the same one
            first = out.pop(0)["content"] + "\n\n" if out and out[0]["role"] in ("system", "developer") else ""
            out.insert(0, {"role": "system", "content": first + _prompt(plan)})
        return out, None

    def grammar(self, plan: ToolPlan) -> tuple[str, str] | None:
        call = plan.call_schema()  # with the "$defs" its tools need at its root
        defs = call.pop("$defs", None)
        items = {"type": "array", "items": call, "minItems": 1}
        shapes = [closed_object({"tool_calls": items} if plan.parallel else {"tool_call": call})]
        if plan.choice == "auto":
            shapes.append(closed_object({"response": {"type": "string"}}))
        envelope = json.dumps({"anyOf": shapes, **({"$defs": defs} if defs else {})}, ensure_ascii=False)
        # Compact JSON (no free whitespace): fewer tokens, and small models cannot loop on indentation.
        return "ebnf", str(xgr.Grammar.from_json_schema(envelope, any_whitespace=False))

    def parse(self, plan: ToolPlan, text: str) -> ParsedOutput:
        """The envelope. A `{"response": "...` answer is read from its prefix alone (so it streams, and a truncated one
        keeps what was said); anything unparseable is content, as it is."""
        start = _RESPONSE_START.match(text)
        if start:
            return ParsedOutput(decode_string(text, start.end(), final=True)[0], [])
        try:
            value = strict_loads(text)
        except ValueError:  # a `{"tool_calls": [...` cut by max_tokens keeps its complete calls
            value = {"tool_calls": complete_items(text, m.end())} if (m := _CALLS_START.match(text)) else None
        one_key = isinstance(value, dict) and len(value) == 1
        calls = ([value["tool_call"]] if "tool_call" in value else value.get("tool_calls")) if one_key else None
        parsed = [plan.json_call(c, 0) for c in calls] if isinstance(calls, list) and calls else [None]
        return ParsedOutput(text or None, []) if None in parsed else ParsedOutput(None, parsed)

    def stream_parser(self, plan: ToolPlan) -> StreamingToolParser:
        return _GenericStream(plan, self)

    def step(self, parser: StreamingToolParser, buf: str, final: bool) -> Step:
        raise NotImplementedError  # the envelope streams its own way


class _GenericStream(StreamingToolParser):
    """The envelope waits for the end, but a `{"response": "...` answer streams."""

    _string_at: int | None = None  # where the answer's undecoded part starts
    _closed: bool = False  # the answer's string ended

    def _drain(self, final: bool) -> list[StreamEvent]:
        if final:
            if self._string_at is not None:
                return [] if self._closed else content_events(decode_string(self._buf, self._string_at, final=True)[0])
            parsed = self.fmt.parse(self.plan, self._buf)
            return content_events(parsed.content or "") + [self._emit(call) for call in parsed.tool_calls]
        if self._string_at is None and (start := _RESPONSE_START.match(self._buf)):
            self._string_at = start.end()
        if self._string_at is None or self._closed:
            return []
        text, self._string_at, self._closed = decode_string(self._buf, self._string_at, final=False)
        return content_events(text)


def _render(plan: ToolPlan, m: Obj, names: dict[str, str]) -> Obj:
    role, content = m.get("role", "user"), text_of(m.get("content"))
    if role == "assistant" and m.get("tool_calls"):
        calls = [{"name": (c.get("function") or {}).get("name"), "arguments": arguments_of(c)} for c in m["tool_calls"]]
        envelope = {"tool_call": calls[0]} if len(calls) == 1 and not plan.parallel else {"tool_calls": calls}
        content = json.dumps(envelope, ensure_ascii=False)
    elif role == "assistant" and plan.choice != "none":
        content = json.dumps({"response": content}, ensure_ascii=False)
    elif role == "tool":
        name = m.get("name") or names.get(m.get("tool_call_id"))
        response = {"tool_call_id": m.get("tool_call_id"), **({"name": name} if name else {}), "content": content}
        content = json.dumps({"tool_response": response}, ensure_ascii=False)
    return {"role": role, "content": content}


def _prompt(plan: ToolPlan) -> str:
    call = '{"name": "<tool name>", "arguments": {<the arguments>}}'
    many = f'{{"tool_calls": [{call}, ...]}} to call one or more tools'
    lines = [
        "You can call these tools. Each line is a tool's name, what it does and its arguments' JSON schema:",
        *(json.dumps(openai_tool(t)["function"], ensure_ascii=False) for t in plan.tools),
        "\nReply with exactly one JSON object and nothing else:",
        f"- {many}" if plan.parallel else f'- {{"tool_call": {call}}} to call a tool',
        *(['- {"response": "<your answer>"} to answer without calling a tool'] if plan.choice == "auto" else []),
        _RULES.get(plan.choice, f"You must call the tool {plan.forced}."),
        'A tool\'s result comes back as {"tool_response": {"tool_call_id": ..., "name": ..., "content": ...}}.',
    ]
    return "\n".join(lines)
