"""The LoRA adapter endpoints, SGLang's names and bodies (behind the API key when one is set):

    POST /load_lora_adapter {"lora_name", "lora_path"}    a PEFT LoRA folder on the server's disk
    POST /unload_lora_adapter {"lora_name"}

Requests then name an adapter by `lora_name`: /generate's `lora_path`, the OpenAI routes'
`model`, a WebSocket generate's `lora_path`; GET /v1/models lists the loaded ones. A folder that is
not a PEFT LoRA adapter, a name in use, an unknown name, or an adapter some open request uses
(unloading is refused rather than pulling it from under them) is a 400 naming the field.
Semantics: engine/lora_operations.py.
"""

from __future__ import annotations

from aiohttp import web

from server.protocol_native import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from server.request_body import read_json
from server.state import STATE


async def load_lora_adapter(request: web.Request) -> web.Response:
    req = await read_json(request, LoadLoRAAdapterRequest)
    loaded = await request.app[STATE].engine.load_lora_adapter(req.lora_name, req.lora_path)
    message = f"Loaded LoRA adapter {req.lora_name}."
    return web.json_response({"success": True, "message": message, "loaded_adapters": loaded})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    req = await read_json(request, UnloadLoRAAdapterRequest)
    loaded = await request.app[STATE].engine.unload_lora_adapter(req.lora_name)
    message = f"Unloaded LoRA adapter {req.lora_name}."
    return web.json_response({"success": True, "message": message, "loaded_adapters": loaded})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
