"""The OpenAPI 3.1 document of the HTTP API, served at GET /openapi.json.

The request and response schemas are generated from the msgspec Structs in `server/protocol.py`,
`protocol_native.py` and `protocol_tokens.py` (`msgspec.json.schema_components`), so the document
cannot drift from what the handlers decode: change a Struct and the schema changes with it.
msgspec emits JSON Schema 2020-12, which is OpenAPI 3.1's dialect, so the component schemas go in
unchanged. The operations themselves (which body, which statuses, which content types) are
described here in `_OPERATIONS`, one entry per path.

The document lists the routes the app really has: it is built once, when the app starts (its
router is frozen by then, whatever order `build_app` added routes in), from `app.router`. A route
missing from `_OPERATIONS` still appears, marked `x-undocumented` so a test notices it.

/openapi.json needs no API key, as in SGLang and FastAPI: it says nothing about the model or the
server that the open /health does not, and clients and fuzzers (tests/test_fuzz.py) need the
schema before they can know how to authenticate (the `bearer` scheme is in it when a key is set).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from server import openapi_schemas as answers
from server.errors import ErrorResponse
from server.native_api import VERSION
from server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from server.protocol_native import (
    AbortRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadInfo,
    LoadLoRAAdapterRequest,
    MemoryTagsRequest,
    PauseGenerationRequest,
    ProfileRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    VersionResponse,
    WeightsGroupNameRequest,
    WsCancel,
    WsDelta,
    WsError,
    WsGenerate,
)
from server.protocol_tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    EncodeRequest,
    EncodeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)

OPENAPI_PATH = "/openapi.json"


@dataclass
class _Document:
    """The encoded document; filled on startup (the app is frozen then, so a holder, not a key)."""

    body: bytes = b""


OPENAPI: web.AppKey[_Document] = web.AppKey("openapi", _Document)
_REF = "#/components/schemas/{name}"
_STRUCTS: tuple[type, ...] = (
    CompletionRequest,
    CompletionResponse,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionChunk,
    ModelList,
    GenerateRequest,
    GenerateResponse,
    AbortRequest,
    ProfileRequest,
    UpdateWeightsFromDiskRequest,
    PauseGenerationRequest,
    MemoryTagsRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    WeightsGroupNameRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    ErrorResponse,
    WsGenerate,
    WsCancel,
    WsDelta,
    WsError,
    TokenizeRequest,
    TokenizeResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
    LoadInfo,
    EmbeddingRequest,
    EmbeddingResponse,
    EncodeRequest,
    EncodeResponse,
)


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(name=name)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _sse(event: str) -> dict[str, Any]:
    """Server-sent events as OpenAPI 3.1 describes them (the schema is one event): each `data` is
    an `event` object or, once the status is spent, an error body, and the stream ends in [DONE]."""
    payload = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(event), _ref("ErrorResponse")]},
    }
    data = {"anyOf": [{"const": "[DONE]"}, payload]}
    return {"text/event-stream": {"schema": {"type": "object", "properties": {"data": data}, "required": ["data"]}}}


_ERROR_TEXT = {
    400: "invalid request (the body names the field in `param`)",
    401: "missing or invalid API key",
    404: "unknown model",
    408: "the request body did not arrive in time",
    413: "request body over --max-body-size",
    500: "a server bug, or a generation the engine aborted",
    503: "shutting down, engine unhealthy, or the queue is full (retry later)",
}


@dataclass(frozen=True)
class _Op:
    """What one operation takes and answers; `errors` are its 4xx/5xx statuses besides 401."""

    summary: str
    ok: dict[str, Any] = field(default_factory=dict)  # media type -> media object ({} = no body)
    ok_text: str = "success"
    body: str | None = None  # request Struct name, sent as application/json
    body_required: bool = True
    errors: tuple[int, ...] = (500,)
    open: bool = False  # no API key needed (app.py's open paths)
    status: int = 200
    extra: dict[str, Any] = field(default_factory=dict)  # vendor extensions (x-...)


_BODY_ERRORS = (400, 408, 413, 500)
_GEN_ERRORS = (*_BODY_ERRORS, 503)
_GENERATE_OK = {"oneOf": [_ref("GenerateResponse"), {"type": "array", "items": _ref("GenerateResponse")}]}
_FLUSH = _Op("Drop every cached prefix (400 while requests run)", _json(answers.SUCCESS), errors=(400, 500))
_MEMORY = _Op(
    "Release (resume) the KV pool and/or the weights (SGLang's tags); requests wait while released",
    _json(answers.SUCCESS),
    body="MemoryTagsRequest",
    body_required=False,
    errors=_BODY_ERRORS,
)
_MODEL = _Op("The served model (SGLang)", _json(answers.MODEL_INFO))
_LORA, _LORA_OK = "a LoRA adapter by name (SGLang; 400: a bad folder, unknown, in use)", _json(answers.SUCCESS)
_SERVER = _Op("Engine options, HTTP options and the scheduler's state (SGLang)", _json(answers.SERVER_INFO))
_HEALTH_TEXT = "healthy (empty body)"
_TOKENIZE = _Op(
    "Tokenize a prompt, a batch of prompts (SGLang) or chat messages through the chat template (vLLM)",
    _json(_ref("TokenizeResponse")),
    body="TokenizeRequest",
    errors=_BODY_ERRORS,
)
_DETOKENIZE = _Op(
    "The text of token ids, or of a batch of id lists (400 naming an id outside the vocabulary)",
    _json(_ref("DetokenizeResponse")),
    body="DetokenizeRequest",
    errors=_BODY_ERRORS,
)
_QUERY_KEY = {  # server/dashboard.py: a browser sets no header on a page load or a socket handshake
    "parameters": [
        {
            "name": "api_key",
            "in": "query",
            "required": False,
            "description": "the API key, instead of the Authorization header (these dashboard routes only)",
            "schema": {"type": "string"},
        },
        {  # server/dp/dashboard.py
            "name": "dp_rank",
            "in": "query",
            "required": False,
            "description": "behind a --dp-size front end, the replica whose dashboard this is (default 0); "
            "a single server ignores it",
            "schema": {"type": "integer", "minimum": 0},
        },
    ]
}

# (method, path) -> operation. Aliases share their entry.
_OPERATIONS: dict[tuple[str, str], _Op] = {
    ("POST", "/v1/completions"): _Op(
        "OpenAI text completion; `stream: true` answers server-sent events of CompletionResponse",
        {**_json(_ref("CompletionResponse")), **_sse("CompletionResponse")},
        body="CompletionRequest",
        errors=(*_GEN_ERRORS, 404),
    ),
    ("POST", "/v1/chat/completions"): _Op(
        "OpenAI chat completion; `stream: true` answers server-sent events of ChatCompletionChunk",
        {**_json(_ref("ChatCompletionResponse")), **_sse("ChatCompletionChunk")},
        body="ChatCompletionRequest",
        errors=(*_GEN_ERRORS, 404),
    ),
    ("GET", "/v1/models"): _Op("The served model, OpenAI's list", _json(_ref("ModelList"))),
    ("POST", "/generate"): _Op(
        "SGLang generation: one object, or a list for a batch or n > 1; `stream: true` answers events",
        {**_json(_GENERATE_OK), **_sse("GenerateResponse")},
        body="GenerateRequest",
        errors=_GEN_ERRORS,
    ),
    ("GET", "/health"): _Op("Liveness", ok_text=_HEALTH_TEXT, errors=(503,), open=True),
    ("GET", "/health_generate"): _Op(
        "Readiness: the engine produced a token in time", ok_text=_HEALTH_TEXT, errors=(500, 503), open=True
    ),
    ("GET", "/get_model_info"): _MODEL,
    ("GET", "/model_info"): _MODEL,
    ("GET", "/get_server_info"): _SERVER,
    ("GET", "/server_info"): _SERVER,
    ("GET", "/version"): _Op("The server's version", _json(_ref("VersionResponse"))),
    ("GET", "/get_load"): _Op(
        "Each data-parallel rank's load: running and waiting requests, KV tokens in use (SGLang)",
        _json({"type": "array", "items": _ref("LoadInfo")}),
    ),
    ("POST", "/v1/embeddings"): _Op(
        "OpenAI embeddings: the prompt's final hidden states pooled (--pooling-method) and L2-normalised",
        _json(_ref("EmbeddingResponse")),
        body="EmbeddingRequest",
        errors=(*_GEN_ERRORS, 404),
    ),
    ("POST", "/encode"): _Op(
        "SGLang embeddings: one object, or a list for a batch",
        _json({"oneOf": [_ref("EncodeResponse"), {"type": "array", "items": _ref("EncodeResponse")}]}),
        body="EncodeRequest",
        errors=_GEN_ERRORS,
    ),
    ("POST", "/tokenize"): _TOKENIZE,
    ("POST", "/v1/tokenize"): _TOKENIZE,
    ("POST", "/detokenize"): _DETOKENIZE,
    ("POST", "/v1/detokenize"): _DETOKENIZE,
    ("GET", "/tokenizer_info"): _Op(
        "The tokenizer: special tokens and ids, chat template, context length (vLLM's; lm-eval's remote tokenizer)",
        _json(_ref("TokenizerInfoResponse")),
    ),
    ("POST", "/flush_cache"): _FLUSH,
    ("GET", "/flush_cache"): _FLUSH,
    ("POST", "/update_weights_from_disk"): _Op(
        "Serve a new checkpoint of the same model without a restart (SGLang); running requests end "
        "first unless abort_all_requests; 400 (old weights kept) for another model's shapes",
        _json(answers.WEIGHTS_UPDATED),
        body="UpdateWeightsFromDiskRequest",
        errors=_BODY_ERRORS,
    ),
    ("POST", "/pause_generation"): _Op(
        "Stop generating until /continue_generation (SGLang's modes abort, retract, in_place)",
        _json(answers.SUCCESS),
        body="PauseGenerationRequest",
        body_required=False,
        errors=_BODY_ERRORS,
    ),
    ("POST", "/continue_generation"): _Op("Lift a pause", _json(answers.SUCCESS)),
    ("POST", "/init_weights_update_group"): _Op(
        "Join a trainer's process group for weight updates (SGLang); a single server's route",
        _json(answers.SUCCESS),
        body="InitWeightsUpdateGroupRequest",
        errors=_BODY_ERRORS,
    ),
    ("POST", "/update_weights_from_distributed"): _Op(
        "Take the weights the trainer broadcasts over the group, by name (SGLang); 400: weights kept",
        _json(answers.WEIGHTS_UPDATED),
        body="UpdateWeightsFromDistributedRequest",
        errors=_BODY_ERRORS,
    ),
    ("POST", "/destroy_weights_update_group"): _Op(
        "Leave a weight update group",
        _json(answers.SUCCESS),
        body="WeightsGroupNameRequest",
        body_required=False,
        errors=_BODY_ERRORS,
    ),
    ("POST", "/load_lora_adapter"): _Op(f"Load {_LORA}", _LORA_OK, body="LoadLoRAAdapterRequest", errors=_BODY_ERRORS),
    ("POST", "/unload_lora_adapter"): _Op(
        f"Unload {_LORA}", _LORA_OK, body="UnloadLoRAAdapterRequest", errors=_BODY_ERRORS
    ),
    ("POST", "/release_memory_occupation"): _MEMORY,
    ("POST", "/resume_memory_occupation"): _MEMORY,
    ("POST", "/abort_request"): _Op(
        "Abort a generation by rid (unknown rids are ignored), or every one with abort_all",
        _json(answers.SUCCESS),
        body="AbortRequest",
        errors=_BODY_ERRORS,
    ),
    ("POST", "/start_profile"): _Op(
        "Start the torch profiler around the forwards (SGLang); optional body; trace under --profile-dir",
        _json(answers.PROFILE),
        body="ProfileRequest",
        body_required=False,
        errors=_BODY_ERRORS,
    ),
    ("POST", "/stop_profile"): _Op(
        "Stop the profiler and write its Chrome trace (400 when none runs)", _json(answers.PROFILE), errors=(400, 500)
    ),
    ("POST", "/dump_flight_recorder"): _Op(
        "Dump the flight recorder (every actor message and scheduling decision) to a file under "
        "--flight-recorder-dir; replay it with `python -m engine.replay PATH` (400 when it is off)",
        _json(answers.FLIGHT_DUMP),
        errors=(400, 500),
    ),
    ("GET", "/metrics"): _Op(
        "Prometheus metrics (on unless --disable-metrics)",
        {"text/plain": {"schema": {"type": "string"}}},
        open=True,
    ),
    ("GET", "/ws"): _Op(
        "WebSocket: many tagged generations per socket (see x-websocket and server/ws.py)",
        ok_text="switching protocols (a plain GET without the upgrade headers is a 400)",
        status=101,
        errors=(400, 500),
        extra={
            "x-websocket": {
                "client": {"oneOf": [_ref("WsGenerate"), _ref("WsCancel")]},
                "server": {"oneOf": [_ref("WsDelta"), _ref("WsError")]},
            }
        },
    ),
    ("GET", "/dashboard"): _Op(
        "The live operator dashboard: one self-contained HTML page fed by GET /dashboard/ws",
        {"text/html": {"schema": {"type": "string"}}},
        extra=_QUERY_KEY,
    ),
    ("GET", "/dashboard/ws"): _Op(
        "WebSocket: the dashboard's feed, a JSON snapshot of the scheduler every 100 ms (server/dashboard.py)",
        ok_text="switching protocols (a plain GET without the upgrade headers is a 400)",
        status=101,
        errors=(400, 500),
        extra={**_QUERY_KEY, "x-websocket": {"server": {"type": "object", "required": ["type"]}}},
    ),
    ("GET", OPENAPI_PATH): _Op("This document", _json(answers.OBJECT), open=True),
}


def _present(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


# Rules the handlers check that a Struct cannot say (added to the generated component schemas).
_RULES: dict[str, dict[str, Any]] = {
    "GenerateRequest": {"oneOf": [_present("text"), _present("input_ids")]},  # exactly one prompt
    "WsGenerate": {"oneOf": [_present("text"), _present("input_ids")]},
    "TokenizeRequest": {"oneOf": [_present("prompt"), _present("messages")]},
    "EncodeRequest": {"oneOf": [_present("text"), _present("input_ids")]},
}
_UNDOCUMENTED = _Op("undocumented route", ok_text="see the handler", extra={"x-undocumented": True})


def _operation(op: _Op, secured: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": op.ok_text}
    if op.ok:
        ok["content"] = op.ok
    responses: dict[str, Any] = {str(op.status): ok}
    statuses = set(op.errors) | ({401} if secured and not op.open else set())
    for status in sorted(statuses):
        responses[str(status)] = {"description": _ERROR_TEXT[status], "content": _json(_ref("ErrorResponse"))}
    out: dict[str, Any] = {"summary": op.summary, "responses": responses, **op.extra}
    if op.body is not None:
        out["requestBody"] = {"required": op.body_required, "content": _json(_ref(op.body))}
    if secured and op.open:
        out["security"] = []  # overrides the document-wide bearer requirement
    return out


def build_openapi(routes: Iterable[tuple[str, str]], *, secured: bool, title: str = "asyncllm") -> dict[str, Any]:
    """The OpenAPI 3.1 document for `routes` ((method, path) pairs; HEAD is implied by GET and
    skipped). `secured`: an API key is configured, so every operation but the open ones needs
    `Authorization: Bearer <key>`."""
    _, schemas = msgspec.json.schema_components(_STRUCTS, ref_template=_REF)
    for name, rule in _RULES.items():
        schemas[name] = {**schemas[name], **rule}
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes:
        if method in ("HEAD", "*"):
            continue
        op = _OPERATIONS.get((method, path), _UNDOCUMENTED)
        paths.setdefault(path, {})[method.lower()] = _operation(op, secured)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": VERSION,
            "description": "OpenAI-compatible and SGLang-native LLM serving. Every error is "
            'OpenAI\'s body: {"error": {"message", "type", "param", "code"}}.',
        },
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": schemas},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


def app_routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path) of every route `app` has, in registration order."""
    return [(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None]


async def _openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI].body, content_type="application/json")


def add_routes(app: web.Application, *, secured: bool) -> None:
    """GET /openapi.json; the document is built on startup, once every route is registered.
    `secured`: an API key is set. Used by a single server (server/app.py) and by the --dp-size
    front end (server/dp/frontend.py), which serves the same routes and so the same document."""
    app[OPENAPI] = _Document()
    app.router.add_get(OPENAPI_PATH, _openapi)

    async def build_on_startup(app: web.Application) -> None:
        app[OPENAPI].body = msgspec.json.encode(build_openapi(app_routes(app), secured=secured))

    app.on_startup.append(build_on_startup)


__all__ = ["OPENAPI_PATH", "add_routes", "app_routes", "build_openapi"]
