"""The tools, the arguments and the texts shared by the Hermes and generic tool-call tests (test_tool_calls.py,
test_tool_calls_parsing.py): four tools (nested objects, enums, arrays, bounded integers, recursive $refs), valid
arguments for each, and the call blocks and envelopes those formats write."""

from __future__ import annotations

import json
from typing import Any

from server.tool_parsers import ToolFormat, ToolPlan, get_format, parse_tool_request

HERMES_F, GENERIC = get_format("hermes"), get_format("generic")


def fmt_for(native: bool) -> ToolFormat:
    return HERMES_F if native else GENERIC


def _obj(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


STRINGS = {"type": "array", "items": {"type": "string"}}
WEATHER = _obj(["city"], city={"type": "string"}, unit={"enum": ["c", "f"]})
NODE = _obj(["v"], v={"type": "integer"}, kids={"type": "array", "items": {"$ref": "#/$defs/node"}})
SCHEMAS: dict[str, dict[str, Any]] = {  # nested objects, enums, arrays, bounded integers, recursive $refs
    "get_weather": WEATHER,
    "nested": _obj(
        ["user", "count"],
        user=_obj(["name"], name={"type": "string"}, tags=STRINGS),
        count={"type": "integer", "minimum": 1, "maximum": 10},
        ratio={"type": "number"},
        flag={"type": "boolean"},
    ),
    "tree": {**_obj(["root"], root={"$ref": "#/$defs/node"}), "$defs": {"node": NODE}},
}
ARGS = {  # valid arguments for each tool ("ping" has no parameters)
    "get_weather": {"city": "Paris", "unit": "c"},
    "nested": {"user": {"name": 'Zoë "Z" ☃', "tags": ["a", "b"]}, "count": 3, "ratio": 0.5, "flag": True},
    "tree": {"root": {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}},
    "ping": {},
}


def tool_defs(*names: str) -> list[dict[str, Any]]:
    params = lambda name: {"parameters": SCHEMAS[name]} if name in SCHEMAS else {}
    return [{"type": "function", "function": {"name": n, "description": f"the {n} tool", **params(n)}} for n in names]


ALL = ("get_weather", "nested", "tree", "ping")


def make_plan(choice: Any = "auto", parallel: bool | None = None, names: tuple[str, ...] = ALL) -> ToolPlan:
    plan = parse_tool_request(tool_defs(*names), choice, parallel)
    assert plan is not None
    return plan


def hermes_block(name: str, args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


def envelope(name: str, parallel: bool, n: int = 1) -> str:
    """The generic format's JSON envelope with `n` calls of `name` (one "tool_call" without parallel calls)."""
    call = {"name": name, "arguments": ARGS[name]}
    return json.dumps({"tool_calls": [call] * n} if parallel else {"tool_call": call}, ensure_ascii=False)
