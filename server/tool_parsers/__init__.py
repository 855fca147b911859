"""OpenAI tool calling for /v1/chat/completions, in the format the model was trained on.

A request's tools are validated into a `ToolPlan` (plan.py); a `ToolFormat` (one module each) says how calls are
written: how the prompt carries the tools, the grammar that forces a call when tool_choice requires one, and the
parser that reads calls out of the text, whole or streamed (base.py drives the stream; the whole-text parse is the
stream over the whole text, so both always agree).

The format is `--tool-call-parser` (SGLang's names), else detected from the chat template: a template that renders
`tools` in a known format gets it natively; any other (SmolLM2's) gets the generic JSON envelope (generic.py).
"""

from __future__ import annotations

import re
from typing import Any

from server.tool_parsers.base import (
    FunctionTool,
    ParsedOutput,
    StreamEvent,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolFormat,
)
from server.tool_parsers.generic import GenericFormat
from server.tool_parsers.hermes import HermesFormat
from server.tool_parsers.llama3 import Llama3Format
from server.tool_parsers.mistral import MistralFormat
from server.tool_parsers.plan import ToolPlan, parse_tool_request
from server.tool_parsers.pythonic import PythonicFormat
from server.tool_parsers.qwen3_coder import Qwen3CoderFormat

__all__ = [
    "PARSER_NAMES",
    "FunctionTool",
    "ParsedOutput",
    "StreamEvent",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolFormat",
    "ToolPlan",
    "detect_format",
    "get_format",
    "parse_tool_request",
    "select_format",
]

# --tool-call-parser's choices: SGLang's names (qwen25 is its name for the Hermes format Qwen 2.5 uses), and generic,
# our JSON envelope for models without a tool format.
PARSER_NAMES = ("hermes", "qwen25", "llama3", "mistral", "qwen3_coder", "pythonic", "generic")

# What a template that renders `tools` shows of its format, most specific first: Qwen3-Coder's blocks also say
# <tool_call>, and Llama 3.2's pythonic templates also describe "parameters".
_SIGNS: list[tuple[str, re.Pattern[str]]] = [
    ("mistral", re.compile(re.escape("[TOOL_CALLS]"))),
    ("qwen3_coder", re.compile(r"<function=|<parameter=")),
    ("hermes", re.compile(re.escape("<tool_call>"))),
    ("pythonic", re.compile(r"\[func_name\d*\(|\[\w+\(\w+=|<\|python_start\|>")),
    ("llama3", re.compile(r"<\|python_tag\|>|\"parameters\"|'parameters'")),
]


def get_format(name: str, template: str = "") -> ToolFormat:
    """The format called `name` (one of PARSER_NAMES); `template` picks Mistral's variant."""
    if name in ("hermes", "qwen25"):
        return HermesFormat()
    if name == "llama3":
        return Llama3Format()
    if name == "mistral":
        return MistralFormat(args_style="[ARGS]" in template)
    if name == "qwen3_coder":
        return Qwen3CoderFormat()
    if name == "pythonic":
        return PythonicFormat()
    if name == "generic":
        return GenericFormat()
    raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_NAMES)}")


def _templates(tokenizer: Any) -> list[str]:
    template = getattr(tokenizer, "chat_template", None)
    texts = list(template.values()) if isinstance(template, dict) else [template]
    return [t for t in texts if isinstance(t, str)]


def detect_format(tokenizer: Any) -> str:
    """The format the chat template (or one of the named ones) renders `tools` in, or "generic" when none does."""
    for text in _templates(tokenizer):
        if re.search(r"\btools\b", text):
            for name, sign in _SIGNS:
                if sign.search(text):
                    return name
    return "generic"


def select_format(name: str | None, tokenizer: Any) -> tuple[ToolFormat, str]:
    """The format to speak (`name` from --tool-call-parser, else detected) and why, for the start-up log line."""
    template = "\n".join(_templates(tokenizer))
    if name is not None:
        return get_format(name, template), "--tool-call-parser"
    detected = detect_format(tokenizer)
    why = "the chat template does not render tools" if detected == "generic" else "detected from the chat template"
    return get_format(detected, template), why
