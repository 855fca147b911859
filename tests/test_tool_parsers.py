"""Tool-call formats beyond the generic envelope (server/tool_parsers/): each format with a chat template written for
it (detection, rendering the conversation, the rendered calls read back), its whole-text parser against cases, its
streaming parser at every split point, its grammar (xgrammar compiles it and it accepts exactly the calls the parser
reads), and the end-to-end flow through the real server and the `openai` client: a Llama-3 template forced with the
grammar, and the default model's required call (one call, not the same call twice)."""

from __future__ import annotations

import copy
import json
import random
import shutil
from typing import Any

import jsonschema
import openai
import pytest
import xgrammar as xgr

from server.cli import TOOL_CALL_PARSERS, parse_args
from server.errors import ApiError
from server.tool_parsers import (
    PARSER_NAMES,
    StreamEvent,
    ToolFormat,
    ToolPlan,
    detect_format,
    get_format,
    parse_tool_request,
    select_format,
)
from tests.server_helpers import ServerProcess, shared_server, tiny_model_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(600)

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


def _format(name: str) -> ToolFormat:
    return get_format("mistral", "[ARGS]") if name == "mistral_args" else get_format(name)


def _plan(choice: Any = "auto", parallel: bool | None = None) -> ToolPlan:
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


@pytest.fixture(scope="module")
def tokenizers(default_tokenizer: Any) -> dict[str, Any]:
    out = {}
    for name, template in TEMPLATES.items():
        tok = copy.deepcopy(default_tokenizer)
        tok.chat_template = template
        out[name] = tok
    return out


def test_detection_from_the_chat_template(tokenizers: dict[str, Any], default_tokenizer: Any) -> None:
    for name, tok in tokenizers.items():
        assert detect_format(tok) == name.removesuffix("_args"), name
        fmt, why = select_format(None, tok)
        assert fmt.name == name.removesuffix("_args") and why == "detected from the chat template"
    assert _format("mistral_args").args_style and not select_format(None, tokenizers["mistral"])[0].args_style
    assert select_format(None, tokenizers["mistral_args"])[0].args_style  # the variant follows the template
    assert detect_format(default_tokenizer) == "generic"  # SmolLM2's template does not render tools
    # the flag wins over detection; qwen25 is SGLang's name for the Hermes format
    fmt, why = select_format("pythonic", tokenizers["hermes"])
    assert (fmt.name, why) == ("pythonic", "--tool-call-parser")
    assert select_format("qwen25", default_tokenizer)[0].name == "hermes"
    assert select_format("generic", tokenizers["hermes"])[0].name == "generic"
    with pytest.raises(ValueError):
        get_format("nope")


def test_the_flag() -> None:
    assert TOOL_CALL_PARSERS == PARSER_NAMES  # cli.py mirrors them without importing xgrammar
    assert parse_args(["--tool-call-parser", "llama3"])[1].tool_call_parser == "llama3"
    assert parse_args([])[1].tool_call_parser is None
    with pytest.raises(SystemExit) as e:
        parse_args(["--tool-call-parser", "llama9"])
    assert e.value.code == 2


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris, and note it."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for k, (n, a) in enumerate(CALLS)
        ],
    },
    {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
    {"role": "user", "content": "Thanks"},
]


