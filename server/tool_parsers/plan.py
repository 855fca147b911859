"""A tool request, validated: the tools, tool_choice and parallel_tool_calls of /v1/chat/completions, with how to
render the conversation for the chat template, constrain the output and read calls out of it in a given format."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, NoReturn

import xgrammar as xgr

from server.errors import ApiError
from server.json_text import strict_loads
from server.tool_parsers.base import (
    FunctionTool,
    Obj,
    ParsedOutput,
    StreamingToolParser,
    ToolCall,
    ToolFormat,
    closed_object,
)

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:123: "


def _bad(param: str, message: str) -> NoReturn:
    raise ApiError(400, message, param=param)


def parse_tool_request(
    tools: list[Obj] | None,
    tool_choice: str | Obj | None,
    parallel_tool_calls: bool | None,
    fmt: ToolFormat | None = None,
) -> ToolPlan | None:
    """Validate the request's tool fields (a 400 naming the field); None when the request does not use tools, so the
    handler's plain path stays as it was. `fmt`: the format the server speaks, for its default of parallel calls."""
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
    parallel = parallel_tool_calls
    if parallel is None:  # OpenAI's default is true; a format may know better for forced calls
        parallel = not (fmt is not None and choice in ("required", "function") and fmt.single_forced_call)
    return ToolPlan(parsed, choice, forced, parallel)


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
    from jsonschema import SchemaError, validators  # imported here: only requests with tools pay for it

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
    """A validated tool request: how to prompt, constrain and parse for it, in a given `ToolFormat`."""

    tools: tuple[FunctionTool, ...]
    choice: str  # "none" | "auto" | "required" | "function"
    forced: str | None
    parallel: bool

    def allows(self, name: Any) -> bool:
        """Whether the model may call `name` (only the forced tool when a function is named)."""
        return self.forced in (None, name) and any(t.name == name for t in self.tools)

    def callable_tools(self) -> list[tuple[int, FunctionTool]]:
        """The tools a constrained output may call, with their index in the request (for error messages)."""
        return [(i, t) for i, t in enumerate(self.tools) if self.allows(t.name)]

    def tool(self, name: str) -> FunctionTool | None:
        return next((t for t in self.tools if t.name == name), None)

    def render(self, messages: list[Obj], fmt: ToolFormat) -> tuple[list[Obj], Obj | None]:
        """The messages and extra kwargs for the chat template, as `fmt` prompts."""
        return fmt.render(self, messages)

    def render_native(self, messages: list[Obj]) -> tuple[list[Obj], Obj | None]:
        """For a template that renders tools: the OpenAI tools as its `tools`, the earlier calls' arguments as objects
        (as every tool-aware template shows them), a tool result named after its call."""
        names: dict[str, str] = {}  # tool_call_id -> function name, for the tool results
        out: list[Obj] = []
        for m in messages:
            for call in m.get("tool_calls") or ():
                names[call.get("id")] = (call.get("function") or {}).get("name")
            m = {**m, "content": text_of(m["content"])} if isinstance(m.get("content"), list) else dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {**c, "function": {**(c.get("function") or {}), "arguments": arguments_of(c)}}
                    for c in m["tool_calls"]
                ]
            if m.get("role") == "tool" and "name" not in m and names.get(m.get("tool_call_id")):
                m["name"] = names[m["tool_call_id"]]
            out.append(m)
        return out, None if self.choice == "none" else {"tools": [openai_tool(t) for t in self.tools]}

    def grammar(self, fmt: ToolFormat) -> tuple[str, str] | None:
        """(kind, spec) for the engine, or None for free text: native formats constrain only a required or named
        call ("auto" leaves prose possible), the generic envelope always applies."""
        if self.choice == "none" or (fmt.native and self.choice == "auto"):
            return None
        return fmt.grammar(self)

    def parse(self, text: str, fmt: ToolFormat) -> ParsedOutput:
        """The whole output as OpenAI's assistant message: its content and calls."""
        if self.choice == "none":
            return ParsedOutput(text or None, [])
        return fmt.parse(self, text)

    def stream_parser(self, fmt: ToolFormat) -> StreamingToolParser:
        return fmt.stream_parser(self)

    def check_schemas(self) -> None:
        """A 400 naming the first callable tool whose schema xgrammar cannot take (not a grammar error pointing at
        response_format)."""
        for i, tool in self.callable_tools():
            param = f"tools[{i}].function.parameters"
            try:
                xgr.Grammar.from_json_schema(json.dumps(tool.parameters, ensure_ascii=False))
            except (RuntimeError, ValueError, TypeError) as e:
                _bad(param, f"{param} is not supported: {_XGR_PREFIX.sub('', str(e).strip())[:500]}")

    def call_schema(self, key: str = "arguments") -> Obj:
        """The JSON schema of one call, `{"name": ..., key: {...}}`, over the callable tools. A tool schema with local
        `$ref`s moves under the root's `$defs`, re-pointed: under `key` its "#..." would miss."""
        self.check_schemas()
        cases, defs = [], {}
        for i, tool in self.callable_tools():
            params = {k: v for k, v in tool.parameters.items() if k != "$schema"}
            if _repoint(params, f"#/$defs/tool_{i}") != params:
                defs[f"tool_{i}"] = _repoint(params, f"#/$defs/tool_{i}")
                params = {"$ref": f"#/$defs/tool_{i}"}
            cases.append(closed_object({"name": {"const": tool.name}, key: params}))
        return {**(cases[0] if len(cases) == 1 else {"anyOf": cases}), **({"$defs": defs} if defs else {})}

    def json_call(self, value: Any, count: int, keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
        """The call `value` (a JSON object, or its text) is, if it is one: `{"name": ..., KEY: {...}}` with KEY the
        first of `keys` present, the arguments an object or the JSON text of one."""
        try:
            value = strict_loads(value) if isinstance(value, str) else value
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        key = next((k for k in keys if k in value), None)
        if key is None:
            return None
        args = value[key]
        try:
            args = strict_loads(args) if isinstance(args, str) else args
        except ValueError:
            return None
        return self.make_call(value.get("name"), args, count)

    def make_call(self, name: Any, args: Any, count: int) -> ToolCall | None:
        """A call of `name` with `args`, if allowed. `count`: calls so far; without parallel calls only the first is
        one (the others stay text)."""
        if (count and not self.parallel) or not isinstance(args, dict) or not self.allows(name):
            return None
        try:  # Python literals (pythonic calls) may hold what JSON cannot: sets, bytes, inf
            arguments = json.dumps(args, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):
            return None
        return ToolCall("call_" + secrets.token_hex(12), name, arguments)


def arguments_of(call: Obj) -> Any:
    """An earlier call's arguments as an object (as the templates show them), or as sent when not JSON."""
    args = (call.get("function") or {}).get("arguments", "{}")
    try:
        return strict_loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def text_of(content: Any) -> str:
    """A message's content as text: None is empty, text parts are joined."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else content if isinstance(content, str) else str(content)


def openai_tool(tool: FunctionTool) -> Obj:
    fn = {"name": tool.name, **({"description": tool.description} if tool.description else {})}
    return {"type": "function", "function": {**fn, "parameters": tool.parameters}}


def _repoint(schema: Any, base: str) -> Any:
    """A copy of `schema` with its local refs ("#", "#/...") made relative to `base`."""
    if isinstance(schema, dict):
        return {
            k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _repoint(v, base)
            for k, v in schema.items()
        }
    return [_repoint(v, base) for v in schema] if isinstance(schema, list) else schema
