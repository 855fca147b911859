"""OpenAI tool calling for /v1/chat/completions, built on grammar-constrained decoding.

- native (the chat template renders `tools`, Hermes/Qwen style): the model writes `<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>` blocks. tool_choice "auto" leaves the text free (blocks are parsed afterwards);
  "required" or a named function constrains the output to blocks: an EBNF xgrammar builds from the call's JSON schema.
- generic (any other template, e.g. SmolLM2's): the system message describes the tools and the reply format, and a JSON
  schema forces one envelope, `{"tool_call": CALL}`, `{"tool_calls": [CALL, ...]}` or `{"response": "..."}`, so even a
  model never trained on tools replies parseably.

Pure (no engine, no I/O): a `ToolPlan` gives the template's messages and kwargs and the grammar, and parses the text,
whole or through a `StreamingToolParser` whose events add up to the same.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, NoReturn

import xgrammar as xgr

from server.errors import ApiError
from server.json_text import complete_items, decode_string, strict_loads

Obj = dict[str, Any]  # a JSON object
MAX_TOOLS = 128
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_OPEN, _CLOSE = r'root ::= "<tool_call>\n"', r'root ::= "\n</tool_call>"'  # EBNF around a call's JSON
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:123: "
_RESPONSE_START = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"response"[ \t\n\r]*:[ \t\n\r]*"')  # a plain answer's envelope
_CALLS_START = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"tool_calls"[ \t\n\r]*:[ \t\n\r]*\[')  # parallel calls' envelope
_RULES = {
    "auto": "Call a tool when it helps with the user's request; otherwise answer directly.",
    "required": "You must call a tool.",
}


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str
    parameters: Obj  # JSON schema of the arguments object
    strict: bool


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # compact JSON text of the arguments object


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when there is no text besides the calls
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:  # one entry of an OpenAI streaming chunk's `delta.tool_calls`
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamEvent:
    content: str | None = None
    tool_call: ToolCallDelta | None = None


def _bad(param: str, message: str) -> NoReturn:
    raise ApiError(400, message, param=param)


def parse_tool_request(
    tools: list[Obj] | None, tool_choice: str | Obj | None, parallel_tool_calls: bool | None
) -> ToolPlan | None:
    """Validate the request's tool fields (a 400 naming the field); None when the request does not
    use tools, so the handler's plain path stays as it was."""
    if tools is not None and not isinstance(tools, list):
        _bad("tools", "tools must be an array")
    if not tools:
        if tool_choice is None or tool_choice == "none":
            return None
        _bad("tool_choice", "tool_choice is set but no tools were given")
    if len(tools) > MAX_TOOLS:
        _bad("tools", f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    parsed = tuple(_parse_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) < len(names):
        _bad("tools", f"tool names must be unique: {sorted({n for n in names if names.count(n) > 1})}")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        _bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    choice, forced = _parse_choice(tool_choice, names)
    return ToolPlan(parsed, choice, forced, parallel_tool_calls is not False)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template (or one of the named ones) renders `tools` in the `<tool_call>` format: then the model
    was trained on it and is prompted and parsed in it. Other tool formats (Llama 3.1's, say) get the generic one."""
    template = getattr(tokenizer, "chat_template", None)
    texts = list(template.values()) if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and re.search(r"\btools\b", t) and OPEN in t for t in texts)


def _parse_tool(tool: Any, at: str) -> FunctionTool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        _bad(f"{at}.type", f'{at}.type must be "function"')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        _bad(f"{at}.function", f"{at}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        _bad(f"{at}.function.name", f"{at}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$")
    for key, kind, what in (("description", str, "a string"), ("strict", bool, "a boolean")):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            _bad(f"{at}.function.{key}", f"{at}.function.{key} must be {what}")
    param = f"{at}.function.parameters"
    params = fn.get("parameters")  # none (or {}, which would allow any value) means no arguments
    params = {"type": "object", "properties": {}} if params is None or params == {} else params
    if not isinstance(params, dict):
        _bad(param, f"{param} must be a JSON schema object")
    if params.get("type", "object") != "object":  # the arguments are always an object
        _bad(param, f'{param} must describe an object ("type": "object")')
    try:  # a test dependency only; xgrammar checks the schema when a grammar is built from it
        from jsonschema import SchemaError, validators
    except ImportError:
        pass
    else:
        try:
            validators.validator_for(params).check_schema(params)
        except SchemaError as e:
            _bad(param, f"{param} is not a valid JSON schema: {e.message}")
    return FunctionTool(name, fn.get("description") or "", params, bool(fn.get("strict")))


def _parse_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None or choice in ("none", "auto", "required"):
        return choice or "auto", None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        _bad("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {...}}')
    if name not in names:
        _bad("tool_choice", f"tool_choice names the function {name!r}, which is not among the tools")
    return "function", name


@dataclass(frozen=True)
class ToolPlan:
    """A validated tool request: how to prompt, constrain and parse for it."""

    tools: tuple[FunctionTool, ...]
    choice: str  # "none" | "auto" | "required" | "function"
    forced: str | None
    parallel: bool

    def _allows(self, name: Any) -> bool:
        """Whether the model may call `name` (only the forced tool when a function is named)."""
        return self.forced in (None, name) and any(t.name == name for t in self.tools)

    def render(self, messages: list[Obj], native: bool) -> tuple[list[Obj], Obj | None]:
        """The messages and extra kwargs for the chat template: native templates get the OpenAI tools and the calls'
        arguments as objects; generic ones get text turns in the envelope format, read like the replies asked for."""
        names: dict[str, str] = {}  # tool_call_id -> function name, for the tool results
        out: list[Obj] = []
        for m in messages:
            for call in m.get("tool_calls") or ():
                names[call.get("id")] = (call.get("function") or {}).get("name")
            out.append(self._render_native(m, names) if native else self._render_generic(m, names))
        if native:
            return out, None if self.choice == "none" else {"tools": [_openai_tool(t) for t in self.tools]}
        if self.choice != "none":  # ours goes after the client's system message, in the same one
            first = out.pop(0)["content"] + "\n\n" if out and out[0]["role"] in ("system", "developer") else ""
            out.insert(0, {"role": "system", "content": first + self._generic_prompt()})
        return out, None

    def _render_native(self, m: Obj, names: dict[str, str]) -> Obj:
        m = {**m, "content": _text(m["content"])} if isinstance(m.get("content"), list) else dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**(c.get("function") or {}), "arguments": _args(c)}} for c in m["tool_calls"]
            ]
        if m.get("role") == "tool" and "name" not in m and names.get(m.get("tool_call_id")):
            m["name"] = names[m["tool_call_id"]]
        return m

    def _render_generic(self, m: Obj, names: dict[str, str]) -> Obj:
        role, content = m.get("role", "user"), _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = [{"name": (c.get("function") or {}).get("name"), "arguments": _args(c)} for c in m["tool_calls"]]
            envelope = {"tool_call": calls[0]} if len(calls) == 1 and not self.parallel else {"tool_calls": calls}
            content = json.dumps(envelope, ensure_ascii=False)
        elif role == "assistant" and self.choice != "none":
            content = json.dumps({"response": content}, ensure_ascii=False)
        elif role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id"))
            response = {"tool_call_id": m.get("tool_call_id"), **({"name": name} if name else {}), "content": content}
            content = json.dumps({"tool_response": response}, ensure_ascii=False)
        return {"role": role, "content": content}

    def _generic_prompt(self) -> str:
        call = '{"name": "<tool name>", "arguments": {<the arguments>}}'
        many = f'{{"tool_calls": [{call}, ...]}} to call one or more tools'
        lines = [
            "You can call these tools. Each line is a tool's name, what it does and its arguments' JSON schema:",
            *(json.dumps(_openai_tool(t)["function"], ensure_ascii=False) for t in self.tools),
            "\nReply with exactly one JSON object and nothing else:",
            f"- {many}" if self.parallel else f'- {{"tool_call": {call}}} to call a tool',
            *(['- {"response": "<your answer>"} to answer without calling a tool'] if self.choice == "auto" else []),
            _RULES.get(self.choice, f"You must call the tool {self.forced}."),
            'A tool\'s result comes back as {"tool_response": {"tool_call_id": ..., "name": ..., "content": ...}}.',
        ]
        return "\n".join(lines)

    def grammar(self, native: bool) -> tuple[str, str] | None:
        """(kind, spec) for the engine, or None for free text. Generic: the envelope's JSON schema. Native: an EBNF of
        one `<tool_call>` block (several, "\\n"-separated, if parallel) when a call is required; "auto" allows prose."""
        if self.choice == "none" or (native and self.choice == "auto"):
            return None
        call = self._call_schema()  # with the "$defs" its tools need at its root
        if native:
            json_grammar = xgr.Grammar.from_json_schema(json.dumps(call, ensure_ascii=False), any_whitespace=False)
            block = xgr.Grammar.concat(xgr.Grammar.from_ebnf(_OPEN), json_grammar, xgr.Grammar.from_ebnf(_CLOSE))
            lines = str(block).split("\n")  # one rule a line: string literals escape their newlines
            if self.parallel:  # root ::= BLOCK ("\n" BLOCK)*, rewriting the root rule only
                k = next(i for i, line in enumerate(lines) if line.startswith("root ::= "))
                rule = lines[k][len("root ::= ") :]
                lines[k] = f'root ::= ({rule} ("\\n" {rule})*)'
            return "ebnf", "\n".join(lines)
        defs = call.pop("$defs", None)
        items = {"type": "array", "items": call, "minItems": 1}
        shapes = [_closed({"tool_calls": items} if self.parallel else {"tool_call": call})]
        if self.choice == "auto":
            shapes.append(_closed({"response": {"type": "string"}}))
        envelope = json.dumps({"anyOf": shapes, **({"$defs": defs} if defs else {})}, ensure_ascii=False)
        # Compact JSON (no free whitespace): fewer tokens, and small models cannot loop on indentation.
        return "ebnf", str(xgr.Grammar.from_json_schema(envelope, any_whitespace=False))

    def _call_schema(self) -> Obj:
        """CALL's schema, checking each callable tool's with xgrammar (a 400 naming the tool, not
        a grammar error pointing at response_format). A tool schema with local `$ref`s moves under
        the root's `$defs`, re-pointed: under `arguments` its "#..." would miss."""
        cases, defs = [], {}
        for i, tool in enumerate(self.tools):
            if not self._allows(tool.name):
                continue
            param = f"tools[{i}].function.parameters"
            try:
                xgr.Grammar.from_json_schema(json.dumps(tool.parameters, ensure_ascii=False))
            except (RuntimeError, ValueError, TypeError) as e:
                _bad(param, f"{param} is not supported: {_XGR_PREFIX.sub('', str(e).strip())[:500]}")
            params = {k: v for k, v in tool.parameters.items() if k != "$schema"}
            if _repoint(params, f"#/$defs/tool_{i}") != params:
                defs[f"tool_{i}"] = _repoint(params, f"#/$defs/tool_{i}")
                params = {"$ref": f"#/$defs/tool_{i}"}
            cases.append(_closed({"name": {"const": tool.name}, "arguments": params}))
        return {**(cases[0] if len(cases) == 1 else {"anyOf": cases}), **({"$defs": defs} if defs else {})}

    def parse(self, text: str, native: bool) -> ParsedOutput:
        """The whole output as OpenAI's assistant message: its content and calls."""
        if self.choice == "none":
            return ParsedOutput(text or None, [])
        return self._parse_native(text) if native else self._parse_generic(text)

    def _parse_native(self, text: str) -> ParsedOutput:
        """Calls from the recognised blocks; content is the rest, stripped (what the stream sends)."""
        parser = StreamingToolParser(self, native=True)
        events = parser.feed(text) + parser.finish()
        return ParsedOutput("".join(e.content for e in events if e.content) or None, parser.tool_calls)

    def _parse_generic(self, text: str) -> ParsedOutput:
        """The envelope. A `{"response": "...` answer is read from its prefix alone (so it streams,
        and a truncated one keeps what was said); anything unparseable is content, as it is."""
        start = _RESPONSE_START.match(text)
        if start:
            return ParsedOutput(decode_string(text, start.end(), final=True)[0], [])
        try:
            value = strict_loads(text)
        except ValueError:  # a `{"tool_calls": [...` cut by max_tokens keeps its complete calls
            value = {"tool_calls": complete_items(text, m.end())} if (m := _CALLS_START.match(text)) else None
        one_key = isinstance(value, dict) and len(value) == 1
        calls = ([value["tool_call"]] if "tool_call" in value else value.get("tool_calls")) if one_key else None
        parsed = [self._call(c) for c in calls] if isinstance(calls, list) and calls else [None]
        return ParsedOutput(text or None, []) if None in parsed else ParsedOutput(None, parsed)

    def _call(self, value: Any, count: int = 0) -> ToolCall | None:
        """The call `value` (or the JSON text of a native block) is, if it is one. `count`: calls
        so far; without parallel calls only the first is one (the others stay text)."""
        try:
            value = strict_loads(value) if isinstance(value, str) else value
            args = value.get("arguments") if isinstance(value, dict) else None
            args = strict_loads(args) if isinstance(args, str) else args
        except ValueError:
            return None
        if (count and not self.parallel) or not isinstance(args, dict) or not self._allows(value.get("name")):
            return None
        arguments = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
        return ToolCall("call_" + secrets.token_hex(12), value["name"], arguments)

    def stream_parser(self, native: bool) -> StreamingToolParser:
        return StreamingToolParser(self, native)