@pytest.mark.parametrize("name", FORMATS)
def test_template_renders_calls_the_parser_reads_back(tokenizers: dict[str, Any], name: str) -> None:
    """The tools reach the template, and the earlier calls it shows the model are what the parser reads."""
    plan, fmt, tok = _plan(), _format(name), tokenizers[name]
    messages, kwargs = plan.render(copy.deepcopy(HISTORY), fmt)
    assert kwargs is not None and [t["function"]["name"] for t in kwargs["tools"]] == ["get_weather", "note", "ping"]
    prompt = tok.apply_chat_template(messages, tools=kwargs["tools"], tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather", "description": "Weather"' in prompt
    shown = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = plan.parse(shown, fmt)
    assert parsed.content is None and [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == CALLS


# -- parsing ---------------------------------------------------------------------------------------------------------

W = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'
WP = '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}'
ROME = ("get_weather", {"city": "Rome", "days": 2})
SAME = "<the text itself>"
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]]] = {
    "llama3": [
        (WP, None, [ROME]),
        (f"  {WP} ;\n {WP}", None, [ROME, ROME]),
        (f"{WP}\n{WP} and done", "and done", [ROME, ROME]),
        (f"Sure.<|python_tag|>{WP}", "Sure.", [ROME]),
        (f"<|python_tag|> {W}; ", None, [ROME]),
        ('{"name": "nope", "parameters": {}}', SAME, []),
        ('{"answer": 42}', SAME, []),
        (f"I think {WP}", SAME, []),  # a call must open the reply or follow the tag
        (f"{WP}; oops", "; oops", [ROME]),
        ("<|python_tag|>print(1)", SAME, []),
        ('<|python_tag|>{"name": "ping", "parameters": {}', SAME, []),
        (f"{WP[:-1]}", SAME, []),
        ("<|python_ta", SAME, []),
        ('{"name": "ping"}', SAME, []),
        ("", None, []),
    ],
    "mistral": [
        (f"[TOOL_CALLS] [{W}]", None, [ROME]),
        (f"Ok. [TOOL_CALLS][{W}, {W}] bye", "Ok.  bye", [ROME, ROME]),
        (f'[TOOL_CALLS] [{W}, {{"name": "x", "arguments": {{}}}}]', SAME, []),  # all calls, or text
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]ping[ARGS]{}',
            None,
            [ROME, ("ping", {})],
        ),
        ("[TOOL_CALLS]ping[ARGS]", SAME, []),
        ("[TOOL_CALLS]ping[ARG]{}", SAME, []),
        ("[TOOL_CALLS] hello", SAME, []),
        ("[TOOL_CALLS]nope[ARGS]{}", SAME, []),
        (f"[TOOL_CALLS] [{W}", SAME, []),
        ("[TOOL_CA", SAME, []),
        ("no calls [x]", SAME, []),
    ],
    "qwen3_coder": [
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call>",
            None,
            [ROME],
        ),
        (
            "Let me note.\n<tool_call>\n<function=note>\n<parameter=text>\n  two\nlines \n</parameter>\n"
            "<parameter=tags>\n['x', 'y']\n</parameter>\n<parameter=score>\n7\n</parameter>\n<parameter=meta>\n"
            '{"k": null}\n</parameter>\n<parameter=extra>\n[1, 2]\n</parameter>\n</function>\n</tool_call>',
            "Let me note.",
            [("note", {"text": "  two\nlines ", "tags": ["x", "y"], "score": 7, "meta": {"k": None}, "extra": [1, 2]})],
        ),
        (  # a value that is not its type stays a string; a missing </parameter> ends at the next one
            "<tool_call><function=get_weather><parameter=city>Rome<parameter=days>two</parameter>"
            "<parameter=metric>TRUE</parameter></function></tool_call>",
            None,
            [("get_weather", {"city": "Rome", "days": "two", "metric": True})],
        ),
        ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", SAME, []),
        ("<tool_call>\n<function=ping>\nstray\n</function>\n</tool_call>", SAME, []),
        ("<tool_call>\n<function=ping>\n</function>\n</tool_call>", None, [("ping", {})]),
        ("<tool_call>\n<function=ping>", SAME, []),
    ],
    "pythonic": [
        ('[get_weather(city="Rome", days=2)]', None, [ROME]),
        ("Sure: [get_weather(city='Rome', days=+2), ping()] ok", "Sure:  ok", [ROME, ("ping", {})]),
        (
            '[note(text="\\ud83d\\ude00 é", tags=("a",), score=-1e2, meta={"k": null})]',
            None,
            [("note", {"text": "😀 é", "tags": ["a"], "score": -100.0, "meta": {"k": None}})],
        ),
        ("[get_weather('Rome', days=2)]", SAME, []),  # positional
        ("[get_weather(city=Rome, days=2)]", SAME, []),  # a name, not a literal
        ("[get_weather(city=__import__('os'), days=2)]", SAME, []),  # never evaluated
        ("[nope()]", SAME, []),
        ("[ping(), 3]", SAME, []),
        ("[ping(**{})]", SAME, []),
        ("[note(text={1, 2})]", SAME, []),  # a set is not JSON
        ("see [1] and [x] and [ping(]", SAME, []),
        ("[ping()", SAME, []),
        ("[ ping ( ) ]", None, [("ping", {})]),
    ],
    "hermes": [
        (f"Hi <tool_call>\n{W}\n</tool_call>", "Hi", [ROME]),
        (f"<tool_call>{WP}</tool_call>", SAME, []),  # "parameters" is Llama's key, not Hermes'
    ],
}


