"""Llama 3.1 / 3.2 JSON calls (`--tool-call-parser llama3`): `{"name": ..., "parameters": {...}}` objects (also with
"arguments"), the reply's start or after `<|python_tag|>`, several separated by `;` (or whitespace). A JSON object
that is not a valid call stays text."""

from __future__ import annotations

from server.tool_parsers.base import (
    WAIT,
    Step,
    StreamingToolParser,
    ToolFormat,
    bracket_end,
    skip_ws,
    text_before,
    wrapped_json,
)
from server.tool_parsers.plan import ToolPlan

TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")


class Llama3Format(ToolFormat):
    name = "llama3"

    def grammar(self, plan: ToolPlan) -> tuple[str, str] | None:
        """A call's compact JSON with "parameters", as the Llama 3 templates ask (several "; "-separated if parallel).
        No `<|python_tag|>`: the templates ask for bare JSON with custom tools, and the tag is a special token."""
        return wrapped_json(plan.call_schema("parameters"), "", "", "; " if plan.parallel else None)

    def step(self, parser: StreamingToolParser, buf: str, final: bool) -> Step:
        if parser.mode == "after":  # after a call: `;` and whitespace, then another call, or the text goes on
            i = skip_ws(buf, 0)
            if i < len(buf) and buf[i] == ";":
                i = skip_ws(buf, i + 1)
            if i == len(buf):  # a trailing separator is dropped with the calls
                return Step(len(buf), []) if final else WAIT
            return self._call_at(parser, buf, i) or Step(0, None, "text")
        if parser.at_start and buf.lstrip():  # the reply may open with a bare call
            if buf.lstrip()[0] == "{" and (step := self._call_at(parser, buf, skip_ws(buf, 0))) is not None:
                return step
        elif parser.at_start:
            return WAIT  # only whitespace so far: a call may still open the reply
        i, found = text_before(buf, (TAG,), final)
        if i or not found:
            return Step(i, None, "text")
        return self._call_at(parser, buf, 0) or Step(len(TAG), None, "text")  # a tag without a call is text

    def _call_at(self, parser: StreamingToolParser, buf: str, i: int) -> Step | None:
        """The call at `buf[i]` (after an optional tag): a Step consuming `buf[:end]`, WAIT while it may still come,
        or None when there is none; an object that is not a call is consumed as text."""
        start = skip_ws(buf, i + len(TAG)) if buf.startswith(TAG, i) else i
        if start == len(buf) or TAG.startswith(buf[i:]):
            return WAIT
        if buf[start] != "{":
            return None
        end = bracket_end(buf, start)
        if end is None:
            return WAIT
        call = parser.plan.json_call(buf[start:end], len(parser.tool_calls), _KEYS)
        return Step(end, [call], "after") if call is not None else Step(end, None, "text")
