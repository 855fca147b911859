"""Constrained JSON that always ends (engine/constrained/json_bounds.py): the default caps on what
a schema leaves open (string length, digits, items, whitespace, nesting), applied to each step's
mask at run time.

Unit tests drive the grammar backend with the default model's real tokenizer: once a cap is
reached the mask allows only tokens that keep it, bounds the schema states are never cut, and
random-logit walks (which never choose to stop on their own) end in valid JSON. The server tests
reproduce the user report with the real default model and the `openai` client: a schema with an
unbounded integer and string, and json_object mode, sampled hot, used to run to max_tokens with
truncated JSON; they now stop with JSON valid against the original schema.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import torch

from engine.constrained import GrammarBackend, GrammarState, JsonBounds, allocate_bitmask, apply_bitmask, fill_bitmasks
from engine.errors import InvalidServerArgsError
from engine.model_config import ModelConfig
from engine.server_args import ServerArgs
from server.cli import parse_args
from server.structured import INCOMPLETE_JSON_WARNING, incomplete_json_warning
from tests.server_helpers import shared_server

MODEL = "smollm2-135m"
NAME = "smollm2"
REPORTED = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
    "required": ["n", "s"],
}
SMALL = JsonBounds(max_string_length=20, max_number_digits=4, max_items=3, max_whitespace=2, max_depth=3)


@pytest.fixture(scope="module")
def model_config(default_source) -> ModelConfig:
    return ModelConfig.from_hf(default_source.hf_config, default_source.architecture, default_source.generation_eos)


@pytest.fixture(scope="module")
def make_backend(default_tokenizer, model_config):
    made = []

    def make(bounds: JsonBounds | None) -> GrammarBackend:
        backend = GrammarBackend(
            default_tokenizer, model_config.vocab_size, model_config.eos_token_ids, max_threads=2, json_bounds=bounds
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close(wait=True)


@pytest.fixture(scope="module")
def small(make_backend) -> GrammarBackend:
    return make_backend(SMALL)


def feed(state: GrammarState, tokenizer, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert state.accept_token(token), (text, token)


def allowed_texts(backend: GrammarBackend, state: GrammarState) -> list[bytes]:
    bitmask = allocate_bitmask(1, backend.vocab_size)
    state.fill_bitmask(bitmask, 0)
    bits = [(int(bitmask[0, t >> 5]) >> (t & 31)) & 1 for t in range(backend.vocab_size)]
    vocab = backend.tokenizer_info.decoded_vocab
    return [vocab[t] for t, bit in enumerate(bits) if bit and t < len(vocab)]


def walk(backend: GrammarBackend, kind: str, spec: str, seed: int, avoid: bytes = b"", max_steps: int = 800):
    """Argmax of random logits under the mask until the grammar ends. Tokens containing any byte
    of `avoid` are pushed down (a model that never wants to close a string, say), so only the
    caps can end what the grammar leaves open."""
    state = GrammarState(backend.compile(kind, spec))
    vocab = backend.tokenizer_info.decoded_vocab
    penalty = torch.zeros(backend.vocab_size)
    for t, text in enumerate(vocab):
        if any(b in text for b in avoid):
            penalty[t] = -50.0
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, backend.vocab_size)
    ids: list[int] = []
    while not state.is_terminated() and len(ids) < max_steps:
        logits = torch.randn(1, backend.vocab_size, generator=gen) + penalty
        apply_bitmask(logits, bitmask, fill_bitmasks([state], bitmask))
        token = int(logits.argmax())
        assert state.accept_token(token)
        ids.append(token)
    assert state.is_terminated(), f"still going after {max_steps} tokens"
    return b"".join(vocab[t] for t in ids[:-1]).decode()


# ---------------------------------------------------------------------------- the caps


def test_a_full_string_may_only_close(small, default_tokenizer):
    state = GrammarState(small.compile("json_schema", json.dumps(REPORTED)))
    feed(state, default_tokenizer, '{"n": 1, "s": "abcdefghij')
    assert any(not t.startswith(b'"') for t in allowed_texts(small, state))  # 10 of 20: free
    feed(state, default_tokenizer, "klmnopqrst")
    texts = allowed_texts(small, state)
    assert texts and all(t.startswith(b'"') for t in texts), texts[:20]


def test_digits_whitespace_items_and_depth_are_capped(small, default_tokenizer):
    digits = b"0123456789"
    number = GrammarState(small.compile("json_schema", json.dumps(REPORTED)))
    feed(number, default_tokenizer, '{"n": 1234')
    texts = allowed_texts(small, number)
    assert texts and not any(t[:1] in [bytes([d]) for d in digits] for t in texts)

    spaces = GrammarState(small.compile("json_object"))
    feed(spaces, default_tokenizer, '{"a":  ')
    texts = allowed_texts(small, spaces)
    assert texts and not any(t[:1].isspace() for t in texts)

    items = GrammarState(small.compile("json_object"))
    feed(items, default_tokenizer, '{"a": [1, 2, 3')
    texts = allowed_texts(small, items)
    assert any(t.startswith(b"]") for t in texts) and not any(t.lstrip().startswith(b",") for t in texts)

    deep = GrammarState(small.compile("json_object"))
    feed(deep, default_tokenizer, '{"a": {"b": {"c": ')
    texts = allowed_texts(small, deep)
    assert texts and not any(t.lstrip()[:1] in (b"{", b"[") for t in texts)


def test_bounds_the_schema_states_are_kept(small, default_tokenizer):
    """A default cap never cuts a longer bound the schema states; the schema's own bound is exact."""
    schema = {
        "type": "object",
        "properties": {
            "long": {"type": "string", "maxLength": 60},
            "big": {"type": "integer", "minimum": 0, "maximum": 10**12},
            "list": {"type": "array", "items": {"type": "integer", "maximum": 9, "minimum": 0}, "maxItems": 8},
        },
        "required": ["long", "big", "list"],
        "additionalProperties": False,
    }
    bounds = small.compile("json_schema", json.dumps(schema)).json_bounds
    assert (bounds.max_string_length, bounds.max_number_digits, bounds.max_items) == (60, 13, 8)
    assert small.compile("json_object").json_bounds == SMALL

    for seed in range(3):
        value = json.loads(walk(small, "json_schema", json.dumps(schema), seed, avoid=b'"]'))
        jsonschema.validate(value, schema)
        # The model avoids closing: the strings and the list run to the schema's bounds, not ours.
        assert len(value["long"]) == 60 and len(value["list"]) == 8, value


