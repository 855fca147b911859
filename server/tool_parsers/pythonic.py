"""Pythonic calls (`--tool-call-parser pythonic`, Llama 3.2 / 4 style): a Python list of calls with keyword
arguments, `[get_weather(city="Paris", unit="c"), ping()]`, anywhere in the text. Read with `ast` (never evaluated):
only literals are values (JSON's true / false / null too); a list that is not all calls stays text."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import xgrammar as xgr

from server.errors import ApiError
from server.tool_parsers.base import (
    WAIT,
    Step,
    StreamingToolParser,
    ToolCall,
    ToolFormat,
    bracket_end,
    literal,
    value_rules,
)
from server.tool_parsers.plan import ToolPlan

_START = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")  # where a call list may open
_MAYBE_START = re.compile(r"\[\s*([A-Za-z_]\w*\s*)?")  # a prefix of one
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class PythonicFormat(ToolFormat):
    name = "pythonic"

    def step(self, parser: StreamingToolParser, buf: str, final: bool) -> Step:
        i = buf.find("[")
        if i:
            return Step(len(buf) if i < 0 else i)
        if not _START.match(buf):
            return WAIT if _MAYBE_START.fullmatch(buf) else Step(1)
        end = bracket_end(buf, 0, quotes="\"'")
        if end is None:
            return WAIT
        calls = _calls(parser.plan, buf[:end], len(parser.tool_calls))
        return Step(end, calls)

    def grammar(self, plan: ToolPlan) -> tuple[str, str] | None:
        """`[NAME(ARG=VALUE, ...)]` (several calls, ", "-separated, if parallel): a callable tool's arguments in its
        schema's order, the required ones always, the others maybe; values as compact JSON of their schema."""
        plan.check_schemas()
        shared: dict[str, str] = {}
        lines, calls = [], []
        for i, tool in plan.callable_tools():
            required = set(tool.parameters.get("required") or ())
            properties = tool.parameters.get("properties") or {}
            for what, name in (("name", tool.name), *(("parameters", p) for p in properties)):
                if not name.isidentifier():  # the call would not parse: refuse it now rather than return text
                    param = f"tools[{i}].function.{what}"
                    raise ApiError(400, f"{param}: {name!r} is not a Python identifier (pythonic calls)", param=param)
            items = []  # (EBNF of `name=value`, required)
            for k, (name, schema) in enumerate(properties.items()):
                value, rules = value_rules(schema, tool.parameters, f"t{i}_p{k}_", shared)
                lines += rules
                items.append((f"{literal(name + '=')} {value}", name in required))
            lines += _arguments(f"t{i}_", items)
            lines.append(f"t{i}_call ::= {literal(tool.name + '(')} t{i}_f0 {literal(')')}")
            calls.append(f"t{i}_call")
        lines.append(f"call ::= {' | '.join(calls)}")
        lines.append('root ::= "[" call (", " call)* "]"' if plan.parallel else 'root ::= "[" call "]"')
        ebnf = "\n".join([*shared.values(), *lines])
        xgr.Grammar.from_ebnf(ebnf)  # fail here, not in the engine, if it does not parse
        return "ebnf", ebnf


def _arguments(prefix: str, items: list[tuple[str, bool]]) -> list[str]:
    """Rules PREFIX f0: the arguments in order, optional ones maybe, ", " between those present. fK: from argument K
    on, none present yet; tK: from K on, some present (so a comma comes first)."""
    n = len(items)
    rules = [f'{prefix}f{n} ::= ""', f'{prefix}t{n} ::= ""']
    for k in range(n - 1, -1, -1):
        item, required = items[k]
        first = f"{item} {prefix}t{k + 1}"
        later = f'", " {item} {prefix}t{k + 1}'
        rules.append(f"{prefix}f{k} ::= {first}" if required else f"{prefix}f{k} ::= ({first}) | {prefix}f{k + 1}")
        rules.append(f"{prefix}t{k} ::= {later}" if required else f"{prefix}t{k} ::= ({later}) | {prefix}t{k + 1}")
    return rules


def _calls(plan: ToolPlan, text: str, count: int) -> list[ToolCall] | None:
    """The calls of a list `[f(a=1), g()]`, or None if it is not all allowed calls of literals."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: _literal(kw.value, text) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):  # **kwargs
            return None
        call = plan.make_call(node.func.id, args, count + len(calls))
        if call is None:
            return None
        calls.append(call)
    return calls


def _literal(node: ast.AST, source: str) -> Any:
    """A literal's value: what `ast.literal_eval` takes, JSON's names, and strings read as JSON where they are
    written as JSON strings (so "\\ud83d\\ude00" is one character, as the JSON grammar meant it)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        written = ast.get_source_segment(source, node) or ""
        if written.startswith('"'):
            try:
                return json.loads(written)
            except ValueError:
                pass
        return node.value
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand, source)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, source) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        keys = [_literal(k, source) for k in node.keys]  # type: ignore[arg-type]
        if all(isinstance(k, str) for k in keys):
            return dict(zip(keys, (_literal(v, source) for v in node.values)))
    raise ValueError("not a literal")
