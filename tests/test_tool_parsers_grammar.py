"""The grammars of the tool-call formats beyond the generic envelope (server/tool_parsers/): xgrammar compiles each
format's grammar and it accepts exactly the calls the format's parser reads. (The formats' detection, templates and
parsers: test_tool_parsers.py; the tools and calls: tests/tool_format_helpers.py.)"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from server.errors import ApiError
from server.tool_parsers import parse_tool_request
from tests.tool_format_helpers import CALLS, FORMATS, SCHEMAS, format_of, got, make_plan, write_calls

pytestmark = pytest.mark.timeout(600)


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
    fmt = format_of(name)
    assert make_plan("auto").grammar(fmt) is None  # auto leaves prose possible
    for choice in ("required", {"type": "function", "function": {"name": "note"}}):
        plan = make_plan(choice, parallel)
        kind, spec = plan.grammar(fmt)  # type: ignore[misc]
        assert kind == "ebnf"
        compiled = compiler.compile_grammar(spec)
        allowed = [c for c in CALLS if plan.forced in (None, c[0])]
        for call in CALLS:
            text = write_calls(name, [call])
            assert _accepts(compiled, text) == (call in allowed), text
            if call in allowed:
                assert got(plan, fmt, text) == (None, [call])
                jsonschema.validate(call[1], SCHEMAS[call[0]])
        assert _accepts(compiled, write_calls(name, allowed)) == (parallel or len(allowed) == 1)
        if parallel:
            assert got(plan, fmt, write_calls(name, allowed)) == (None, allowed)
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
        _, spec = plan.grammar(format_of(name))  # type: ignore[misc]
        compiled = xgr.Grammar.from_ebnf(spec)
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(compiled))
        text = write_calls(name, [("tree", {"root": {"v": 1, "kids": [{"v": 2}]}})])
        assert matcher.accept_string(text) and matcher.is_completed(), (name, text)
    dashed = parse_tool_request([{"type": "function", "function": {"name": "get-x"}}], "required", None)
    assert dashed is not None and dashed.grammar(format_of("llama3")) is not None
    with pytest.raises(ApiError) as api_error:  # get-x(...) is not Python: refused, not left to fail as text
        dashed.grammar(format_of("pythonic"))
    assert api_error.value.param == "tools[0].function.name"
    bad = parse_tool_request(
        [{"type": "function", "function": {"name": "x", "parameters": {"$ref": "#/$defs/missing"}}}], "required", None
    )
    assert bad is not None
    for name in FORMATS:
        with pytest.raises(ApiError) as info:
            bad.grammar(format_of(name))
        assert (info.value.status, info.value.param) == (400, "tools[0].function.parameters"), name