@pytest.mark.parametrize("seed", range(3))
def test_open_schemas_and_json_object_end_in_valid_json(small, make_backend, seed):
    # The reported schema under the default caps, with a "model" that never closes a string.
    default = make_backend(JsonBounds())
    value = json.loads(walk(default, "json_schema", json.dumps(REPORTED), seed, avoid=b'"'))
    jsonschema.validate(value, REPORTED)
    assert len(value["s"]) >= JsonBounds().max_string_length
    assert len(value["s"]) < JsonBounds().max_string_length + 64  # one token's overshoot at most

    numbers = {"type": "array", "items": {"type": "number"}}
    listed = {"type": "object", "properties": {"xs": numbers}, "required": ["xs"]}
    value = json.loads(walk(small, "json_schema", json.dumps(listed), seed, avoid=b"]"))
    jsonschema.validate(value, listed)
    assert 1 <= len(value["xs"]) <= SMALL.max_items + 1

    value = json.loads(walk(small, "json_object", "", seed, avoid=b"}]"))
    assert isinstance(value, dict)


def test_rollback_and_rebuild_restore_the_caps(small, default_tokenizer):
    state = GrammarState(small.compile("json_schema", json.dumps(REPORTED)))
    feed(state, default_tokenizer, '{"n": 1, "s": "abcdefghij')
    free = allowed_texts(small, state)
    mark = state.num_accepted
    feed(state, default_tokenizer, "klmnopqrst")
    capped = allowed_texts(small, state)
    state.rollback(state.num_accepted - mark)
    assert allowed_texts(small, state) == free
    ids = default_tokenizer.encode('{"n": 1, "s": "abcdefghijklmnopqrst', add_special_tokens=False)
    assert state.rebuild(ids) and allowed_texts(small, state) == capped


def test_bounds_off_is_xgrammar_alone(make_backend, default_tokenizer):
    backend = make_backend(None)
    compiled = backend.compile("json_schema", json.dumps(REPORTED))
    assert compiled.json_bounds is None
    state = GrammarState(compiled)
    feed(state, default_tokenizer, '{"n": 1, "s": "' + "abcdefghij" * 40)
    assert any(not t.startswith(b'"') for t in allowed_texts(backend, state))


def test_bounds_reject_negative_caps():
    with pytest.raises(ValueError, match="max_items"):
        JsonBounds(max_items=-1)


# ---------------------------------------------------------------------------- the report, live


@pytest.fixture(scope="module")
def server(request):
    # the clients' shared server (tests/test_clients_*.py): one default-model server for them all
    return shared_server(request, "smollm2-clients", MODEL, "--served-model-name", NAME, "--max-total-tokens", "8192")


SAMPLINGS = [(0.0, None), (0.8, 1), (1.0, 2), (1.3, 3)]
PROMPTS = [
    "Make up an example record with the fields n, s, as JSON.",
    "Give me a JSON with a big number n and a long story s.",
]


