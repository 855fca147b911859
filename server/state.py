"""What every handler shares: the engine, the config, the metrics, and admission control.

Admission is counted here, in the HTTP layer, because it must answer synchronously: a request
over the queue limit gets its 503 before anything reaches the engine. The limit counts engine
generations (a request with n=4 takes 4): `max_running_requests` of them run, and at most
`max_queued_requests` more may wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Protocol

from aiohttp import web

from engine import Engine
from server.config import ServerConfig
from server.errors import ApiError, unavailable
from server.metrics import Metrics
from server.tool_parsers import select_format

log = logging.getLogger(__name__)


class Abortable(Protocol):
    """What shutdown needs of an open `GenerationGroup` (declared here: no import loop)."""

    def abort(self, error: ApiError) -> None: ...


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = Metrics(config.model_name)
        self.engine_started_at = time.time()
        self.draining = False  # set on shutdown: new generations get 503, running ones finish
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        # Open generation groups (they register themselves), so that shutdown past the grace
        # period can end each one with an error while the engine still runs.
        self.live: set[Abortable] = set()
        q = config.max_queued_requests
        self.max_inflight = None if q is None else engine.args.max_running_requests + q
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        # The tool-call format: --tool-call-parser, else the one the chat template renders `tools` in, else the
        # generic JSON envelope. Logged once: a model whose calls come back as text is debugged from this line.
        self.tool_format, why = select_format(config.tool_call_parser, engine.tokenizer)
        log.info("tool calls: %s format (%s)", self.tool_format.name, why)

    @property
    def context_len(self) -> int:
        return self.engine.model_info.context_len

    def admit(self, n: int) -> Callable[[], None]:
        """Reserve room for `n` generations or raise a 503; returns the (idempotent) release."""
        if self.draining:
            raise unavailable("the server is shutting down", code="shutting_down")
        if not self.engine.healthy:
            raise unavailable("the engine is unhealthy", code="engine_unhealthy")
        if self.max_inflight is not None and n > self.max_inflight:  # could never be admitted: not a 503
            raise ApiError(
                400,
                f"the request asks for {n} generations; at most {self.max_inflight} can be in flight "
                f"(--max-running-requests {self.engine.args.max_running_requests} + --max-queued-requests "
                f"{self.config.max_queued_requests})",
                param="n",
                code="request_too_large",
            )
        if self.max_inflight is not None and self.inflight + n > self.max_inflight:
            raise unavailable(
                f"the request queue is full ({self.inflight} generations in flight, at most "
                f"{self.config.max_queued_requests} may queue); retry later",
                code="queue_full",
            )
        self.inflight += n
        self.idle.clear()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight -= n
                if self.inflight == 0:
                    self.idle.set()

        return release

    def check_model(self, model: str | None) -> str | None:
        """OpenAI requests name a model: the one we serve (its served name or path), or a loaded
        LoRA adapter by name (vLLM's and SGLang's way), whose name is returned (None: the base).

        Otherwise 404 with OpenAI's body for it (type invalid_request_error, code model_not_found).
        """
        if model is not None and model not in (self.config.model_name, self.config.model_path):
            if model in self.engine.lora_adapters():
                return model
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
                type="invalid_request_error",
            )
        return None

    def _token_text(self, token_id: int) -> str:
        return self.engine.detokenize([token_id])


STATE: web.AppKey[ServerState] = web.AppKey("state", ServerState)
