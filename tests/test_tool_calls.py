"""OpenAI tool calling (server/tool_parsers/, the Hermes and generic formats): request validation, prompting
through real chat templates, grammars that xgrammar compiles and that accept exactly the calls we parse, and the
streaming parser, whose events must add up to the one-shot parse however the text is chunked."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from server.errors import ApiError
from server.json_text import decode_string
from server.tool_parsers import (
    ParsedOutput,
    StreamEvent,
    ToolFormat,
    ToolPlan,
    detect_format,
    get_format,
    parse_tool_request,
)

HERMES_F, GENERIC = get_format("hermes"), get_format("generic")


def _fmt(native: bool) -> ToolFormat:
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


def _tools(*names: str) -> list[dict[str, Any]]:
    params = lambda name: {"parameters": SCHEMAS[name]} if name in SCHEMAS else {}
    return [{"type": "function", "function": {"name": n, "description": f"the {n} tool", **params(n)}} for n in names]


ALL = ("get_weather", "nested", "tree", "ping")


def _plan(choice: Any = "auto", parallel: bool | None = None, names: tuple[str, ...] = ALL) -> ToolPlan:
    plan = parse_tool_request(_tools(*names), choice, parallel)
    assert plan is not None
    return plan


def _block(name: str, args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


# -- validation ----------------------------------------------------------------------------------

_OK = _tools("get_weather")


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
    (_tools(*(f"t{i}" for i in range(129))), None, None, "tools"),
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
    plan = _plan(None)
    assert (plan.choice, plan.forced, plan.parallel) == ("auto", None, True)
    assert plan.tools[3].parameters == {"type": "object", "properties": {}} and not plan.tools[0].strict
    named = _plan({"type": "function", "function": {"name": "tree"}}, parallel=False)
    assert (named.choice, named.forced, named.parallel) == ("function", "tree", False)
    assert _plan("none").grammar(GENERIC) is None and _plan("none").grammar(HERMES_F) is None
    assert _plan("auto").grammar(HERMES_F) is None
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
    plan = _plan("auto", names=("get_weather", "ping"))
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
    none_messages, none_kwargs = _plan("none").render(copy.deepcopy(CONVERSATION), HERMES_F)
    assert none_kwargs is None and none_messages == messages  # earlier calls still convert
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched


def test_render_generic_feeds_the_smollm2_template(default_tokenizer: Any) -> None:
    plan = _plan("auto", names=("get_weather", "ping"))
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
    single, _ = _plan("required", parallel=False).render(CONVERSATION[1:], GENERIC)
    assert single[0]["role"] == "system" and "You must call a tool." in single[0]["content"]
    assert json.loads(single[2]["content"]) == {"tool_call": calls["tool_calls"][0]}
    named, _ = _plan({"type": "function", "function": {"name": "ping"}}).render([], GENERIC)
    assert "You must call the tool ping." in named[0]["content"]
    plain, _ = _plan("none").render(copy.deepcopy(CONVERSATION), GENERIC)
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


def _envelope(name: str, parallel: bool, n: int = 1) -> str:
    call = {"name": name, "arguments": ARGS[name]}
    return json.dumps({"tool_calls": [call] * n} if parallel else {"tool_call": call}, ensure_ascii=False)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "tree"}}])
def test_generic_grammar_accepts_exactly_the_envelope(compiler: Any, choice: Any, parallel: bool) -> None:
    plan = _plan(choice, parallel)
    kind, spec = plan.grammar(GENERIC)  # type: ignore[misc]
    assert kind == "ebnf"  # the envelope's schema as compact JSON (no free whitespace)
    xgr.Grammar.from_ebnf(spec)
    compiled = compiler.compile_grammar(spec)
    allowed = ["tree"] if plan.forced else list(ALL)
    for name in ALL:
        text = _envelope(name, parallel)
        assert _accepts(compiled, text) == (name in allowed), text
        if name in allowed:
            parsed = plan.parse(text, GENERIC)
            assert parsed.content is None and [c.name for c in parsed.tool_calls] == [name]
            jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), plan.tools[ALL.index(name)].parameters)
    if parallel:
        assert _accepts(compiled, _envelope("tree", True, 3))
    assert not _accepts(compiled, _envelope("tree", not parallel))
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
        plan = _plan(choice, parallel)
        kind, ebnf = plan.grammar(HERMES_F)  # type: ignore[misc]
        assert kind == "ebnf"
        xgr.Grammar.from_ebnf(ebnf)
        compiled = compiler.compile_grammar(ebnf)
        allowed = ["nested"] if plan.forced else list(ALL)
        for name in ALL:
            assert _accepts(compiled, _block(name, ARGS[name])) == (name in allowed)
        two = _block("nested", ARGS["nested"]) + "\n" + _block(allowed[-1], ARGS[allowed[-1]])
        assert _accepts(compiled, two) == parallel
        parsed = plan.parse(two, HERMES_F)
        assert [c.name for c in parsed.tool_calls] == ["nested", allowed[-1]][: 2 if parallel else 1]
        for bad in ("Sure! " + _block("nested", ARGS["nested"]), _block("nested", {"user": {"name": "x"}})):
            assert not _accepts(compiled, bad)


# -- parsing -------------------------------------------------------------------------------------

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SAME = "<the text itself>"  # expected content: the text, as it is
NATIVE_CASES: list[tuple[str, str | None, list[str]]] = [
    ("Hello world", SAME, []),
    ("", None, []),
    ("  \n ", None, []),
    (f"  Let me check.\n<tool_call>\n{W}\n</tool_call>\n", "Let me check.", ["get_weather"]),
    (f"<tool_call>{W}</tool_call> mid <tool_call> {W} </tool_call> end ", "mid  end", ["get_weather"] * 2),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', None, ["get_weather"]),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', SAME, []),
    ("a <tool_call>{bad json</tool_call> b", SAME, []),
    (f"a <tool_call>\n{W}", SAME, []),
    ('<tool_call>{"name": "ping", "arguments": []}</tool_call>', SAME, []),
    ('<tool_call>{"name": "ping"}</tool_call>', SAME, []),
    (f"x <tool_call> <tool_call>{W}</tool_call> y", SAME, []),
    (f"<<tool_call>{W}</tool_call></tool_call>< <tool_", "<</tool_call>< <tool_", ["get_weather"]),
    (f"<tool_call>{W}</tool_call>\n<tool_call>{W}</tool_call>", None, ["get_weather"] * 2),
    ("é 😀 <tool_cal", SAME, []),
]
GENERIC_CASES: list[tuple[str, str | None, list[str]]] = [
    (_envelope("get_weather", False), None, ["get_weather"]),
    (_envelope("nested", True, 2), None, ["nested", "nested"]),
    (' { "response" : "Hi \\"there\\"\\n\\u00e9\\ud83d\\ude00\\/ end" }\n', 'Hi "there"\né😀/ end', []),
    ('{"response": "trunc\\u00', "trunc", []),
    ('{"response": "lone \\ud83d", "x": 1}', "lone \ufffd", []),
    ('{"response": "\\ud83d\\u0041\\udc00"}', "\ufffdA\ufffd", []),
    ('{"response": "bad \\x escape"}', "bad ", []),
    ('{"response": ""}', "", []),
    ('{"tool_call": {"name": "get_w', SAME, []),
    (_envelope("nested", True, 2)[:-12], None, ["nested"]),  # cut by max_tokens: the complete call is kept
    ('{"tool_calls": [{"name": "get_w', SAME, []),
    ('{"tool_call": {"name": "unknown", "arguments": {}}}', SAME, []),
    ('{"tool_calls": []}', SAME, []),
    ('{"respond": 1}', SAME, []),
    ('{"response": 1}', SAME, []),
    ('{"tool_call": {"name": "ping", "arguments": {"x": NaN}}}', SAME, []),
    ("plain text", SAME, []),
    ("", None, []),
]


@pytest.mark.parametrize(("text", "content", "names"), NATIVE_CASES)
def test_parse_native(text: str, content: str | None, names: list[str]) -> None:
    parsed = _plan().parse(text, HERMES_F)
    assert parsed.content == (text if content is SAME else content) and [c.name for c in parsed.tool_calls] == names
    for call in parsed.tool_calls:
        assert call.id.startswith("call_") and len(call.id) == 29 and int(call.id[5:], 16) >= 0
        assert call.arguments in ('{"city":"Paris"}', '{"city":"Rome"}')


@pytest.mark.parametrize(("text", "content", "names"), GENERIC_CASES)
def test_parse_generic(text: str, content: str | None, names: list[str]) -> None:
    parsed = _plan().parse(text, GENERIC)
    assert parsed.content == (text if content is SAME else content) and [c.name for c in parsed.tool_calls] == names
    for call in parsed.tool_calls:
        assert call.arguments == json.dumps(ARGS[call.name], ensure_ascii=False, separators=(",", ":"))
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_parse_respects_choice_and_parallel() -> None:
    two = _block("get_weather", {"city": "A"}) + _block("ping", {})
    single = _plan(parallel=False).parse(two, HERMES_F)
    assert [c.name for c in single.tool_calls] == ["get_weather"] and single.content == _block("ping", {})
    named = _plan({"type": "function", "function": {"name": "ping"}}).parse(two, HERMES_F)
    assert [c.name for c in named.tool_calls] == ["ping"]
    assert _plan("none").parse(two, HERMES_F) == ParsedOutput(two, [])


# -- streaming -----------------------------------------------------------------------------------


def _run(plan: ToolPlan, native: bool, chunks: list[str]) -> tuple[Any, list[StreamEvent]]:
    parser = plan.stream_parser(_fmt(native))
    events = [e for chunk in chunks for e in parser.feed(chunk)]
    return parser, events + parser.finish()


def _check_stream(plan: ToolPlan, native: bool, text: str, chunks: list[str]) -> None:
    expected = plan.parse(text, _fmt(native))
    parser, events = _run(plan, native, chunks)
    assert all((e.content is None) != (e.tool_call is None) and e.content != "" for e in events)
    assert "".join(e.content for e in events if e.content is not None) == (expected.content or "")
    deltas = [e.tool_call for e in events if e.tool_call is not None]
    assert len(parser.tool_calls) == len(expected.tool_calls)
    for i, (call, want) in enumerate(zip(parser.tool_calls, expected.tool_calls)):
        mine = [d for d in deltas if d.index == i]
        assert (mine[0].id, mine[0].name, call.name) == (call.id, want.name, want.name)
        assert all(d.id is None and d.name is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.arguments == want.arguments
    assert sorted({d.index for d in deltas}) == list(range(len(parser.tool_calls)))


def _chunkings(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize(
    ("native", "text"),
    [(True, case[0]) for case in NATIVE_CASES] + [(False, case[0]) for case in GENERIC_CASES],
)
def test_stream_matches_parse_for_every_chunking(native: bool, text: str) -> None:
    rng = random.Random(text)
    for plan in (_plan(), _plan(parallel=False), _plan("none")):
        for chunks in _chunkings(text, rng):
            _check_stream(plan, native, text, chunks)


def test_stream_sends_text_early() -> None:
    parser = _plan().stream_parser(HERMES_F)
    assert parser.feed("  Hi there  ") == [StreamEvent(content="Hi there")]
    assert parser.feed("<tool") == []
    assert parser.feed("> now") == [StreamEvent(content="  <tool> now")]
    parser.feed(f" <tool_call>\n{W}\n</tool_call")
    events = parser.feed(">")
    assert len(events) == 1 and events[0].tool_call is not None and events[0].tool_call.name == "get_weather"
    assert parser.finish() == []
    generic = _plan().stream_parser(GENERIC)
    assert generic.feed('{"resp') == [] and generic.feed('onse": "Hel') == [StreamEvent(content="Hel")]
    assert generic.feed("lo \\u00") == [StreamEvent(content="lo ")]
    assert generic.feed('e9"}') == [StreamEvent(content="é")] and generic.finish() == []


def test_decode_string_pieces_equal_the_whole() -> None:
    rng = random.Random(0)
    pieces = ["a", "\\n", '\\"', "\\\\", "\\u00e9", "\\ud83d\\ude00", "\\ud83d", "\\udc00", "é", "\\/", "\\t"]
    for _ in range(200):
        body = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        whole = decode_string(body + '"tail', 0, final=True)
        assert whole[2] and whole[0] == json.loads(f'"{body}"').encode("utf-16", "surrogatepass").decode(
            "utf-16", "replace"
        )
        for cut in range(len(body) + 1):
            first, pos, closed = decode_string(body[:cut], 0, final=False)
            assert not closed
            assert first + decode_string(body + '"', pos, final=True)[0] == whole[0]