@pytest.mark.timeout(900)
async def test_the_reported_schema_and_json_object_mode_now_stop(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def ask(prompt: str, response_format: dict, temperature: float, seed: int | None):
        r = await client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": prompt}],
            response_format=response_format,
            max_tokens=600,
            temperature=temperature,
            seed=seed,
        )
        return response_format["type"], r.choices[0]

    schema_rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": REPORTED}}
    object_rf = {"type": "json_object"}
    # json_object at 1.3 is left out: the caps end every string, number and container, but a 135M
    # model sampled that hot writes member after member of noise, and a document of up to 100
    # members per object can outgrow max_tokens (a schema bounds the members; see README).
    calls = [ask(p, schema_rf, t, s) for p in PROMPTS for t, s in SAMPLINGS]
    calls += [ask(p, object_rf, t, s) for p in PROMPTS for t, s in SAMPLINGS if t <= 1.0]
    for kind, choice in await asyncio.gather(*calls):
        assert choice.finish_reason == "stop", (kind, choice.message.content)
        value = json.loads(choice.message.content)
        if kind == "json_schema":
            jsonschema.validate(value, REPORTED)
        else:
            assert isinstance(value, dict)


async def test_a_length_stop_inside_json_says_so(server):
    """The choice (and a stream's final chunk) carries `structured_output_warning` when
    max_tokens cut the JSON; the openai client keeps it in `model_extra`."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": REPORTED}}
    ask = dict(model=NAME, messages=[{"role": "user", "content": "A record as JSON."}], response_format=rf)
    cut = (await client.chat.completions.create(**ask, max_tokens=3, temperature=0)).choices[0]
    assert cut.finish_reason == "length"
    assert cut.model_extra["structured_output_warning"] == INCOMPLETE_JSON_WARNING
    finals = [
        c.choices[0]
        async for c in await client.chat.completions.create(**ask, max_tokens=3, temperature=0, stream=True)
        if c.choices and c.choices[0].finish_reason is not None
    ]
    assert [f.model_extra.get("structured_output_warning") for f in finals] == [INCOMPLETE_JSON_WARNING]
    small = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99}, "s": {"type": "string", "maxLength": 8}},
        "required": ["n", "s"],
    }
    ask["response_format"] = {"type": "json_schema", "json_schema": {"name": "small", "schema": small}}
    whole = (await client.chat.completions.create(**ask, max_tokens=200, temperature=0)).choices[0]
    assert whole.finish_reason == "stop" and "structured_output_warning" not in (whole.model_extra or {})
    text = await client.completions.create(model=NAME, prompt="{", max_tokens=2, extra_body={"response_format": rf})
    assert text.choices[0].model_extra["structured_output_warning"] == INCOMPLETE_JSON_WARNING


def test_the_string_cap_flag_reaches_the_engine_args():
    engine, _ = parse_args(["--constrained-json-max-string-length", "1000"])
    assert ServerArgs(**engine).constrained_json_max_string_length == 1000
    engine, _ = parse_args([])
    assert ServerArgs(**engine).constrained_json_max_string_length == JsonBounds().max_string_length
    with pytest.raises(InvalidServerArgsError, match="constrained_json_max_string_length"):
        ServerArgs(constrained_json_max_string_length=-1).verify()


def test_a_length_stop_inside_json_is_flagged():
    schema_rf = {"type": "json_schema", "json_schema": {"schema": REPORTED}}
    assert incomplete_json_warning(schema_rf, "length", '{"n": 12, "s": "abc') == INCOMPLETE_JSON_WARNING
    assert incomplete_json_warning({"type": "json_object"}, "length", "{") == INCOMPLETE_JSON_WARNING
    assert incomplete_json_warning(schema_rf, "length", '{"n": 1, "s": ""}') is None  # complete: ended on time
    assert incomplete_json_warning(schema_rf, "stop", '{"n": 1') is None
    assert incomplete_json_warning({"type": "text"}, "length", "{") is None
    assert incomplete_json_warning(None, "length", "{") is None


def test_strings_never_hold_raw_control_characters(small, default_tokenizer):
    """xgrammar's bounded strings (maxLength) allow a raw tab or \\x01, which no JSON parser takes."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}, "required": ["s"]}
    state = GrammarState(small.compile("json_schema", json.dumps(schema)))
    feed(state, default_tokenizer, '{"s": "ab')
    texts = allowed_texts(small, state)
    assert texts and not any(b < 0x20 for t in texts for b in t.split(b'"')[0]), [t for t in texts if b"\t" in t][:5]


def test_the_threaded_batch_fill_applies_the_caps_too(small, default_tokenizer):
    full = GrammarState(small.compile("json_schema", json.dumps(REPORTED)))
    feed(full, default_tokenizer, '{"n": 1, "s": "abcdefghijklmnopqrst')
    fresh = GrammarState(small.compile("json_object"))
    serial, threaded = allocate_bitmask(3, small.vocab_size), allocate_bitmask(3, small.vocab_size)
    states = [full, None, fresh]
    fill_bitmasks(states, serial)
    assert fill_bitmasks(states, threaded, threads=2) == [0, 2]
    assert torch.equal(serial[0], threaded[0]) and torch.equal(serial[2], threaded[2])
