"""What tests/test_fuzz.py sends and what it accepts back.

Inputs (hypothesis strategies) that schemathesis does not produce, because it only ever sends
well-formed JSON with the documented content type: raw HTTP bodies (invalid UTF-8 inside a string,
deep nesting, truncation, NaN, arbitrary bytes, a wrong Content-Type, a Content-Encoding that the
body does not match) and WebSocket frames (arbitrary bytes and text, JSON values, generate/cancel
messages a client would send with one field mutated, deep nesting). Messages that are valid ask
for short generations, so a run stays bounded.

Answers: `response_problem` and `ws_message_problem` say what is wrong with one answer (None when
nothing is): never a 5xx, every error OpenAI's body, streams of JSON events ending in [DONE].
"""

from __future__ import annotations

import gzip
import json
from typing import Any

from hypothesis import strategies as st

PROBE = "probe"  # the WebSocket probe's ids start with it; fuzzed ids never do
VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer)

# ---- answers ------------------------------------------------------------------------------------------


def error_problem(body: Any) -> str | None:
    """None when `body` is OpenAI's error body for a client error; a 5xx one is itself a problem."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return f"not an error body: {str(body)[:200]}"
    err = body["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}, want message, type, param, code"
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        return f"error message/type not non-empty strings: {err}"
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"error param not a string: {err}"
    if not isinstance(err["code"], str | int | None) or isinstance(err["code"], bool):
        return f"error code not a string or int: {err}"
    if err["type"] == "server_error" or (isinstance(err["code"], int) and err["code"] >= 500):
        return f"a server error: {err}"
    return None


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def sse_problem(content: bytes, complete: bool = True) -> str | None:
    """`data: <json>` events ending in [DONE] (unless the reader stopped early); error events
    carry the error body."""
    events = [e for e in content.decode(errors="replace").split("\n\n") if e]
    if complete and (not events or events[-1] != "data: [DONE]"):
        return f"stream does not end in [DONE]: {events[-2:]}"
    for event in events:
        if event == "data: [DONE]":
            continue
        if not event.startswith("data: "):
            return f"not a data event: {event[:200]!r}"
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return f"event is not JSON: {event[:200]!r}"
        if isinstance(obj, dict) and "error" in obj:
            problem = error_problem(obj)
            if problem is not None:
                return f"error event: {problem}"
    return None


def response_problem(status: int, content_type: str | None, content: bytes, complete: bool = True) -> str | None:
    """What is wrong with one HTTP answer: a 5xx, an error without the JSON error body, a stream
    that is not well-formed SSE."""
    kind = media_type(content_type)
    if status >= 500:
        return f"status {status}: {content[:300]!r}"
    if status >= 400:
        if kind != "application/json":
            return f"error content type {kind!r}: {content[:200]!r}"
        try:
            return error_problem(json.loads(content))
        except ValueError:
            return f"error body is not JSON: {content[:200]!r}"
    if kind == "text/event-stream":
        return sse_problem(content, complete)
    return None


def ws_message_problem(msg: Any) -> str | None:
    """None when `msg` is a well-formed server message (a delta, or an error with the error body)."""
    if not isinstance(msg, dict) or msg.get("type") not in ("delta", "error"):
        return f"unknown message {str(msg)[:200]}"
    if msg["type"] == "error":
        problem = error_problem(msg)
        return None if problem is None else f"{problem} (in {str(msg)[:300]})"
    if not isinstance(msg.get("text"), str) or not isinstance(msg.get("token_ids"), list) or "id" not in msg:
        return f"malformed delta {str(msg)[:200]}"
    return None


# ---- values ----------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_edge_ints = st.sampled_from([-1, 0, 2**31, 2**63, -(2**63), 2**64, 10**30])
fuzz_values = _edge_ints | st.integers() | st.floats() | st.text(max_size=20) | json_values
deep_json = st.integers(1, 100_000).flatmap(
    lambda d: st.sampled_from(["[" * d + "]" * d, '{"a":' * d + "1" + "}" * d, "[" * d, '{"type":' * d])
)
_dumps = st.sampled_from([True, False]).map(lambda ascii_only: lambda v: json.dumps(v, ensure_ascii=ascii_only))

# Sampling params as a client sends them (short generations).
sampling_params = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(0, 8),
        "min_new_tokens": st.integers(0, 4),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 50),
        "min_p": st.floats(0, 1),
        "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.01, 2),
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "seed": st.integers(),
        "n": st.integers(1, 3),
    },
)
_SP_FIELDS = ["max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed", "n", "typo"]


def _merge(parts: tuple[dict, ...]) -> dict:
    return {k: v for part in parts for k, v in part.items()}


def _mutate(msg: dict, where: str, key: str, value: Any) -> dict:
    """`msg` with one field set to `value` (inside sampling_params when where == "sp") or dropped."""
    msg = dict(msg)
    if where == "drop":
        msg.pop(key, None)
    elif where == "sp":
        sp = msg.get("sampling_params")
        msg["sampling_params"] = {**(sp if isinstance(sp, dict) else {}), key: value}
    else:
        msg[key] = value
    return msg


def mutated(base: st.SearchStrategy[dict], fields: list[str]) -> st.SearchStrategy[dict]:
    """`base` messages with one field (top level, or in sampling_params) set to a fuzzed value or dropped."""
    keys = st.sampled_from(fields) | st.sampled_from(_SP_FIELDS) | st.text(max_size=6)
    return st.builds(_mutate, base, st.sampled_from(["set", "set", "sp", "drop"]), keys, fuzz_values)


# ---- WebSocket frames ---------------------------------------------------------------------------------

_ids = st.text(max_size=6).filter(lambda s: not s.startswith(PROBE)) | st.integers()
_prompt = st.one_of(
    st.fixed_dictionaries({"text": st.text(max_size=30) | st.lists(st.text(max_size=10), min_size=1, max_size=3)}),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)}),
)
_generate_options = st.fixed_dictionaries(
    {},
    optional={
        "sampling_params": sampling_params,
        "return_logprob": st.booleans(),
        "top_logprobs_num": st.integers(0, 3),
        "rid": st.text(min_size=1, max_size=6),
        "stream": st.booleans(),
    },
)
ws_generate = st.tuples(
    st.fixed_dictionaries({"type": st.just("generate"), "id": _ids}), _prompt, _generate_options
).map(_merge)
ws_cancel = st.fixed_dictionaries({"type": st.just("cancel"), "id": _ids})
_WS_FIELDS = ["type", "id", "text", "input_ids", "sampling_params", "stream", "rid", "return_logprob"]
_ws_messages = ws_generate | ws_cancel | mutated(ws_generate | ws_cancel, _WS_FIELDS) | json_values
_ws_json = st.tuples(_dumps, _ws_messages).map(lambda t: t[0](t[1]))
# (kind, payload): text frames carry str, binary frames bytes (the server reads both as JSON).
ws_frames = st.tuples(st.just("text"), _ws_json | st.text(max_size=200) | deep_json) | st.tuples(
    st.just("bytes"), _ws_json.map(str.encode) | st.binary(max_size=200) | deep_json.map(str.encode)
)

# ---- raw HTTP bodies ------------------------------------------------------------------------------------

_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}),
    min_size=1,
    max_size=3,
)
_openai_options = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 4),
        "n": st.integers(1, 2),
        "stream": st.booleans(),
        "temperature": st.floats(0, 2),
        "seed": st.integers(0, 2**32),
        "stop": st.text(max_size=3),
    },
)
_BASES = {
    "/v1/completions": st.tuples(
        st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20), "max_tokens": st.integers(1, 4)}),
        _openai_options,
    ).map(_merge),
    "/v1/chat/completions": st.tuples(
        st.fixed_dictionaries({"messages": _messages, "max_tokens": st.integers(1, 4)}), _openai_options
    ).map(_merge),
    "/generate": st.tuples(
        _prompt,
        st.fixed_dictionaries({"sampling_params": st.fixed_dictionaries({"max_new_tokens": st.integers(0, 4)})}),
        st.fixed_dictionaries({}, optional={"stream": st.booleans(), "return_logprob": st.booleans()}),
    ).map(_merge),
    "/abort_request": st.fixed_dictionaries({"rid": st.text(max_size=8)}),
    "/flush_cache": st.fixed_dictionaries({}),
    "/tokenize": st.fixed_dictionaries(
        {"prompt": st.text(max_size=20)}, optional={"add_special_tokens": st.booleans()}
    ),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(-2, 60000), max_size=6)}),
    "/v1/embeddings": st.fixed_dictionaries(
        {"input": st.one_of(st.text(min_size=1, max_size=20), st.lists(st.text(min_size=1, max_size=8), max_size=3))},
        optional={"encoding_format": st.sampled_from(["float", "base64", "hex"]), "dimensions": st.integers(-1, 600)},
    ),
    "/encode": _prompt,
}
_FIELDS = ["prompt", "messages", "max_tokens", "n", "stream", "text", "input_ids", "sampling_params", "rid", "model"]
_FIELDS += ["tokens", "input", "echo", "logprobs", "logprob_start_len"]
_INVALID_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80abc", b"\xe2\x82"]


def _with_bytes(body: bytes, junk: bytes, at: int) -> bytes:
    """Invalid UTF-8 inside the first JSON string at or after `at` (or at the end)."""
    quote = body.find(b'"', min(at, len(body)))
    return body[: quote + 1] + junk + body[quote + 1 :] if quote >= 0 else body + junk


def _raw_bodies(path: str) -> st.SearchStrategy[bytes]:
    valid = _BASES[path] | mutated(_BASES[path], _FIELDS)
    as_bytes = st.tuples(_dumps, valid).map(lambda t: t[0](t[1]).encode())
    bad_utf8 = st.builds(_with_bytes, as_bytes, st.sampled_from(_INVALID_UTF8), st.integers(0, 60))
    truncated = st.tuples(as_bytes, st.integers(0, 80)).map(lambda t: t[0][: t[1]])
    nan = valid.map(lambda v: json.dumps({**v, "temperature": float("nan")}).encode())
    return st.one_of(
        as_bytes, as_bytes, bad_utf8, truncated, nan, deep_json.map(str.encode), st.binary(max_size=100), st.just(b"")
    )


def _encoded(body: bytes, content_type: str | None, encoding: str | None) -> tuple[bytes, dict[str, str]]:
    """The body sent with these headers; "gzip" is a real gzip of it, "gzip-lie" claims gzip."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    if encoding == "gzip":
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    elif encoding is not None:
        headers["Content-Encoding"] = encoding.removesuffix("-lie")
    return body, headers


_OTHER_TYPES = [None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"]
_content_types = st.sampled_from(["application/json"] * 6 + _OTHER_TYPES)
_encodings = st.sampled_from([None] * 8 + ["gzip", "gzip", "gzip-lie", "deflate-lie", "br-lie", "identity", "bogus"])


def raw_requests(path: str) -> st.SearchStrategy[tuple[bytes, dict[str, str]]]:
    """(body, headers) for POST `path`: mostly what a client sends, with one thing wrong."""
    return st.builds(_encoded, _raw_bodies(path), _content_types, _encodings)
