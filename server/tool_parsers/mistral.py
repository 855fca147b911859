"""Mistral (`--tool-call-parser mistral`): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or, from the v11
tokenizer on, `[TOOL_CALLS]NAME[ARGS]{...}` (one marker a call). The array is all calls or text as a whole."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from server.json_text import strict_loads
from server.tool_parsers.base import (
    WAIT,
    Step,
    StreamingToolParser,
    ToolFormat,
    bracket_end,
    literal,
    repeated,
    skip_ws,
    text_before,
    wrapped_json,
)
from server.tool_parsers.plan import ToolPlan

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[a-zA-Z0-9_-]+")


class MistralFormat(ToolFormat):
    name = "mistral"
    # [TOOL_CALLS] is a control token: skipped like other special tokens, the calls would read as plain JSON.
    keep_special_tokens = True

    def __init__(self, args_style: bool = False) -> None:
        self.args_style = args_style  # the template writes `NAME[ARGS]{...}` (v11+), not the JSON array

    def grammar(self, plan: ToolPlan) -> tuple[str, str] | None:
        """What the template writes: the array (of one call unless parallel), or `[TOOL_CALLS]NAME[ARGS]{...}` of
        a callable tool, repeated if parallel."""
        if not self.args_style:
            call = plan.call_schema()
            defs = call.pop("$defs", None)
            items = {"type": "array", "items": call, "minItems": 1, **({} if plan.parallel else {"maxItems": 1})}
            return wrapped_json({**items, **({"$defs": defs} if defs else {})}, TAG + " ", "", None)
        plan.check_schemas()
        calls = []
        for _, tool in plan.callable_tools():
            head = xgr.Grammar.from_ebnf(f"root ::= {literal(TAG + tool.name + ARGS)}")
            body = xgr.Grammar.from_json_schema(json.dumps(tool.parameters, ensure_ascii=False), any_whitespace=False)
            calls.append(xgr.Grammar.concat(head, body))
        one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
        return "ebnf", repeated(str(one), "" if plan.parallel else None)

    def step(self, parser: StreamingToolParser, buf: str, final: bool) -> Step:
        i, found = text_before(buf, (TAG,), final)
        if i or not found:
            return Step(i)
        plan, count = parser.plan, len(parser.tool_calls)
        start = skip_ws(buf, len(TAG))
        if start == len(buf):
            return WAIT
        if buf[start] == "[":  # the JSON array
            end = bracket_end(buf, start)
            if end is None:
                return WAIT
            try:
                items = strict_loads(buf[start:end])
            except ValueError:
                items = None
            calls = [plan.json_call(c, count + k) for k, c in enumerate(items)] if isinstance(items, list) else []
            return Step(end, calls if calls and None not in calls else None)
        name = _NAME.match(buf, start)  # NAME[ARGS]{...}
        after = name.end() if name else start
        rest = buf[after:]
        if name is None or (after == len(buf)) or (len(rest) < len(ARGS) and ARGS.startswith(rest)):
            return WAIT if name is not None else Step(len(TAG))
        if not rest.startswith(ARGS):
            return Step(len(TAG))
        body = skip_ws(buf, after + len(ARGS))
        if body == len(buf):
            return WAIT
        end = bracket_end(buf, body) if buf[body] == "{" else -1
        if end is None:
            return WAIT
        call = plan.json_call({"name": name.group(), "arguments": buf[body:end]}, count) if end > 0 else None
        return Step(end, [call]) if call is not None else Step(len(TAG))
