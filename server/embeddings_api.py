"""Embeddings: OpenAI's POST /v1/embeddings and SGLang's POST /encode, served by the same engine
as generation (`Engine.encode`: each input is a prefill whose final hidden states are pooled by
--pooling-method and L2-normalised; it is batched with the running generations and shares the
prefix cache). With --is-embedding the server serves only these.

/v1/embeddings takes a string, a list of strings, a list of token ids or a list of id lists;
`encoding_format: "base64"` answers each vector as the base64 of its float32 little-endian bytes
(what OpenAI sends, and what the `openai` client asks for by default); `dimensions` is accepted only
as the model's own width (no truncation). Inputs count against admission like generations.
"""

from __future__ import annotations

import base64
import time

import msgspec
import numpy as np
from aiohttp import web

from engine import EmbeddingResult, Prompt
from server.errors import ApiError
from server.openai_common import new_id
from server.protocol_tokens import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    EncodeMetaInfo,
    EncodeRequest,
    EncodeResponse,
)
from server.request_body import read_json
from server.state import STATE, ServerState

MAX_INPUTS = 2048  # inputs per request, as OpenAI caps them


def _inputs(value: object, param: str) -> tuple[list[Prompt], bool]:
    """The prompts of an input field, and whether it was a batch: a string, a list of strings, a
    list of ids (one prompt) or a list of id lists."""
    if isinstance(value, str):
        return [value], False
    if not isinstance(value, list) or not value:
        raise ApiError(400, f"{param} must not be empty", param=param)
    if len(value) > MAX_INPUTS:
        raise ApiError(400, f"{param} has {len(value)} entries; at most {MAX_INPUTS}", param=param)
    if all(isinstance(v, int) for v in value):
        return [list(value)], False
    if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        return list(value), True
    raise ApiError(
        400,
        f"{param} must be a string, a list of strings, a list of token ids or a list of token-id lists",
        param=param,
    )


async def _encode(state: ServerState, prompts: list[Prompt], rid: str) -> list[EmbeddingResult]:
    release = state.admit(len(prompts))
    try:
        out = await state.engine.encode(prompts, rid)
    finally:
        release()
    assert isinstance(out, list)
    return out


def _vector(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
    return values


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, EmbeddingRequest)
    state.check_model(req.model)
    width = state.engine.model_info.hidden_size
    if req.dimensions is not None and req.dimensions != width:
        raise ApiError(
            400, f"dimensions: this model's embeddings have {width} dimensions, and none other", param="dimensions"
        )
    prompts, _ = _inputs(req.input, "input")
    results = await _encode(state, prompts, new_id("embd"))
    data = [EmbeddingData(i, _vector(r.embedding, req.encoding_format)) for i, r in enumerate(results)]
    tokens = sum(r.prompt_tokens for r in results)
    body = EmbeddingResponse(data, state.config.model_name, EmbeddingUsage(tokens, tokens))
    return web.json_response(body=msgspec.json.encode(body))


async def encode(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, EncodeRequest)
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", param="text")
    param = "text" if req.text is not None else "input_ids"
    prompts, many = _inputs(req.text if req.text is not None else req.input_ids, param)
    start = time.perf_counter()
    results = await _encode(state, prompts, req.rid or new_id("encode"))
    latency = time.perf_counter() - start
    out = [
        EncodeResponse(r.embedding, EncodeMetaInfo(r.rid, r.prompt_tokens, r.cached_tokens, latency)) for r in results
    ]
    return web.json_response(body=msgspec.json.encode(out if many else out[0]))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/encode", encode)
