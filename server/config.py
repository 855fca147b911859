"""Options of the HTTP layer itself (the engine's own options live in `engine.server_args`).

Kept free of heavy imports so that `python -m server --help` and flag errors answer at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    model_path: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None  # default: model_path, as SGLang does
    api_key: str | None = None  # when set, every endpoint but /health* and /metrics needs it
    # GET /metrics is on unless --disable-metrics, as in vLLM (SGLang's --enable-metrics is accepted).
    enable_metrics: bool = True
    # Generations admitted beyond max_running_requests before new ones get 503 (None: no limit).
    max_queued_requests: int | None = None
    max_body_size: int = 32 * 2**20  # bytes; larger request bodies get 413
    graceful_shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    health_check_timeout: float = 20.0  # seconds /health_generate waits for its one token
    # Slow clients: an idle keep-alive connection, or one whose request headers have not fully
    # arrived, is closed after this many seconds (uvicorn's --timeout-keep-alive, which SGLang
    # passes through); a request body must arrive within body_read_timeout (else 408).
    timeout_keep_alive: float = 30.0
    body_read_timeout: float = 60.0
    # Open connections (HTTP and WebSocket) beyond this many get 503 and are closed at once.
    max_connections: int = 4096
    log_level: str = "info"
    # Data parallelism (server/dp/): replicas behind a routing front end; 1 = this process serves.
    dp_size: int = 1
    load_balance_method: str = "cache_aware"
    ray_address: str | None = None  # place the replicas as Ray actors on this cluster
    # Splits <think>...</think> out of chat completions into reasoning_content (server/reasoning.py).
    reasoning_parser: str | None = None
    # The tool-call format of chat completions (server/tool_parsers/); None: detected from the chat template.
    tool_call_parser: str | None = None

    @property
    def model_name(self) -> str:
        """The name clients must use in `model` (and that responses report)."""
        return self.served_model_name or self.model_path

    def public(self) -> dict[str, object]:
        """The config as /get_server_info shows it: never the API key itself."""
        out = dict(self.__dict__)
        out["api_key"] = "<set>" if self.api_key else None
        out["served_model_name"] = self.model_name
        return out
