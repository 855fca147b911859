"""HTTP front end of the engine: OpenAI-compatible and SGLang-native endpoints, WebSocket
streaming and Prometheus metrics, on aiohttp.

    python -m server --model-path smollm2-135m --port 30000

In process (tests, embedding): `build_app(engine, ServerConfig(...))` gives the aiohttp
application for an already started `Engine`. `build_app` is imported lazily so that the CLI
(`--help`, a bad flag) answers without importing torch.
"""

from server.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str):
    if name == "build_app":
        from server.app import build_app

        return build_app
    raise AttributeError(f"module 'server' has no attribute {name!r}")
