"""The RL rollout endpoints, SGLang's names (behind the API key when one is set):

    POST /update_weights_from_disk {"model_path", "load_format"?, "weight_version"?,
                                    "abort_all_requests"?, "flush_cache"?}
    POST /pause_generation {"mode": "abort" | "retract" | "in_place"}   (optional body)
    POST /continue_generation
    POST /release_memory_occupation {"tags": ["kv_cache", "weights"]}   (optional body: both)
    POST /resume_memory_occupation {"tags": [...]}
    POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
                                     "group_name"?, "backend"?}
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name"?, ...}
    POST /destroy_weights_update_group {"group_name"?}

A trainer writes a checkpoint and points the server at it; running requests end under the old
weights first (new ones wait) unless it asks to abort them, or it pauses generation around the
update. A checkpoint that is not the served model with other values (other shapes, a tensor
missing) is a 400 and the old weights keep serving. Semantics: engine/actors/generation_control.py.
Updates from tensors are in process only (`Engine.update_weights_from_tensor`): SGLang's HTTP
form ships pickled tensors, which a server must never unpickle from a client.
"""

from __future__ import annotations

from aiohttp import web

from engine import ModelLoadError
from server.errors import ApiError, decode
from server.protocol_native import (
    InitWeightsUpdateGroupRequest,
    MemoryTagsRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    WeightsGroupNameRequest,
)
from server.request_body import note_unknown_fields, read_body, read_json
from server.state import STATE


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    req = await read_json(request, UpdateWeightsFromDiskRequest)
    try:
        version = await engine.update_weights_from_disk(
            req.model_path, req.load_format, req.weight_version, req.abort_all_requests, req.flush_cache
        )
    except ModelLoadError as e:
        raise ApiError(400, str(e), param="model_path", code="weights_not_updated") from None
    message = "Succeeded to update model weights."
    return web.json_response({"success": True, "message": message, "weight_version": version})


async def pause_generation(request: web.Request) -> web.Response:
    body = await read_body(request)
    req = decode(body, PauseGenerationRequest) if body.strip() else PauseGenerationRequest()
    if body.strip():
        note_unknown_fields(body, PauseGenerationRequest)
    await request.app[STATE].engine.pause_generation(req.mode)
    return web.json_response({"success": True, "message": f"Generation paused (mode={req.mode})."})


async def continue_generation(request: web.Request) -> web.Response:
    await request.app[STATE].engine.continue_generation()
    return web.json_response({"success": True, "message": "Generation continued."})


async def _memory_tags(request: web.Request) -> list[str] | None:
    body = await read_body(request)
    if not body.strip():
        return None
    note_unknown_fields(body, MemoryTagsRequest)
    return decode(body, MemoryTagsRequest).tags


async def release_memory_occupation(request: web.Request) -> web.Response:
    tags = await _memory_tags(request)
    await request.app[STATE].engine.release_memory_occupation(tags)
    return web.json_response({"success": True, "message": "Memory released."})


async def resume_memory_occupation(request: web.Request) -> web.Response:
    tags = await _memory_tags(request)
    await request.app[STATE].engine.resume_memory_occupation(tags)
    return web.json_response({"success": True, "message": "Memory resumed."})


async def init_weights_update_group(request: web.Request) -> web.Response:
    req = await read_json(request, InitWeightsUpdateGroupRequest)
    await request.app[STATE].engine.init_weights_update_group(
        req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend
    )
    return web.json_response({"success": True, "message": f"Joined weight update group {req.group_name}."})


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    req = await read_json(request, UpdateWeightsFromDistributedRequest)
    try:
        version = await request.app[STATE].engine.update_weights_from_distributed(
            req.names,
            req.dtypes,
            req.shapes,
            req.group_name,
            req.weight_version,
            req.abort_all_requests,
            req.flush_cache,
        )
    except ModelLoadError as e:
        raise ApiError(400, str(e), param="names", code="weights_not_updated") from None
    message = "Succeeded to update model weights."
    return web.json_response({"success": True, "message": message, "weight_version": version})


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await read_body(request)
    req = decode(body, WeightsGroupNameRequest) if body.strip() else WeightsGroupNameRequest()
    await request.app[STATE].engine.destroy_weights_update_group(req.group_name)
    return web.json_response({"success": True, "message": f"Left weight update group {req.group_name}."})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/release_memory_occupation", release_memory_occupation)
    app.router.add_post("/resume_memory_occupation", resume_memory_occupation)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
