"""OpenAI tool calling (server/tool_parsers/, the Hermes and generic formats): request validation, prompting
through real chat templates, and grammars that xgrammar compiles and that accept exactly the calls we parse. (The
parsers themselves, one-shot and streaming: test_tool_calls_parsing.py; the tools: tests/tool_helpers.py.)"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from server.errors import ApiError
from server.tool_parsers import detect_format, parse_tool_request
from tests.tool_helpers import ALL, ARGS, GENERIC, HERMES_F, WEATHER, envelope, hermes_block, make_plan, tool_defs

# -- validation ----------------------------------------------------------------------------------

_OK = tool_defs("get_weather")


def _fn(**function: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": function}]


_BAD_REQUESTS = [
    ("x", None, None, "tools"),
    ([{"type": "func", "function": {"name": "a"}}], None, None, "tools[0].type"),
    ([*_OK, {"type": "function"}], None, None, "tools[1].function"),
    (_fn(), None, None, "tools[0].function.name"),
    (_fn(name="a b"), None, None, "tools[0].function.name"),
    (_fn(name="a" * 65), None, None, "tools[0].function.name"),
    (_fn(name="a", description=5), None, None, "tools[0].function.description"),
    (_fn(name="a", strict="yes"), None, None, "tools[0].function.strict"),
    (_fn(name="a", parameters=[]), None, None, "tools[0].function.parameters"),
    (_OK + _fn(name="a", parameters={"type": "string"}), None, None, "tools[1].function.parameters"),
    (_fn(name="a", parameters={"properties": {"x": {"type": "nope"}}}), None, None, "tools[0].function.parameters"),
    (_OK + _OK, None, None, "tools"),
    (tool_defs(*(f"t{i}" for i in range(129))), None, None, "tools"),
    (_OK, "sometimes", None, "tool_choice"),
    (_OK, 5, None, "tool_choice"),
    (_OK, {"type": "function"}, None, "tool_choice"),
    (_OK, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
    (_OK, {"type": "other", "function": {"name": "get_weather"}}, None, "tool_choice"),
    (None, "auto", None, "tool_choice"),
    ([], "required", None, "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, None, "tool_choice"),
    (_OK, None, "yes", "parallel_tool_calls"),
]


@pytest.mark.parametrize(("tools", "choice", "parallel", "param"), _BAD_REQUESTS)
def test_invalid_requests_name_the_field(tools: Any, choice: Any, parallel: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_tool_request(tools, choice, parallel)
    assert (info.value.status, info.value.param) == (400, param)


def test_requests_without_tools_and_defaults() -> None:
    assert parse_tool_request(None, None, None) is None
    assert parse_tool_request([], "none", True) is None
    plan = make_plan(None)
    assert (plan.choice, plan.forced, plan.parallel) == ("auto", None, True)
    assert plan.tools[3].parameters == {"type": "object", "properties": {}} and not plan.tools[0].strict
    named = make_plan({"type": "function", "function": {"name": "tree"}}, parallel=False)
    assert (named.choice, named.forced, named.parallel) == ("function", "tree", False)
    assert make_plan("none").grammar(GENERIC) is None and make_plan("none").grammar(HERMES_F) is None
    assert make_plan("auto").grammar(HERMES_F) is None
    empty = parse_tool_request(_fn(name="x", parameters={}), None, None)  # {} would allow any value, not an object
    assert empty is not None and empty.tools[0].parameters == {"type": "object", "properties": {}}


def test_schema_xgrammar_cannot_compile_is_a_400_on_that_tool() -> None:
    tools = _OK + _fn(name="ext", parameters={"$ref": "#/$defs/missing"})  # a valid schema xgrammar rejects
    plan = parse_tool_request(tools, "auto", None)
    assert plan is not None
    with pytest.raises(ApiError) as info:
        plan.grammar(GENERIC)
    assert info.value.param == "tools[1].function.parameters"
    forced = parse_tool_request(tools, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert forced is not None and forced.grammar(GENERIC) is not None  # only the callable tools count


def test_detect_format(default_tokenizer: Any) -> None:
    assert detect_format(default_tokenizer) == "generic"
    tok = copy.deepcopy(default_tokenizer)
    tok.chat_template = HERMES
    assert detect_format(tok) == "hermes"
    tok.chat_template = {"default": default_tokenizer.chat_template, "tool_use": HERMES}
    assert detect_format(tok) == "hermes"
    tok.chat_template = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"  # no known format
    assert detect_format(tok) == "generic"


# -- rendering -----------------------------------------------------------------------------------

HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tc in message.tool_calls or [] %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response name="{{ message.name }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CALL_1 = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL_1]},
    {"role": "tool", "tool_call_id": "call_1", "content": "20C"},
    {"role": "assistant", "content": "It is 20C."},
    {"role": "user", "content": "And Rome?"},
]


def test_render_native_feeds_a_hermes_template(default_tokenizer: Any) -> None:
    tok = copy.deepcopy(default_tokenizer)
    tok.chat_template = HERMES
    plan = make_plan("auto", names=("get_weather", "ping"))
    messages, kwargs = plan.render(copy.deepcopy(CONVERSATION), HERMES_F)
    assert kwargs is not None and [t["function"]["name"] for t in kwargs["tools"]] == ["get_weather", "ping"]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[3]["name"] == "get_weather" and messages[1]["content"] == "Weather in Paris?"
    text = tok.apply_chat_template(messages, tools=kwargs["tools"], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n")
    assert '"name": "get_weather", "description": "the get_weather tool", "parameters": {' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response name="get_weather">\n20C\n</tool_response>' in text
    assert text.endswith("<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n")
    none_messages, none_kwargs = make_plan("none").render(copy.deepcopy(CONVERSATION), HERMES_F)
    assert none_kwargs is None and none_messages == messages  # earlier calls still convert
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched


def test_render_generic_feeds_the_smollm2_template(default_tokenizer: Any) -> None:
    plan = make_plan("auto", names=("get_weather", "ping"))
    messages, kwargs = plan.render(copy.deepcopy(CONVERSATION), GENERIC)
    assert kwargs is None and " ".join(m["role"] for m in messages) == "system user assistant tool assistant user"
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call these tools.")
    assert json.dumps({"name": "get_weather", "description": "the get_weather tool", "parameters": WEATHER}) in system
    assert '{"tool_calls": [' in system and '{"response": ' in system and '"tool_call": ' not in system
    calls = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert json.loads(messages[2]["content"]) == calls
    response = {"tool_call_id": "call_1", "name": "get_weather", "content": "20C"}
    assert json.loads(messages[3]["content"]) == {"tool_response": response}
    assert json.loads(messages[4]["content"]) == {"response": "It is 20C."}
    text = default_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools.")
    assert f"<|im_start|>tool\n{messages[3]['content']}<|im_end|>\n" in text
    # without a system message ours comes first; one call without parallel calls is a "tool_call"
    single, _ = make_plan("required", parallel=False).render(CONVERSATION[1:], GENERIC)
    assert single[0]["role"] == "system" and "You must call a tool." in single[0]["content"]
    assert json.loads(single[2]["content"]) == {"tool_call": calls["tool_calls"][0]}
    named, _ = make_plan({"type": "function", "function": {"name": "ping"}}).render([], GENERIC)
    assert "You must call the tool ping." in named[0]["content"]
    plain, _ = make_plan("none").render(copy.deepcopy(CONVERSATION), GENERIC)
    assert plain[0]["content"] == "Be brief." and plain[4]["content"] == "It is 20C."
    assert json.loads(plain[2]["content"]) == calls


# -- grammars ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(default_tokenizer: Any) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(default_tokenizer, vocab_size=49152)
    return xgr.GrammarCompiler(info, max_threads=1)


def _accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "tree"}}])
def test_generic_grammar_accepts_exactly_the_envelope(compiler: Any, choice: Any, parallel: bool) -> None:
    plan = make_plan(choice, parallel)
    kind, spec = plan.grammar(GENERIC)  # type: ignore[misc]
    assert kind == "ebnf"  # the envelope's schema as compact JSON (no free whitespace)
    xgr.Grammar.from_ebnf(spec)
    compiled = compiler.compile_grammar(spec)
    allowed = ["tree"] if plan.forced else list(ALL)
    for name in ALL:
        text = envelope(name, parallel)
        assert _accepts(compiled, text) == (name in allowed), text
        if name in allowed:
            parsed = plan.parse(text, GENERIC)
            assert parsed.content is None and [c.name for c in parsed.tool_calls] == [name]
            jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), plan.tools[ALL.index(name)].parameters)
    if parallel:
        assert _accepts(compiled, envelope("tree", True, 3))
    assert not _accepts(compiled, envelope("tree", not parallel))
    assert _accepts(compiled, '{"response": "hi \\"you\\"\\n"}') == (plan.choice == "auto")
    assert not _accepts(compiled, '{"tool_call": {"name": "get_weather", "arguments": {"city": 5}}}')
    assert not _accepts(compiled, '{"tool_calls": []}')
    # the history the generic prompt shows is in the format the grammar allows
    history = {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "tree", "arguments": "{}"}}]}
    shown = plan.render([history], GENERIC)[0][-1]["content"]
    assert _accepts(compiled, shown.replace("{}", json.dumps(ARGS["tree"])))


@pytest.mark.parametrize("parallel", [True, False])
def test_native_grammar_is_ebnf_of_call_blocks(compiler: Any, parallel: bool) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "nested"}}):
        plan = make_plan(choice, parallel)
        kind, ebnf = plan.grammar(HERMES_F)  # type: ignore[misc]
        assert kind == "ebnf"
        xgr.Grammar.from_ebnf(ebnf)
        compiled = compiler.compile_grammar(ebnf)
        allowed = ["nested"] if plan.forced else list(ALL)
        for name in ALL:
            assert _accepts(compiled, hermes_block(name, ARGS[name])) == (name in allowed)
        two = hermes_block("nested", ARGS["nested"]) + "\n" + hermes_block(allowed[-1], ARGS[allowed[-1]])
        assert _accepts(compiled, two) == parallel
        parsed = plan.parse(two, HERMES_F)
        assert [c.name for c in parsed.tool_calls] == ["nested", allowed[-1]][: 2 if parallel else 1]
        for bad in ("Sure! " + hermes_block("nested", ARGS["nested"]), hermes_block("nested", {"user": {"name": "x"}})):
            assert not _accepts(compiled, bad)
