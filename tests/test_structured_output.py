"""Structured output inside the engine: grammars wired through the Receiver (grammar queue), the
scheduler (masks, accept, finish) and the sampler, on the real actors and the SyncScheduler.

Validity against schemas with the real model is in tests/test_server_structured.py (through the
OpenAI client); here the tiny random Llama (real tokenizer) checks the mechanics: a random model
under a grammar still only produces what the grammar allows, which is a sharper test of the mask
than a model that would write valid JSON anyway.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engine import Engine, GrammarCompileTimeoutError, InvalidRequestError, SamplingParams, SyncScheduler
from tests.sched_harness import build_tiny_folder, make_runner, random_prompts
from tests.test_engine import assert_idle_and_clean, tiny_engine

TIMEOUT = 180
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{2,4}!"


def nested_schema(depth: int) -> dict:
    """A schema whose compile time grows steeply with depth (~1.5 s at 11 on a 2-core box)."""
    s: dict = {"type": "string"}
    for i in range(depth):
        s = {
            "type": "object",
            "properties": {f"k{i}": s, f"j{i}": {"type": "array", "items": s, "maxItems": 3}},
            "required": [f"k{i}"],
        }
    return s


@pytest.fixture(scope="module")
def folder(tmp_path_factory, default_tokenizer):
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-structured"), default_tokenizer)


def _prompts(n: int) -> list[list[int]]:
    return [[100 + 37 * i + k for k in range(5 + i % 13)] for i in range(n)]


def _regex_params(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=40, temperature=0.0, regex=REGEX, **kw)


def test_params_take_one_grammar_and_check_types():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(regex="a", ebnf='root ::= "a"').verify()
    assert e.value.param == "ebnf"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(json_schema=3).verify()  # type: ignore[arg-type]
    assert e.value.param == "json_schema"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(regex="  ").verify()
    assert e.value.param == "regex"
    assert SamplingParams(json_schema={"type": "object"}).grammar_spec() == ("json_schema", '{"type": "object"}')
    assert SamplingParams().grammar_spec() is None


async def test_grammar_requests_follow_their_grammar_and_leave_neighbours_alone(folder):
    """A mixed batch: constrained rows match their grammar; unconstrained rows get exactly the
    greedy tokens they get alone (their logits are never touched), overlap on and off."""
    prompts = _prompts(12)
    plain = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for overlap in (False, True):
        async with tiny_engine(folder, enable_overlap=overlap, chunked_prefill_size=16) as engine:
            async with asyncio.timeout(TIMEOUT):
                alone = [(await engine.generate(p, plain)).token_ids for p in prompts[:3]]
                kinds = [
                    _regex_params(),
                    SamplingParams(max_new_tokens=200, temperature=0.0, json_schema=SCHEMA),
                    SamplingParams(max_new_tokens=200, temperature=0.7, seed=5, json_schema=json.dumps(SCHEMA)),
                    SamplingParams(max_new_tokens=30, temperature=0.0, ebnf='root ::= "x" [a-c]+ "."'),
                ]
                params = [plain] * 3 + [kinds[i % 4] for i in range(9)]
                res = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))
            for i in range(3):
                assert res[i].token_ids == alone[i]
            for r, sp in zip(res[3:], params[3:]):
                if sp.regex is not None:
                    assert r.finish_reason == "stop" and re.fullmatch(REGEX, r.text), r.text
                elif sp.ebnf is not None:
                    assert re.fullmatch(r"x[a-c]+\.", r.text) or (r.finish_reason == "length"), r.text
                elif r.finish_reason == "stop":
                    jsonschema.validate(json.loads(r.text), SCHEMA)
                else:  # cut by max_new_tokens: still a prefix the grammar allows
                    assert r.finish_reason == "length" and r.text.lstrip().startswith("{"), r.text
            outs[overlap] = [r.token_ids for r in res]
            st = await assert_idle_and_clean(engine)
            # SCHEMA as a dict and as its JSON text share one cache entry: three grammars
            assert st["grammar_cache"]["misses"] == 3 and st["grammar_steps"] > 0
    assert outs[False] == outs[True]  # the constrained requests force the synchronous step


async def test_grammar_ends_the_request_despite_ignore_eos_and_min_tokens(folder):
    async with tiny_engine(folder) as engine:
        async with asyncio.timeout(TIMEOUT):
            r = await engine.generate(_prompts(1)[0], _regex_params(ignore_eos=True, min_new_tokens=30))
        assert r.finish_reason == "stop" and re.fullmatch(REGEX, r.text), (r.text, r.finish_reason)
        assert r.matched_stop == engine.model_info.eos_token_ids[0]


async def test_bad_specs_are_typed_errors_naming_the_field(folder):
    async with tiny_engine(folder) as engine:
        cases = [
            (SamplingParams(json_schema="{not json"), "json_schema"),
            (SamplingParams(json_schema={"type": "strin"}), "json_schema"),
            (SamplingParams(regex="(unclosed"), "regex"),
            (SamplingParams(ebnf="root ::= missing_rule"), "ebnf"),
        ]
        for params, field in cases:
            with pytest.raises(InvalidRequestError) as e:
                await engine.generate("hi", params)
            assert e.value.param == field, e.value
        # The sync open_stream path puts the request in the grammar queue: the error ends the stream.
        stream = engine.open_stream("hi", SamplingParams(regex="(unclosed"))
        deltas = [d async for d in stream]
        assert deltas[-1].finish_reason == "abort" and "regex" in (deltas[-1].error or "").lower()
        await assert_idle_and_clean(engine)


async def test_compile_runs_off_the_loop_and_is_cached(folder):
    """While a slow grammar compiles, another request keeps streaming; the second use of the
    same schema is a cache hit; a compile past the timeout is a typed error, nothing leaked."""
    slow = nested_schema(11)
    async with tiny_engine(folder) as engine:
        backend_info = lambda st: st["grammar_cache"]
        plain = SamplingParams(max_new_tokens=1500, temperature=0.0, ignore_eos=True)
        during_compile = 0
        async with asyncio.timeout(TIMEOUT):
            stream = await engine.submit(_prompts(1)[0], plain)
            await anext(stream)
            task = asyncio.ensure_future(
                engine.generate("x", SamplingParams(max_new_tokens=8, temperature=0.0, json_schema=slow))
            )
            await asyncio.sleep(0)
            async for delta in stream:
                st = await engine.get_internal_state()
                if backend_info(st)["in_flight"] == 0:
                    break
                during_compile += len(delta.token_ids)
            await stream.aclose()
            await task
            assert during_compile >= 3, during_compile
            before = backend_info(await engine.get_internal_state())
            await engine.generate("y", SamplingParams(max_new_tokens=8, temperature=0.0, json_schema=slow))
            after = backend_info(await engine.get_internal_state())
        assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"]
        await assert_idle_and_clean(engine)

    async with tiny_engine(folder, grammar_compile_timeout=0.01) as engine:
        with pytest.raises(GrammarCompileTimeoutError) as e:
            await engine.generate("x", SamplingParams(json_schema=nested_schema(10)))
        assert e.value.param == "json_schema"
        await assert_idle_and_clean(engine)


async def test_aborted_constrained_requests_free_everything(folder):
    async with tiny_engine(folder) as engine:
        params = SamplingParams(max_new_tokens=300, temperature=0.8, seed=1, json_schema={"type": "array"})
        async with asyncio.timeout(TIMEOUT):
            streams = [await engine.submit(p, params) for p in _prompts(6)]
            for s in streams:
                await anext(s)
            for s in streams[::2]:
                await engine.abort(s.rid)
            for s in streams:
                await s.aclose()
            # Aborted while still in the grammar queue (sync path, a spec not compiled yet).
            queued = engine.open_stream("q", SamplingParams(json_schema=nested_schema(9)))
            await engine.abort(queued.rid)
            last = [d async for d in queued][-1]
            assert last.finish_reason == "abort"
        await assert_idle_and_clean(engine)


async def test_structured_output_can_be_switched_off(folder):
    async with tiny_engine(folder, grammar_backend="none") as engine:
        with pytest.raises(InvalidRequestError) as e:
            await engine.generate("x", SamplingParams(regex="a+"))
        assert e.value.param == "regex"
        with pytest.raises(InvalidRequestError):
            engine.open_stream("x", SamplingParams(regex="a+"))


@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_and_chunked_prefill_keep_grammars_consistent(folder, page_size):
    """A pool too small for the batch (tests/test_retraction.py's MIXED shape): requests are
    retracted and re-prefilled (in chunks) mid-grammar; each still matches its grammar, its
    matcher has accepted exactly its output, and greedy outputs equal those run alone."""
    runner, args = make_runner(folder, max_total_tokens=720, chunked_prefill_size=64, page_size=page_size)
    prompts = random_prompts(16, 10, 40, seed=3)
    pattern = r"[0-9]{50}"  # one token per digit: 50 tokens, then EOS
    params = SamplingParams(max_new_tokens=60, temperature=0.0, regex=pattern)
    sched = SyncScheduler(runner, args)
    reqs = [sched.add_request(p, params) for p in prompts]
    sched.run_until_idle(overlap=True, max_steps=3000)
    assert sched.scheduler.num_retractions > 0
    tok = runner.source.load_tokenizer()
    for req in reqs:
        assert req.finished_reason.reason.value == "stop", req.finished_reason
        assert re.fullmatch(pattern, tok.decode(req.output_ids, skip_special_tokens=True))
        assert req.grammar.num_accepted == len(req.output_ids)
    sched.scheduler.check_memory()
    assert sched.scheduler.flush_cache()  # the runner's pool is shared: run alone from an empty cache
    for i in [i for i, r in enumerate(reqs) if r.epoch > 0][:2]:
        (alone,) = sched.generate([prompts[i]], params)
        assert alone.output_ids == reqs[i].output_ids


def test_engine_default_backend_builds_once(folder):
    engine = Engine(folder, dtype="float32", device="cpu")
    assert engine.args.grammar_backend == "xgrammar" and engine.args.grammar_compile_timeout == 30.0
