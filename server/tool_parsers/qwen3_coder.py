"""Qwen3-Coder (`--tool-call-parser qwen3_coder`): XML-ish blocks,

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

where VALUE is raw text, converted to the JSON type the tool's schema gives the argument (a string stays as written,
numbers, booleans, null, objects and arrays are read; a value that does not read as its type stays a string)."""

from __future__ import annotations

import ast
import re
from typing import Any

import xgrammar as xgr

from server.json_text import strict_loads
from server.tool_parsers.base import ToolCall, literal, value_rules
from server.tool_parsers.hermes import CLOSE, OPEN, HermesFormat
from server.tool_parsers.plan import ToolPlan

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_INTEGER = re.compile(r"-?\d+")
NL = "\n"


class Qwen3CoderFormat(HermesFormat):
    name = "qwen3_coder"

    def block_call(self, plan: ToolPlan, body: str, count: int) -> ToolCall | None:
        m = _FUNCTION.fullmatch(body)
        tool = plan.tool(m.group(1).strip()) if m else None
        if m is None or tool is None:
            return None
        properties = tool.parameters.get("properties") or {}
        args, at = {}, 0
        for p in _PARAMETER.finditer(m.group(2)):
            if m.group(2)[at : p.start()].strip():  # text between parameters: not this format
                return None
            value = p.group(2).removeprefix("\n").removesuffix("\n")
            args[p.group(1).strip()] = _convert(value, properties.get(p.group(1).strip()))
            at = p.end()
        if m.group(2)[at:].strip():
            return None
        return plan.make_call(tool.name, args, count)

    def grammar(self, plan: ToolPlan) -> tuple[str, str] | None:
        """Blocks of a callable tool's parameters in its schema's order, the required ones always, the others maybe:
        strings as raw text without "</" (an enum's as its values; maxLength and pattern are not enforced), other
        values as compact JSON of their schema."""
        plan.check_schemas()
        shared: dict[str, str] = {}
        lines, blocks = [], []
        for i, tool in plan.callable_tools():
            required = set(tool.parameters.get("required") or ())
            params = []
            for k, (name, schema) in enumerate((tool.parameters.get("properties") or {}).items()):
                value = _raw_string(schema)
                if value is None:
                    value, rules = value_rules(schema, tool.parameters, f"t{i}_p{k}_", shared)
                    lines += rules
                param = f"{literal(f'<parameter={name}>' + NL)} {value} {literal(NL + '</parameter>' + NL)}"
                params.append(f"({param})" if name in required else f"({param})?")
            head = literal(f"{OPEN}\n<function={tool.name}>\n")
            lines.append(f"t{i}_call ::= {head} {' '.join(params)} {literal('</function>' + NL + CLOSE)}")
            blocks.append(f"t{i}_call")
        lines.append(f"call ::= {' | '.join(blocks)}")
        lines.append('root ::= call ("\\n" call)*' if plan.parallel else "root ::= call")
        # Raw text never holds "</" (so no "</parameter>"); a lone "<" may be there.
        ebnf = "\n".join([*shared.values(), *lines, 'raw_text ::= ([^<] | "<" [^/])*'])
        xgr.Grammar.from_ebnf(ebnf)  # fail here, not in the engine, if it does not parse
        return "ebnf", ebnf


def _raw_string(schema: Any) -> str | None:
    """A string argument's EBNF as raw text, or None for a JSON value."""
    if not isinstance(schema, dict):
        return None
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        strings = values and all(isinstance(v, str) for v in values)
        return f"({' | '.join(literal(v) for v in values)})" if strings else None
    return "raw_text" if schema.get("type") == "string" else None


def _convert(text: str, schema: Any) -> Any:
    """A raw parameter value as the JSON type its schema says (the first of its types that the text reads as)."""
    schema = schema if isinstance(schema, dict) else {}
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []
    stripped = text.strip()
    if not types:  # no type (an enum, anyOf, or an argument the schema does not name): JSON if it reads as JSON
        value = _json(stripped)
        if value is _NOT or ("enum" in schema and value not in schema["enum"] and text in schema["enum"]):
            return text
        return value
    for t in types:
        if t == "string":
            return text
        if t == "null" and stripped.lower() in ("null", "none"):
            return None
        if t == "integer" and _INTEGER.fullmatch(stripped):
            return int(stripped)
        if t == "number" and isinstance(value := _json(stripped), (int, float)) and not isinstance(value, bool):
            return value
        if t == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if t in ("object", "array"):
            value = _json(stripped)
            if value is _NOT:
                try:  # Python literals ('single quotes', True) are common in what models write
                    value = ast.literal_eval(stripped)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
            if isinstance(value, dict if t == "object" else list):
                return value
    return text


_NOT = object()


def _json(text: str) -> Any:
    try:
        return strict_loads(text)
    except ValueError:
        return _NOT
