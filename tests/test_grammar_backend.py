"""The grammar backend (engine/constrained/) with the default model's real tokenizer: compiling
each kind, the cache, typed errors, compiles off the event loop with a timeout, and masked
greedy walks from random logits whose output must match the grammar (JSON validated by
`jsonschema`, regexes by `re.fullmatch`)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine.constrained import GrammarBackend, GrammarState, allocate_bitmask, apply_bitmask, fill_bitmasks
from engine.errors import EngineError, GrammarCompileTimeoutError, GrammarQueueFullError, InvalidRequestError
from engine.model_config import ModelConfig

MAX_STEPS = 300


@pytest.fixture(scope="module")
def model_config(default_source) -> ModelConfig:
    return ModelConfig.from_hf(default_source.hf_config, default_source.architecture, default_source.generation_eos)


@pytest.fixture(scope="module")
def make_backend(default_tokenizer, model_config):
    """Fresh backends (own cache and counters); building one takes ~0.2 s. Whitespace is
    bounded so random-logit walks cannot wander through whitespace forever."""
    made = []

    def make(**kwargs) -> GrammarBackend:
        kwargs.setdefault("max_threads", 2)
        kwargs.setdefault("max_whitespace_cnt", 2)
        backend = GrammarBackend(default_tokenizer, model_config.vocab_size, model_config.eos_token_ids, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close(wait=True)


@pytest.fixture(scope="module")
def backend(make_backend) -> GrammarBackend:
    return make_backend()


def greedy_walk(state: GrammarState, vocab: int, seed: int, max_steps: int = MAX_STEPS) -> list[int]:
    """Fill the mask, apply it to random logits, take the argmax, accept it; until terminated."""
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab)
    ids: list[int] = []
    while not state.is_terminated() and len(ids) < max_steps:
        logits = torch.randn(1, vocab, generator=gen)
        apply_bitmask(logits, bitmask, fill_bitmasks([state], bitmask))
        token = int(logits.argmax())
        assert state.accept_token(token), f"a masked argmax token {token} was rejected after {ids}"
        ids.append(token)
    return ids


def walk_text(backend: GrammarBackend, tokenizer, kind: str, spec: str, seed: int) -> str:
    state = GrammarState(backend.compile(kind, spec))
    ids = greedy_walk(state, backend.vocab_size, seed)
    assert state.is_terminated(), f"not terminated after {MAX_STEPS} steps: {tokenizer.decode(ids)!r}"
    assert ids[-1] in backend.stop_token_ids and state.num_accepted == len(ids)
    return tokenizer.decode(ids[:-1])


def big_schema(tag: str, fields: int = 8) -> str:
    """A schema that takes a few hundred ms to compile (string patterns dominate)."""
    inner = {f"{tag}{j}": {"type": "string", "pattern": f"[a-z]{{2,{j + 3}}}"} for j in range(fields)}
    props = {f"{tag}_{i}": {"type": "object", "properties": inner, "required": list(inner)} for i in range(fields)}
    return json.dumps({"type": "object", "properties": props})


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(bitmask[row, t >> 5]) >> (t & 31)) & 1]


# ---------------------------------------------------------------------------- compiling


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'),
        ("json_object", ""),
        ("regex", r"[a-z]+@[a-z]+\.com"),
        ("ebnf", 'root ::= "yes" | "no"'),
    ],
)
def test_compiles_each_kind(backend, model_config, kind, spec):
    compiled = backend.compile(kind, spec)
    assert compiled.kind == kind and compiled.memory_bytes > 0
    assert compiled.vocab_size == model_config.vocab_size == 49152
    # the grammar's stop tokens are the model's EOS ids (SmolLM2: <|im_end|> = 2)
    assert set(compiled.stop_token_ids) == set(model_config.eos_token_ids) == {2}


def test_cache_hits_are_counted(make_backend):
    backend = make_backend(cache_max_entries=2)
    first = backend.compile("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}}')
    again = backend.compile("json_schema", '{ "type":"object",\n "properties": {"a": {"type": "string"}} }')
    assert again is first  # canonical JSON: formatting does not matter
    info = backend.cache_info()
    assert (info.hits, info.misses, info.entries) == (1, 1, 1)
    assert backend.compile("json_object") is backend.compile("json_object", "ignored")
    backend.compile("regex", "a+")  # a third entry evicts the least recently used (the schema)
    info = backend.cache_info()
    assert (info.hits, info.misses, info.entries) == (2, 3, 2)
    assert backend.compile("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}}') is not first
    assert backend.cache_info().misses == 4


@pytest.mark.parametrize(
    ("kind", "spec", "fragment"),
    [
        ("json_schema", '{"type": "objec"}', 'Unsupported type "objec"'),
        ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 3}', "minimum greater than maximum"),
        ("json_schema", '{"type": "object"', "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", '{"items": ' * 200 + "{}" + "}" * 200, "levels deep"),
        ("regex", "(ab", "parenthesis is not closed"),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
        ("ebnf", 'root ::= "a', "string literal"),
    ],
)
async def test_bad_specs_raise_invalid_request_naming_the_field(backend, kind, spec, fragment):
    for attempt in ("sync", "async"):
        with pytest.raises(InvalidRequestError) as info:
            if attempt == "sync":
                backend.compile(kind, spec)
            else:
                await backend.compile_async(kind, spec, timeout=30)
        assert info.value.param == kind and fragment in str(info.value)
        assert "/project/cpp" not in str(info.value)  # xgrammar's source location is stripped


# ---------------------------------------------------------------------------- off the event loop


async def test_compile_async_runs_off_the_event_loop(make_backend):
    backend = make_backend()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.002)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    before, start = ticks, time.perf_counter()
    compiled = await backend.compile_async("json_schema", big_schema("tick"), timeout=60)
    elapsed, during = time.perf_counter() - start, ticks - before
    task.cancel()
    assert compiled.memory_bytes > 0 and backend.cache_info().misses == 1
    # a compile blocking the loop would leave the ticker at most one tick (here: ~0.3 s, ~100 ticks)
    assert during >= 5, (elapsed, during)


async def test_compile_timeout_raises_and_the_result_still_lands_in_the_cache(make_backend):
    backend = make_backend()
    spec = big_schema("slow")
    with pytest.raises(GrammarCompileTimeoutError) as info:
        await backend.compile_async("json_schema", spec, timeout=0.005)
    assert isinstance(info.value, InvalidRequestError) and info.value.param == "json_schema"
    assert backend.cache_info().timeouts == 1
    deadline = time.monotonic() + 60
    while backend.cache_info().in_flight and time.monotonic() < deadline:  # the compile goes on
        await asyncio.sleep(0.01)
    assert backend.cache_info().entries == 1
    await backend.compile_async("json_schema", spec, timeout=0.005)  # now a cache hit
    info = backend.cache_info()
    assert (info.hits, info.misses) == (1, 1)


async def test_concurrent_compiles_of_one_spec_share_one_compile(make_backend):
    backend = make_backend()
    spec = big_schema("shared", fields=4)
    results = await asyncio.gather(*(backend.compile_async("json_schema", spec, timeout=60) for _ in range(3)))
    assert results[0] is results[1] is results[2]
    info = backend.cache_info()
    assert (info.misses, info.shared, info.in_flight) == (1, 2, 0)


async def test_too_many_distinct_compiles_are_refused_but_shared_and_cached_ones_are_not(make_backend):
    backend = make_backend(max_pending=1)
    cached = big_schema("cached", fields=2)
    await backend.compile_async("json_schema", cached, timeout=60)
    slow = big_schema("slow", fields=12)
    first = asyncio.ensure_future(backend.compile_async("json_schema", slow, timeout=60))
    await asyncio.sleep(0)
    assert backend.cache_info().in_flight == 1
    with pytest.raises(GrammarQueueFullError) as e:
        await backend.compile_async("regex", "[a-z]{1,300}", timeout=60)
    assert e.value.param == "regex"
    joined = asyncio.ensure_future(backend.compile_async("json_schema", slow, timeout=60))  # shares the compile
    assert (await backend.compile_async("json_schema", cached)).spec  # a hit needs no thread
    assert await first is await joined
    await backend.compile_async("regex", "[a-z]{1,300}", timeout=60)  # room again


async def test_close_stops_async_compiles_but_not_sync_ones(make_backend):
    backend = make_backend()
    backend.close(wait=True)
    with pytest.raises(EngineError):
        await backend.compile_async("regex", "x+", timeout=5)
    assert backend.compile("regex", "x+").kind == "regex"


# ---------------------------------------------------------------------------- masked greedy walks

SCHEMAS = {
    "nested_optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 10},
                    "email": {"type": "string", "pattern": "[a-z]{1,6}@[a-z]{1,6}\\.com"},
                    "admin": {"type": "boolean"},
                },
                "required": ["name"],
            },
        },
        "required": ["id", "user"],
    },
    "arrays_enums": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4},
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": -5, "maximum": 5},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["colors", "matrix"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 10, "maximum": 20},
                    {"type": "string", "pattern": "v[0-9]{2}"},
                    {"type": "null"},
                ]
            },
            "flag": {"type": "boolean"},
            "kind": {"const": "point"},
        },
        "required": ["value", "flag", "kind"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "[A-Z]{3}"},
                "qty": {"type": "integer", "minimum": 0, "maximum": 100},
                "note": {"type": "string", "maxLength": 5},
            },
            "required": ["code", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_masked_greedy_walk_yields_valid_json(backend, default_tokenizer, name, seed):
    schema = SCHEMAS[name]
    text = walk_text(backend, default_tokenizer, "json_schema", json.dumps(schema), seed)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_greedy_walk_matches_a_regex(backend, default_tokenizer, seed):
    regex = r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d [a-z]{3,8}( #[0-9a-f]{6})?"
    text = walk_text(backend, default_tokenizer, "regex", regex, seed)
    assert re.fullmatch(regex, text), text


EBNF = r"""
root ::= greeting ", " name "! " answer
greeting ::= "hello" | "hi" | "good " ("morning" | "evening")
name ::= [A-Z] [a-z] [a-z]? [a-z]?
answer ::= "[" num ("," num)? ("," num)? "]"
num ::= "0" | [1-9] [0-9]?
"""
EBNF_AS_REGEX = r"(hello|hi|good (morning|evening)), [A-Z][a-z]{1,3}! \[(0|[1-9][0-9]?)(,(0|[1-9][0-9]?)){0,2}\]"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_greedy_walk_matches_an_ebnf_grammar(backend, default_tokenizer, seed):
    text = walk_text(backend, default_tokenizer, "ebnf", EBNF, seed)
    assert re.fullmatch(EBNF_AS_REGEX, text), text


def test_json_object_accepts_an_object_and_rejects_other_values(backend, default_tokenizer):
    compiled = backend.compile("json_object")
    state = GrammarState(compiled)
    ids = default_tokenizer.encode('{"a": [1, {"b": null}], "c": "x"}', add_special_tokens=False)
    assert all(state.accept_token(t) for t in ids) and state.is_completed()
    assert state.accept_token(2) and state.is_terminated()
    other = GrammarState(compiled)
    assert not other.accept_token(default_tokenizer.encode("[", add_special_tokens=False)[0])
    assert other.num_accepted == 0


# ---------------------------------------------------------------------------- state


def test_stop_tokens_end_a_completed_grammar(backend, default_tokenizer):
    vocab = backend.vocab_size
    compiled = backend.compile("regex", "ab")
    bitmask = allocate_bitmask(1, vocab)
    for extra, stops in (((), [2]), ((7, 2, vocab + 5), [2, 7])):
        state = GrammarState(compiled, extra_stop_token_ids=extra)
        state.fill_bitmask(bitmask, 0)
        assert not set(allowed(bitmask, 0, vocab)) & set(stops)  # no stopping before the match
        assert all(state.accept_token(t) for t in default_tokenizer.encode("ab", add_special_tokens=False))
        state.fill_bitmask(bitmask, 0)
        assert allowed(bitmask, 0, vocab) == stops and state.is_completed() and not state.is_terminated()
        assert state.accept_token(stops[-1]) and state.is_terminated()
        assert not state.accept_token(5) and not state.accept_token(-1)
        state.fill_bitmask(bitmask, 0)  # a stale step after termination: stop tokens only, no error
        assert allowed(bitmask, 0, vocab) == stops


def test_rebuild_and_rollback_restore_the_same_mask(backend):
    vocab = backend.vocab_size
    compiled = backend.compile("json_schema", json.dumps(SCHEMAS["nested_optional"]))
    ids = greedy_walk(GrammarState(compiled), vocab, seed=3)
    bitmask = allocate_bitmask(3, vocab)
    for k in (0, 1, 5, len(ids) // 2, len(ids) - 1):
        original = GrammarState(compiled)
        assert all(original.accept_token(t) for t in ids[:k])
        original.fill_bitmask(bitmask, 0)
        rebuilt = GrammarState(compiled)
        assert all(rebuilt.accept_token(t) for t in ids[: k + 1])  # some other history first
        assert rebuilt.rebuild(ids[:k]) and rebuilt.num_accepted == k
        rebuilt.fill_bitmask(bitmask, 1)
        assert torch.equal(bitmask[0], bitmask[1]), k
        ahead = GrammarState(compiled)
        assert ahead.rebuild(ids[: k + 1])
        ahead.rollback(1)
        ahead.fill_bitmask(bitmask, 2)
        assert torch.equal(bitmask[0], bitmask[2]) and ahead.num_accepted == k
    state = GrammarState(compiled)
    assert not state.rebuild([*ids[:3], ids[0]]) and state.num_accepted == 3  # `{` is not allowed there
    with pytest.raises(ValueError):
        state.rollback(4)


# ---------------------------------------------------------------------------- batch masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_masks_only_the_constrained_rows(backend, dtype):
    vocab = backend.vocab_size
    schema = backend.compile("json_schema", json.dumps(SCHEMAS["array_of_objects"]))
    ids = greedy_walk(GrammarState(schema), vocab, seed=4)
    states: list[GrammarState | None] = []
    for k in (0, None, 3, None, len(ids) - 1, 6):
        if k is None:
            states.append(None)
            continue
        state = GrammarState(schema)
        assert state.rebuild(ids[:k])
        states.append(state)
    bitmask = allocate_bitmask(len(states), vocab)
    bitmask[1].zero_()  # garbage in an unconstrained row must not matter
    rows = fill_bitmasks(states, bitmask)
    assert rows == [0, 2, 4, 5]
    threaded = allocate_bitmask(len(states), vocab)
    assert fill_bitmasks(states, threaded, threads=2) == rows
    assert torch.equal(bitmask[rows], threaded[rows])

    logits = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(5)).to(dtype)
    before = logits.clone()
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits[[1, 3]], before[[1, 3]])
    reference = before.clone()  # xgrammar's own CPU kernel agrees bit for bit
    xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocab, indices=rows)
    assert torch.equal(logits, reference)
    for row in rows:
        allowed_ids = allowed(bitmask, row, vocab)
        assert torch.isfinite(logits[row, allowed_ids]).all()
        assert int(torch.isfinite(logits[row]).sum()) == len(allowed_ids)
    full = before.clone()
    apply_bitmask(full, bitmask, range(len(states)))  # every row: the plain path
    reference = before.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocab)
    assert torch.equal(full, reference)


def test_apply_refuses_a_bitmask_narrower_than_the_logits(backend):
    with pytest.raises(ValueError, match="covers"):
        apply_bitmask(torch.zeros(1, 49152 + 64), allocate_bitmask(1, 49152), [0])


@pytest.mark.gpu
def test_cuda_apply_matches_the_cpu(backend, default_tokenizer):
    vocab = backend.vocab_size
    compiled = backend.compile("json_schema", json.dumps(SCHEMAS["any_of"]))
    states = [GrammarState(compiled), None, GrammarState(compiled)]
    assert states[2].accept_token(default_tokenizer.encode("{", add_special_tokens=False)[0])
    bitmask = allocate_bitmask(3, vocab, pin_memory=True)
    rows = fill_bitmasks(states, bitmask)
    logits = torch.randn(3, vocab)
    on_gpu = logits.cuda()
    apply_bitmask(logits, bitmask, rows)
    apply_bitmask(on_gpu, bitmask, rows)
    assert torch.equal(on_gpu.cpu(), logits)