def _got(plan: ToolPlan, fmt: ToolFormat, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    parsed = plan.parse(text, fmt)
    for call in parsed.tool_calls:
        assert call.id.startswith("call_") and call.arguments == json.dumps(
            json.loads(call.arguments), ensure_ascii=False, separators=(",", ":")
        )
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("name", "text", "content", "calls"), ALL_CASES)
def test_parse(name: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    assert _got(_plan(), _format(name), text) == (text if content is SAME else content, calls)


def test_parallel_and_named_choice_limit_the_calls() -> None:
    one = _plan(parallel=False)
    assert _got(one, _format("llama3"), f"{WP}; {WP}") == ("; " + WP, [ROME])
    assert _got(one, _format("pythonic"), "[ping(), ping()]") == ("[ping(), ping()]", [])  # all of the list or none
    named = _plan({"type": "function", "function": {"name": "ping"}})
    assert _got(named, _format("mistral"), f"[TOOL_CALLS] [{W}]") == (f"[TOOL_CALLS] [{W}]", [])
    assert _got(_plan("none"), _format("pythonic"), "[ping()]") == ("[ping()]", [])


def _check_stream(plan: ToolPlan, fmt: ToolFormat, text: str, chunks: list[str]) -> None:
    expected = plan.parse(text, fmt)
    parser = plan.stream_parser(fmt)
    events: list[StreamEvent] = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    assert all((e.content is None) != (e.tool_call is None) and e.content != "" for e in events)
    assert "".join(e.content or "" for e in events) == (expected.content or "")
    deltas = [e.tool_call for e in events if e.tool_call is not None]
    assert [(d.index, d.name, d.arguments) for d in deltas] == [
        (k, c.name, c.arguments) for k, c in enumerate(expected.tool_calls)
    ]
    assert [d.id for d in deltas] == [c.id for c in parser.tool_calls]


def _chunkings(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


STREAM_CASES = ALL_CASES + [(name, write_calls(name, CALLS), None, CALLS) for name in FORMATS]


@pytest.mark.parametrize(("name", "text"), [(c[0], c[1]) for c in STREAM_CASES])
def test_stream_matches_parse_for_every_split(name: str, text: str) -> None:
    rng, fmt = random.Random(text), _format(name)
    for plan in (_plan(), _plan(parallel=False)):
        for chunks in _chunkings(text, rng):
            _check_stream(plan, fmt, text, chunks)


def test_stream_sends_text_before_a_call_early() -> None:
    fmt = _format("llama3")
    parser = _plan().stream_parser(fmt)
    assert parser.feed("  ") == [] and parser.feed("Let me check. <|python") == [StreamEvent(content="Let me check.")]
    assert parser.feed("_tag|>" + WP[:-1]) == []
    events = parser.feed("}")
    assert len(events) == 1 and events[0].tool_call is not None and events[0].tool_call.name == "get_weather"
    pythonic = _plan().stream_parser(_format("pythonic"))
    assert "".join(e.content or "" for e in pythonic.feed("See [1] ")) == "See [1]" and pythonic.feed("[pi") == []


# -- grammars --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(default_tokenizer: Any) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(default_tokenizer, vocab_size=49152)
    return xgr.GrammarCompiler(info, max_threads=1)


def _accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("parallel", [True, False])
def test_grammar_accepts_exactly_the_calls_the_parser_reads(compiler: Any, name: str, parallel: bool) -> None:
    fmt = _format(name)
    assert _plan("auto").grammar(fmt) is None  # auto leaves prose possible
    for choice in ("required", {"type": "function", "function": {"name": "note"}}):
        plan = _plan(choice, parallel)
        kind, spec = plan.grammar(fmt)  # type: ignore[misc]
        assert kind == "ebnf"
        compiled = compiler.compile_grammar(spec)
        allowed = [c for c in CALLS if plan.forced in (None, c[0])]
        for call in CALLS:
            text = write_calls(name, [call])
            assert _accepts(compiled, text) == (call in allowed), text
            if call in allowed:
                assert _got(plan, fmt, text) == (None, [call])
                jsonschema.validate(call[1], SCHEMAS[call[0]])
        assert _accepts(compiled, write_calls(name, allowed)) == (parallel or len(allowed) == 1)
        if parallel:
            assert _got(plan, fmt, write_calls(name, allowed)) == (None, allowed)
        note = ("note", {"text": "x"})  # optional arguments may be left out
        assert _accepts(compiled, write_calls(name, [note]))
        for bad in (
            "Sure! " + write_calls(name, [note]),
            write_calls(name, [("note", {"tags": ["a"]})]),  # a required argument missing
            write_calls(name, [("note", {"text": "x", "bogus": 1})]),
            write_calls(name, [("note", {"text": "x" * 21})]) if name != "qwen3_coder" else "",  # maxLength
            write_calls(name, [("get_weather", {"city": "Oslo", "days": 1})]),
            write_calls(name, [("get_weather", {"city": "Rome", "days": 9})]),
        ):
            assert not _accepts(compiled, bad), bad


def test_grammar_with_refs_and_a_schema_xgrammar_rejects() -> None:
    node = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"],
    }
    tree = {
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/node"}},
        "required": ["root"],
        "$defs": {"node": node},
    }
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}}]
    plan = parse_tool_request(tools, "required", None)
    assert plan is not None
    for name in FORMATS:
        _, spec = plan.grammar(_format(name))  # type: ignore[misc]
        compiled = xgr.Grammar.from_ebnf(spec)
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(compiled))
        text = write_calls(name, [("tree", {"root": {"v": 1, "kids": [{"v": 2}]}})])
        assert matcher.accept_string(text) and matcher.is_completed(), (name, text)
    dashed = parse_tool_request([{"type": "function", "function": {"name": "get-x"}}], "required", None)
    assert dashed is not None and dashed.grammar(_format("llama3")) is not None
    with pytest.raises(ApiError) as api_error:  # get-x(...) is not Python: refused, not left to fail as text
        dashed.grammar(_format("pythonic"))
    assert api_error.value.param == "tools[0].function.name"
    bad = parse_tool_request(
        [{"type": "function", "function": {"name": "x", "parameters": {"$ref": "#/$defs/missing"}}}], "required", None
    )
    assert bad is not None
    for name in FORMATS:
        with pytest.raises(ApiError) as info:
            bad.grammar(_format(name))
        assert (info.value.status, info.value.param) == (400, "tools[0].function.parameters"), name