class StreamingToolParser:
    """One choice's text deltas as OpenAI stream events. However the text is chunked, the content events add up to
    `parse(full).content` and each call's fragments to its arguments. Native text streams, except a possible
    `<tool_call>` start and edge whitespace; a generic envelope waits for the end, but a `{"response": "...` streams."""

    def __init__(self, plan: ToolPlan, native: bool) -> None:
        self.plan, self.native = plan, native
        self.tool_calls: list[ToolCall] = []  # emitted so far, with the ids sent in the deltas
        self._buf = ""
        self._in_block = False  # native: the buffer starts with an open <tool_call>
        self._started = False  # native: content was sent (so leading whitespace is not dropped)
        self._pending_ws = ""  # native: trailing whitespace held until more text comes
        self._string_at: int | None = None  # generic: where the answer's undecoded part starts
        self._closed = False  # generic: the answer's string ended
        self._finished = False

    def feed(self, text: str) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self.plan.choice == "none":
            return _content(text)
        self._buf += text
        return self._feed_native() if self.native else self._feed_generic()

    def finish(self) -> list[StreamEvent]:
        done, self._finished = self._finished, True
        if done or self.plan.choice == "none":
            return []
        if self.native:
            return self._outside(self._buf)
        if self._string_at is not None:
            return [] if self._closed else _content(decode_string(self._buf, self._string_at, final=True)[0])
        parsed = self.plan.parse(self._buf, native=False)
        return _content(parsed.content or "") + [self._emit(call) for call in parsed.tool_calls]

    def _feed_native(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            if not self._in_block:
                i = self._buf.find(OPEN)
                if i < 0:  # keep a suffix that may start "<tool_call>"
                    keep = next((k for k in range(len(OPEN) - 1, 0, -1) if self._buf.endswith(OPEN[:k])), 0)
                    i = len(self._buf) - keep
                events += self._outside(self._buf[:i])
                self._buf, self._in_block = self._buf[i:], i < len(self._buf) and self._buf.startswith(OPEN, i)
                if not self._in_block:
                    return events
            j = self._buf.find(CLOSE, len(OPEN))
            if j < 0:
                return events
            end = j + len(CLOSE)
            call = self.plan._call(self._buf[len(OPEN) : j], len(self.tool_calls))
            events += self._outside(self._buf[:end]) if call is None else [self._emit(call)]
            self._buf, self._in_block = self._buf[end:], False

    def _outside(self, text: str) -> list[StreamEvent]:
        """Text outside blocks, sent as `parse` strips the whole: no leading whitespace, and
        trailing whitespace only once more text follows."""
        if not self._started:
            text = text.lstrip()
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body) :]
        self._started = self._started or bool(body)
        return _content(body)

    def _feed_generic(self) -> list[StreamEvent]:
        if self._string_at is None and (start := _RESPONSE_START.match(self._buf)):
            self._string_at = start.end()
        if self._string_at is None or self._closed:
            return []
        text, self._string_at, self._closed = decode_string(self._buf, self._string_at, final=False)
        return _content(text)

    def _emit(self, call: ToolCall) -> StreamEvent:
        self.tool_calls.append(call)
        return StreamEvent(tool_call=ToolCallDelta(len(self.tool_calls) - 1, call.id, call.name, call.arguments))


def _content(text: str) -> list[StreamEvent]:
    return [StreamEvent(content=text)] if text else []


def _args(call: Obj) -> Any:
    """An earlier call's arguments as an object (as the templates show them), or as sent when not JSON."""
    args = (call.get("function") or {}).get("arguments", "{}")
    try:
        return strict_loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _text(content: Any) -> str:
    """A message's content as text: None is empty, text parts are joined."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else content if isinstance(content, str) else str(content)


def _openai_tool(tool: FunctionTool) -> Obj:
    fn = {"name": tool.name, **({"description": tool.description} if tool.description else {})}
    return {"type": "function", "function": {**fn, "parameters": tool.parameters}}


def _closed(properties: Obj) -> Obj:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _repoint(schema: Any, base: str) -> Any:
    """A copy of `schema` with its local refs ("#", "#/...") made relative to `base`."""
    if isinstance(schema, dict):
        return {
            k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _repoint(v, base)
            for k, v in schema.items()
        }
    return [_repoint(v, base) for v in schema] if isinstance(schema, list) else schema
