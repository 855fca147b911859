"""Hermes / Qwen 2.5 (`--tool-call-parser hermes`, alias `qwen25`): calls are `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>` blocks anywhere in the text; a block that is not a valid call stays text."""

from __future__ import annotations

from server.tool_parsers.base import WAIT, Step, StreamingToolParser, ToolCall, ToolFormat, text_before, wrapped_json
from server.tool_parsers.plan import ToolPlan

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesFormat(ToolFormat):
    name = "hermes"

    def grammar(self, plan: ToolPlan) -> tuple[str, str] | None:
        """One block (several, "\\n"-separated, if parallel) of a call's compact JSON."""
        return wrapped_json(plan.call_schema(), OPEN + "\n", "\n" + CLOSE, "\n" if plan.parallel else None)

    def step(self, parser: StreamingToolParser, buf: str, final: bool) -> Step:
        i, found = text_before(buf, (OPEN,), final)
        if i or not found:
            return Step(i)
        j = buf.find(CLOSE, len(OPEN))
        if j < 0:
            return WAIT
        end = j + len(CLOSE)
        call = self.block_call(parser.plan, buf[len(OPEN) : j], len(parser.tool_calls))
        return Step(end, None if call is None else [call])

    def block_call(self, plan: ToolPlan, body: str, count: int) -> ToolCall | None:
        """The call a block's body is, if it is one."""
        return plan.json_call(body, count)
