"""The tools, the calls and the chat templates shared by the tests of the tool-call formats beyond the generic
envelope (test_tool_parsers.py, test_tool_parsers_grammar.py, test_tool_parsers_server.py): three tools, valid calls
for them, how each format writes calls, and a chat template written for each format."""

from __future__ import annotations

import json
from typing import Any

from server.tool_parsers import ToolFormat, ToolPlan, get_format, parse_tool_request

# -- tools -----------------------------------------------------------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
}
NOTE_PARAMS = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "score": {"type": "number"},
        "meta": {"type": "object", "properties": {"k": {"type": ["integer", "null"]}}},
    },
    "required": ["text"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "note", "description": "Take a note", "parameters": NOTE_PARAMS}},
    {"type": "function", "function": {"name": "ping", "description": "Ping"}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "note": NOTE_PARAMS, "ping": {"type": "object", "properties": {}}}
# Arguments in schema order (the grammars of qwen3_coder and pythonic keep it), valid for their schemas.
CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "metric": True}),
    # xgrammar's maxLength strings take no escapes: the quotes and \n are in the unbounded strings
    ("note", {"text": "hi <3 ☃", "tags": ['say "hi"\n', "b"], "score": -1.5, "meta": {"k": None}}),
    ("ping", {}),
]
FORMATS = ("hermes", "llama3", "mistral", "mistral_args", "qwen3_coder", "pythonic")


def format_of(name: str) -> ToolFormat:
    return get_format("mistral", "[ARGS]") if name == "mistral_args" else get_format(name)


def make_plan(choice: Any = "auto", parallel: bool | None = None) -> ToolPlan:
    plan = parse_tool_request(TOOLS, choice, parallel)
    assert plan is not None
    return plan


# -- how each format writes calls (the grammars' exact spelling: compact JSON, ", " and ": ") ---------------------


def _qwen3_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _pythonic_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())


def write_calls(fmt: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    dumps = lambda v: json.dumps(v, ensure_ascii=False)
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt == "llama3":
        return "; ".join(dumps({"name": n, "parameters": a}) for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS] " + dumps([{"name": n, "arguments": a} for n, a in calls])
    if fmt == "mistral_args":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(a)}" for n, a in calls)
    if fmt == "qwen3_coder":
        blocks = []
        for n, a in calls:
            params = "".join(f"<parameter={k}>\n{_qwen3_value(v)}\n</parameter>\n" for k, v in a.items())
            blocks.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
        return "\n".join(blocks)
    assert fmt == "pythonic"
    return "[" + ", ".join(f"{n}({_pythonic_args(a)})" for n, a in calls) + "]"


# -- chat templates written for each format ----------------------------------------------------------------------

_TURNS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{CALLS}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def _template(system: str, calls: str) -> str:
    head = "{%- if tools %}<|im_start|>system\n" + system + "<|im_end|>\n{%- endif %}"
    return head + _TURNS.replace("{CALLS}", calls)


_TOOL_LIST = "{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
TEMPLATES = {
    "hermes": _template(
        "Tools:\n<tools>\n" + _TOOL_LIST + '</tools>\nCall: <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>',
        "{% for c in m.tool_calls %}<tool_call>\n"
        '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
        "\n</tool_call>{% endfor %}",
    ),
    "llama3": _template(
        "Environment: ipython\n" + _TOOL_LIST + 'Respond with {"name": function name, "parameters": dictionary of '
        "argument name and its value}, or <|python_tag|> for built-in tools.",
        '{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": '
        "{{ c.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}",
    ),
    "mistral": _template(
        "[AVAILABLE_TOOLS] [" + _TOOL_LIST + "][/AVAILABLE_TOOLS]",
        "[TOOL_CALLS] [{% for c in m.tool_calls %}"
        '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
        "{% if not loop.last %}, {% endif %}{% endfor %}]",
    ),
    "mistral_args": _template(
        "[AVAILABLE_TOOLS] [" + _TOOL_LIST + "][/AVAILABLE_TOOLS]",
        "{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}"
        "{% endfor %}",
    ),
    "qwen3_coder": _template(
        "# Tools\n" + _TOOL_LIST + "Call: <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n"
        "</function>\n</tool_call>",
        "{% for c in m.tool_calls %}<tool_call>\n<function={{ c.function.name }}>\n"
        "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n"
        "{% if v is string %}{{ v }}{% else %}{{ v | tojson }}{% endif %}\n</parameter>\n{% endfor %}"
        "</function>\n</tool_call>{% endfor %}",
    ),
    "pythonic": _template(
        _TOOL_LIST + "Call functions as [func_name1(params_name1=params_value1, params_name2=params_value2...), "
        "func_name2(params)]",
        "[{% for c in m.tool_calls %}{{ c.function.name }}("
        "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}"
        "{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]",
    ),
}


def got(plan: ToolPlan, fmt: ToolFormat, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    """(content, calls as (name, arguments)) of the one-shot parse; each call's id and compact arguments checked."""
    parsed = plan.parse(text, fmt)
    for call in parsed.tool_calls:
        assert call.id.startswith("call_") and call.arguments == json.dumps(
            json.loads(call.arguments), ensure_ascii=False, separators=(",", ":")
        )
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
