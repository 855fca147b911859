"""Operator endpoints (behind the API key when one is set): POST /start_profile and
POST /stop_profile, SGLang's names, on the engine's torch profiler (engine/profiler.py), and
POST /dump_flight_recorder (engine/recorder/: every message and scheduling decision, replayable).

    curl -X POST localhost:30000/start_profile -d '{"num_steps": 10}'   # or no body: until stopped
    curl -X POST localhost:30000/stop_profile                          # -> {"trace": "<path>"}

Traces are written under --profile-dir (default $SGLANG_TORCH_PROFILER_DIR, else a temporary
folder); SGLang's `output_dir` field is ignored (logged as unknown): a client never picks where
the server writes.
"""

from __future__ import annotations

from aiohttp import web

from server.errors import decode
from server.protocol_native import ProfileRequest
from server.request_body import note_unknown_fields, read_body
from server.state import STATE


async def start_profile(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request)
    req = decode(body, ProfileRequest) if body.strip() else ProfileRequest()
    if body.strip():
        note_unknown_fields(body, ProfileRequest)
    trace = await state.engine.start_profile(num_steps=req.num_steps, activities=req.activities)
    return web.json_response({"success": True, "message": "Start profiling.", "trace": trace})


async def stop_profile(request: web.Request) -> web.Response:
    trace = await request.app[STATE].engine.stop_profile()
    return web.json_response({"success": True, "message": "Stop profiling.", "trace": trace})


async def dump_flight_recorder(request: web.Request) -> web.Response:
    """Write the flight recorder's ring to a file under --flight-recorder-dir (the server picks
    the path); `python -m engine.replay PATH` replays it. Works while the engine is unhealthy."""
    engine = request.app[STATE].engine
    path = engine.dump_flight_recorder("POST /dump_flight_recorder")
    recorder = (await engine.get_internal_state())["flight_recorder"] if engine.healthy else {}
    return web.json_response({"success": True, "path": path, **recorder})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/start_profile", start_profile)
    app.router.add_post("/stop_profile", stop_profile)
    app.router.add_post("/dump_flight_recorder", dump_flight_recorder)