# -- end to end ------------------------------------------------------------------------------------------------------

NAME = "tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny model with the Llama-3 style template: the server detects the llama3 format from it."""
    folder = tmp_path_factory.mktemp("llama3-tools") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # it would win over tokenizer_config.json
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATES["llama3"]
    config_path.write_text(json.dumps(config))
    return str(folder)


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _streamed_calls(client: openai.OpenAI, **kw: Any) -> tuple[list[tuple[str, str]], str | None, str]:
    """(calls as (name, arguments), the last finish_reason, the content) of a streamed request."""
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": None, "arguments": ""})
                assert d.id is None or entry["id"] == d.id
                if d.function is not None:
                    entry["name"] = entry["name"] or d.function.name
                    entry["arguments"] += d.function.arguments or ""
    assert all(e["id"] and e["id"].startswith("call_") for e in calls.values())
    return [(e["name"], e["arguments"]) for _, e in sorted(calls.items())], finish, content


@pytest.mark.parametrize("how", ["llama3 detected", "pythonic flag"])
def test_a_format_forced_by_the_grammar_end_to_end(request, how: str) -> None:
    """Llama 3 detected from its template; pythonic by the flag, over a template that does not render tools (the
    flag wins over detection; the grammar alone makes the random tiny model call)."""
    if how == "llama3 detected":
        model = request.getfixturevalue("llama3_model")
        srv = shared_server(request, "tools-llama3", model, "--served-model-name", NAME)
        assert "tool calls: llama3 format (detected from the chat template)" in srv.log_tail()
    else:
        model = request.getfixturevalue("tiny_model_dir")
        srv = shared_server(
            request, "tools-pythonic", model, "--served-model-name", NAME, "--tool-call-parser", "pythonic"
        )
        assert "tool calls: pythonic format (--tool-call-parser)" in srv.log_tail()
    client = _client(srv)
    tools = [TOOLS[0], TOOLS[2]]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw: dict[str, Any] = dict(
            model=NAME, messages=ASK, tools=tools, tool_choice=choice, temperature=0, max_tokens=60
        )
        r = client.chat.completions.create(**kw, parallel_tool_calls=False)
        choice_out = r.choices[0]
        assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None, r
        [call] = choice_out.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        streamed, finish, content = _streamed_calls(client, **kw, parallel_tool_calls=False)
        assert (streamed, finish, content) == ([(call.function.name, call.function.arguments)], "tool_calls", "")


def test_default_model_required_call_is_one_call(request) -> None:
    """The bug: the default model, told a call is required, wrote `{"tool_calls": [CALL, CALL, ...]}` with the same
    call repeated (parallel calls allowed by default). Without parallel_tool_calls it now gets one call."""
    srv = shared_server(request, "tools-default", "smollm2-135m", "--max-total-tokens", "16384")
    assert "tool calls: generic format" in srv.log_tail()
    client = _client(srv)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw: dict[str, Any] = dict(
            model="smollm2-135m", messages=ASK, tools=[weather], tool_choice=choice, temperature=0, max_tokens=100
        )
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls", r
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert len(calls) == 1 and calls[0][0] == "get_weather"
        jsonschema.validate(json.loads(calls[0][1]), WEATHER_PARAMS)
        assert _streamed_calls(client, **kw) == (calls, "tool_calls", "")
    # asked for parallel calls, the array envelope stays (and what the model writes in it is parsed as written)
    r = client.chat.completions.create(**{**kw, "parallel_tool_calls": True})
    assert r.choices[0].finish_reason in ("tool_calls", "length") and r.usage.completion_tokens > 0
