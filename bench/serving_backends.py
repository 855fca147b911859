"""Streaming clients for the serving benchmark: one per wire protocol, all timing the same way.

A backend sends one request and returns a `StreamResult`: when it started, when each chunk that
carried new output arrived, the generated text, the server's token counts when it gave them, or
the error that made it fail. Every failure (HTTP status, connection error, an error event or an
abort in the stream) is caught here and returned as `success=False` with a message: one bad
request never ends a benchmark.

- openai: `POST /v1/completions` (or `/v1/chat/completions` for conversations) with
  `stream: true` and `stream_options.include_usage`; only standard OpenAI fields are read, so it
  works against any compatible server. `ignore_eos` is the one extension sent (vLLM and SGLang
  accept it) and only when enabled.
- native: SGLang's `POST /generate` with `stream: true`; every event carries the cumulative
  text and `meta_info` (prompt_tokens, completion_tokens, finish_reason).
- ws: this project's `GET /ws`; all requests share one socket, tagged by id, as a client
  multiplexing generations would (see server/ws.py for the message protocol).

A "chunk" is one streamed event that carries new output (text or tokens); events with nothing
new (role headers, a bare finish reason, usage) are not chunks. TTFT is the first chunk's arrival
minus the send time; ITL values are the gaps between consecutive chunks (per chunk, not per token).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

BACKENDS = ("openai", "native", "ws")
_MAX_ERROR_CHARS = 500


@dataclass
class RequestInput:
    prompt: str | list[dict[str, str]]  # text, or chat messages (conversations on the openai backend)
    output_len: int
    model: str | None
    ignore_eos: bool
    temperature: float = 0.0


@dataclass
class StreamResult:
    success: bool = False
    error: str = ""
    text: str = ""
    start: float = 0.0  # time.perf_counter() just before sending
    end: float = 0.0  # when the stream ended (or failed)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter() of each chunk
    chunk_tokens: list[int] | None = None  # tokens per chunk, where the protocol says
    prompt_tokens: int | None = None  # the server's counts, when it reported them
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else 0.0

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def fail(self, message: str) -> StreamResult:
        self.success, self.error, self.end = False, message[:_MAX_ERROR_CHARS], time.perf_counter()
        return self


class Backend(Protocol):
    async def send(self, req: RequestInput) -> StreamResult: ...

    async def close(self) -> None: ...


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_message(body: Any) -> str | None:
    """The message of an OpenAI-style error body `{"error": {"message": ...}}` (or a bare string)."""
    if isinstance(body, dict) and "error" in body:
        err = body["error"]
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return None


async def _http_error(resp: aiohttp.ClientResponse) -> str:
    text = await resp.text(errors="replace")
    try:
        msg = _error_message(json.loads(text)) or text
    except ValueError:
        msg = text
    return f"HTTP {resp.status}: {msg.strip() or resp.reason}"


async def _sse_events(resp: aiohttp.ClientResponse):
    """The JSON payloads of an SSE stream, then None for `data: [DONE]` (absent if the body just ends)."""
    async for raw in resp.content:
        line = raw.strip()
        if not line or line.startswith(b":") or not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield None
            return
        yield json.loads(data)


class _HttpBackend:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> None:
        self.session, self.base_url, self.headers = session, base_url.rstrip("/"), headers

    async def close(self) -> None:
        pass

    async def send(self, req: RequestInput) -> StreamResult:
        out = StreamResult()
        out.start = time.perf_counter()
        try:
            async with self.session.post(
                self.base_url + self.path(req), json=self.payload(req), headers=self.headers
            ) as resp:
                if resp.status != 200:
                    return out.fail(await _http_error(resp))
                done = False
                async for event in _sse_events(resp):
                    if event is None:
                        done = True
                        continue  # the generator ends right after [DONE]
                    message = self.on_event(out, event, time.perf_counter())
                    if message is not None:
                        return out.fail(message)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            return out.fail(_describe(e))
        out.end = time.perf_counter()
        if not done:  # both OpenAI and SGLang end a complete stream with [DONE]
            return out.fail("the stream ended without data: [DONE] (truncated)")
        if not out.chunk_times:
            return out.fail("the stream ended without any output")
        out.success = True
        return out

    def path(self, req: RequestInput) -> str:
        raise NotImplementedError

    def payload(self, req: RequestInput) -> dict[str, Any]:
        raise NotImplementedError

    def on_event(self, out: StreamResult, event: Any, now: float) -> str | None:
        """Record one event; return an error message to fail the request."""
        raise NotImplementedError


class OpenAIBackend(_HttpBackend):
    def path(self, req: RequestInput) -> str:
        return "/v1/chat/completions" if isinstance(req.prompt, list) else "/v1/completions"

    def payload(self, req: RequestInput) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": req.output_len,
            "temperature": req.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body["messages" if isinstance(req.prompt, list) else "prompt"] = req.prompt
        if req.model is not None:
            body["model"] = req.model
        if req.ignore_eos:
            body["ignore_eos"] = True
        return body

    def on_event(self, out: StreamResult, event: Any, now: float) -> str | None:
        message = _error_message(event)
        if message is not None:
            return f"error event in the stream: {message}"
        usage = event.get("usage")
        if usage:
            out.prompt_tokens = usage.get("prompt_tokens")
            out.completion_tokens = usage.get("completion_tokens")
            out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in event.get("choices") or []:
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                out.text += text
                out.chunk_times.append(now)
        return None


class NativeBackend(_HttpBackend):
    """SGLang /generate: cumulative text per event; new output = what grew since the last event."""

    def path(self, req: RequestInput) -> str:
        return "/generate"

    def payload(self, req: RequestInput) -> dict[str, Any]:
        if not isinstance(req.prompt, str):
            raise TypeError("the native backend sends text prompts")
        sp: dict[str, Any] = {"max_new_tokens": req.output_len, "temperature": req.temperature}
        if req.ignore_eos:
            sp["ignore_eos"] = True
        return {"text": req.prompt, "sampling_params": sp, "stream": True}

    def on_event(self, out: StreamResult, event: Any, now: float) -> str | None:
        message = _error_message(event)
        if message is not None:
            return f"error event in the stream: {message}"
        meta = event.get("meta_info") or {}
        reason = meta.get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            return f"aborted: {reason.get('message')}"
        text = event.get("text") or ""
        done = out.completion_tokens or 0
        tokens = meta.get("completion_tokens", done)
        if out.chunk_tokens is None:
            out.chunk_tokens = []
        if len(text) > len(out.text) or tokens > done:
            out.chunk_times.append(now)
            out.chunk_tokens.append(tokens - done)
        out.text = text
        out.prompt_tokens = meta.get("prompt_tokens", out.prompt_tokens)
        out.completion_tokens = tokens
        out.cached_tokens = meta.get("cached_tokens", out.cached_tokens)
        return None


class WsBackend:
    """All generations over one WebSocket, demultiplexed by id; reconnects if the socket drops."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> None:
        self.session, self.headers = session, headers
        self.url = base_url.rstrip("/") + "/ws"
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._waiting: dict[int, asyncio.Queue] = {}
        self._ids = itertools.count()

    async def _socket(self) -> aiohttp.ClientWebSocketResponse:
        async with self._lock:
            if self._ws is None or self._ws.closed:
                self._ws = await self.session.ws_connect(self.url, headers=self.headers, max_msg_size=0)
                self._reader = asyncio.create_task(self._read(self._ws))
            return self._ws

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        reason = "the WebSocket closed"
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                queue = self._waiting.get(data.get("id"))
                if queue is not None:
                    queue.put_nowait(data)
        except Exception as e:  # the socket broke: fail whoever waits on it
            reason = _describe(e)
        if ws.close_code is not None:
            reason += f" (code {ws.close_code})"
        for queue in list(self._waiting.values()):
            queue.put_nowait(ConnectionError(reason))

    async def send(self, req: RequestInput) -> StreamResult:
        if not isinstance(req.prompt, str):
            raise TypeError("the ws backend sends text prompts")
        out = StreamResult(chunk_tokens=[])
        gen_id = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting[gen_id] = queue
        sp: dict[str, Any] = {"max_new_tokens": req.output_len, "temperature": req.temperature}
        if req.ignore_eos:
            sp["ignore_eos"] = True
        out.start = time.perf_counter()
        try:
            ws = await self._socket()
            await ws.send_str(json.dumps({"type": "generate", "id": gen_id, "text": req.prompt, "sampling_params": sp}))
            while True:
                msg = await queue.get()
                now = time.perf_counter()
                if isinstance(msg, BaseException):
                    return out.fail(_describe(msg))
                if msg.get("type") == "error":
                    return out.fail(f"error message: {_error_message(msg)}")
                text, ids = msg.get("text") or "", msg.get("token_ids") or []
                if text or ids:
                    out.text += text
                    out.chunk_times.append(now)
                    out.chunk_tokens.append(len(ids))
                reason = msg.get("finish_reason")
                if reason is not None:
                    if reason.get("type") == "abort":
                        return out.fail(f"aborted: {reason.get('message')}")
                    meta = msg.get("meta_info") or {}
                    out.prompt_tokens = meta.get("prompt_tokens")
                    out.completion_tokens = meta.get("completion_tokens", sum(out.chunk_tokens))
                    out.cached_tokens = meta.get("cached_tokens")
                    break
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            return out.fail(_describe(e))
        finally:
            self._waiting.pop(gen_id, None)
        out.end = time.perf_counter()
        if not out.chunk_times:
            return out.fail("the generation ended without any output")
        out.success = True
        return out

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


def make_backend(name: str, session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> Backend:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if name == "openai":
        return OpenAIBackend(session, base_url, headers)
    if name == "native":
        return NativeBackend(session, base_url, headers)
    if name == "ws":
        return WsBackend(session, base_url, headers)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
