"""The soak run's clients: send one planned request (or one WebSocket session), carry out its
abort plan at the planned point, and record what came back as an `Outcome`.

Nothing here judges a completed request (bench/soak_checks.py does); a client records the raw
facts per choice: text, token ids or a token count where the protocol gives them, the server's
own count, the finish reason. Protocol failures (a non-200 status, an error event, a truncated
stream, a socket the server closed) are recorded as errors, and every 5xx, as well as every
mid-stream `server_error` that no abort of ours explains, is also kept in `server_errors` (the
run must have none). A 4xx must carry OpenAI's error body; one without it is a finding too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.soak_plan import SoakRequest

_DONE: dict[str, Any] = {}  # the sentinel for `data: [DONE]`
_MAX_MSG = 300


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] | None = None  # where the protocol returns them (/generate, /ws)
    counted: int | None = None  # tokens counted from the response itself (ids or logprob entries)
    reported: int | None = None  # the server's completion_tokens for this choice
    finish: str | None = None  # "length", "stop", "abort", ...


@dataclass
class Outcome:
    index: int
    kind: str
    choices: list[Choice]
    abort_sent: bool = False  # we carried out the abort plan (disconnected, posted, cancelled)
    disconnected: bool = False  # we closed the connection before the end: nothing more to check
    collateral: bool = False  # a ws generation ended because its socket was closed for another one
    errors: list[str] = field(default_factory=list)
    latency: float = 0.0
    ttft: float | None = None
    usage_completion: int | None = None  # chat: usage.completion_tokens (all choices together)

    def fail(self, message: str) -> None:
        self.errors.append(message[:_MAX_MSG])


class Pace:
    """Seconds per output token seen so far, to place a delayed abort inside a request's life."""

    def __init__(self, per_token: float = 0.05) -> None:
        self.per_token = per_token

    def observe(self, latency: float, tokens: int) -> None:
        self.per_token = 0.9 * self.per_token + 0.1 * latency / max(tokens, 1)

    def expected(self, tokens: int) -> float:
        return 0.05 + self.per_token * tokens


def _error_body_ok(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= err.keys()


async def _sse(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            yield _DONE if data == b"[DONE]" else json.loads(data)


class SoakClient:
    """One aiohttp session against the server; counts every status it sees per endpoint."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, run_id: str, headers: dict[str, str], lora: bool = False
    ) -> None:
        self.session, self.base, self.run_id, self.headers = session, base_url.rstrip("/"), run_id, headers
        self.lora = lora  # the server serves adapters: a bad request may name one it does not have
        self.statuses: Counter[str] = Counter()
        self.server_errors: list[str] = []
        self.bad_error_bodies: list[str] = []
        self.pace = Pace()

    # ---- shared pieces ------------------------------------------------------------------------

    async def _status_ok(self, path: str, resp: aiohttp.ClientResponse, out: Outcome) -> bool:
        self.statuses[f"{path} {resp.status}"] += 1
        if resp.status == 200:
            return True
        text = await resp.text(errors="replace")
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        msg = f"{path} #{out.index}: HTTP {resp.status}: {text[:_MAX_MSG]}"
        out.fail(msg)
        if resp.status >= 500:
            self.server_errors.append(msg)
        elif resp.status >= 400 and not _error_body_ok(body):
            self.bad_error_bodies.append(msg)
        return False

    def error_event(self, path: str, err: Any, out: Outcome) -> None:
        msg = f"{path} #{out.index}: error event: {json.dumps(err)[:_MAX_MSG]}"
        out.fail(msg)
        if not isinstance(err, dict) or err.get("type") == "server_error" or str(err.get("code", "")).startswith("5"):
            self.server_errors.append(msg)

    async def abort_rids(self, rids: list[str]) -> None:
        for rid in rids:
            async with self.session.post(self.base + "/abort_request", json={"rid": rid}, headers=self.headers) as r:
                self.statuses[f"/abort_request {r.status}"] += 1
                if r.status != 200:
                    msg = f"/abort_request {rid}: HTTP {r.status}: {(await r.text())[:_MAX_MSG]}"
                    (self.server_errors if r.status >= 500 else self.bad_error_bodies).append(msg)

    async def invalid(self, variant: int) -> str | None:
        """Send bad request number `variant` (cycling); None when it got its 4xx with OpenAI's body."""
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        cases: list[tuple[str, Any, int]] = [
            ("/v1/chat/completions", {**chat, "max_tokens": -1}, 400),
            ("/v1/chat/completions", {**chat, "model": "no-such-model"}, 404),
            ("/generate", {"text": "hi", "input_ids": [1, 2]}, 400),
            ("/generate", b"{not json", 400),
            ("/v1/chat/completions", {**chat, "messages": []}, 400),
            ("/generate", {"text": "hi", "sampling_params": {"temperature": -1.0}}, 400),
        ]
        if self.lora:  # first, so a short run sends it too
            cases.insert(0, ("/generate", {"text": "hi", "lora_path": "no-such-adapter"}, 400))
        path, body, want = cases[variant % len(cases)]
        kw = {"data": body, "headers": {**self.headers, "Content-Type": "application/json"}}
        what = f"bad request {variant % len(cases)} to {path}"
        try:
            async with self.session.post(self.base + path, **(kw if isinstance(body, bytes) else {"json": body})) as r:
                self.statuses[f"{path} {r.status}"] += 1
                text = await r.text(errors="replace")
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return f"{what}: {type(e).__name__}: {e}"
        try:
            ok_body = _error_body_ok(json.loads(text))
        except ValueError:
            ok_body = False
        if r.status >= 500:
            self.server_errors.append(f"{what}: HTTP {r.status}: {text[:_MAX_MSG]}")
        if r.status != want or not ok_body:
            if 400 <= r.status < 500 and not ok_body:
                self.bad_error_bodies.append(f"{what}: HTTP {r.status}: {text[:_MAX_MSG]}")
            return f"{what}: expected {want} with OpenAI's error body, got {r.status}: {text[:_MAX_MSG]}"
        return None

    def _rids(self, req: SoakRequest) -> list[str]:
        rid = req.rid(self.run_id)
        return [rid] if req.n == 1 else [f"{rid}-{j}" for j in range(req.n)]

    async def run(self, req: SoakRequest) -> Outcome:
        """One HTTP request of the plan, its abort included; never raises for a server's answer."""
        out = Outcome(req.index, req.kind, [Choice() for _ in range(req.n)])
        t0 = time.perf_counter()
        try:
            if req.kind == "chat":
                await self._chat(req, out)
            elif req.kind == "chat_stream":
                await self._chat_stream(req, out, t0)
            elif req.kind == "generate":
                await self._generate(req, out)
            elif req.kind == "generate_stream":
                await self._generate_stream(req, out, t0)
            else:
                raise ValueError(f"not an HTTP kind: {req.kind}")
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            out.fail(f"{req.kind} #{req.index}: {type(e).__name__}: {e}")
        except Exception as e:  # a response of an unexpected shape is a finding, not the end of the run
            out.fail(f"{req.kind} #{req.index}: unexpected response: {type(e).__name__}: {e}")
        out.latency = time.perf_counter() - t0
        if not out.errors and not out.abort_sent and req.kind in ("chat", "generate"):
            self.pace.observe(out.latency, req.max_tokens)
        return out

    async def _post_until(self, path: str, body: dict, out: Outcome, delay: float | None) -> Any:
        """POST and read the JSON answer; with a delay, disconnect when it expires (None back)."""

        async def call() -> Any:
            async with self.session.post(self.base + path, json=body, headers=self.headers) as resp:
                if not await self._status_ok(path, resp, out):
                    return None
                return await resp.json()

        if delay is None:
            return await call()
        try:
            async with asyncio.timeout(delay) as cm:
                return await call()
        except TimeoutError:
            if not cm.expired():
                raise
            out.abort_sent = out.disconnected = True
            return None

    # ---- /v1/chat/completions -----------------------------------------------------------------

    def _chat_body(self, req: SoakRequest, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": req.messages,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "n": req.n,
            "ignore_eos": True,
            "logprobs": req.logprobs,
        }
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        if req.adapter is not None:
            body["model"] = req.adapter  # vLLM's and SGLang's way to name an adapter on OpenAI routes
        return body

    async def _chat(self, req: SoakRequest, out: Outcome) -> None:
        plan = req.abort
        delay = plan.delay_fraction * self.pace.expected(req.max_tokens) if plan else None
        data = await self._post_until("/v1/chat/completions", self._chat_body(req, False), out, delay)
        if data is None:
            return
        for c in data["choices"]:
            ch = out.choices[c["index"]]
            ch.text = c["message"]["content"] or ""
            ch.finish = c["finish_reason"]
            if req.logprobs:
                ch.counted = len((c.get("logprobs") or {}).get("content") or [])
        out.usage_completion = (data.get("usage") or {}).get("completion_tokens")

    async def _chat_stream(self, req: SoakRequest, out: Outcome, t0: float) -> None:
        path, plan, chunks = "/v1/chat/completions", req.abort, 0
        done, aborting = False, None
        if req.logprobs:
            for ch in out.choices:
                ch.counted = 0
        async with self.session.post(self.base + path, json=self._chat_body(req, True), headers=self.headers) as resp:
            if not await self._status_ok(path, resp, out):
                return
            async for ev in _sse(resp):
                if ev is _DONE:
                    done = True
                    break
                if "error" in ev:
                    if aborting is not None and ev["error"].get("code") == "aborted":
                        out.choices[0].finish = "abort"  # our /abort_request ended the stream
                    else:
                        self.error_event(path, ev["error"], out)
                    continue
                for c in ev.get("choices") or []:
                    ch = out.choices[c["index"]]
                    content = (c.get("delta") or {}).get("content")
                    if content:
                        ch.text += content
                        chunks += 1
                        out.ttft = out.ttft or time.perf_counter() - t0
                    if req.logprobs and c.get("logprobs"):
                        ch.counted = (ch.counted or 0) + len(c["logprobs"].get("content") or [])
                    if c.get("finish_reason"):
                        ch.finish = c["finish_reason"]
                if ev.get("usage"):
                    out.usage_completion = ev["usage"].get("completion_tokens")
                if plan and not out.abort_sent and chunks >= plan.after_chunks:
                    out.abort_sent = True
                    if plan.mode == "disconnect":
                        out.disconnected = True
                        resp.close()
                        return
                    aborting = asyncio.create_task(self.abort_rids([f"{ev['id']}-{j}" for j in range(req.n)]))
        if aborting is not None:
            await aborting
        if not done:
            out.fail(f"{path} #{req.index}: the stream ended without data: [DONE]")

    # ---- /generate ----------------------------------------------------------------------------

    def _generate_body(self, req: SoakRequest, stream: bool) -> dict[str, Any]:
        sp = {"max_new_tokens": req.max_tokens, "temperature": req.temperature, "ignore_eos": True, "n": req.n}
        body = {
            "text": req.text,
            "sampling_params": sp,
            "rid": req.rid(self.run_id),
            "stream": stream,
            "return_logprob": req.logprobs,
        }
        return body | ({"lora_path": req.adapter} if req.adapter is not None else {})

    @staticmethod
    def _native_choice(ch: Choice, obj: dict[str, Any], logprobs: bool) -> None:
        meta = obj["meta_info"]
        ch.text, ch.token_ids = obj["text"], list(obj["output_ids"])
        ch.counted = len(ch.token_ids)
        ch.reported = meta.get("completion_tokens")
        ch.finish = (meta.get("finish_reason") or {}).get("type")
        if logprobs and ch.finish is not None and len(meta.get("output_token_logprobs") or []) != ch.counted:
            ch.finish = f"{ch.finish} (output_token_logprobs has {len(meta.get('output_token_logprobs') or [])})"

    async def _generate(self, req: SoakRequest, out: Outcome) -> None:
        plan, aborter = req.abort, None
        delay = plan.delay_fraction * self.pace.expected(req.max_tokens) if plan else None
        if plan and plan.mode == "abort_request":

            async def abort_later(wait: float) -> None:
                await asyncio.sleep(wait)
                out.abort_sent = True
                await self.abort_rids(self._rids(req))

            aborter, delay = asyncio.create_task(abort_later(delay)), None
        try:
            data = await self._post_until("/generate", self._generate_body(req, False), out, delay)
        finally:
            if aborter is not None:
                if not out.abort_sent:
                    aborter.cancel()
                await asyncio.gather(aborter, return_exceptions=True)
        if data is None:
            return
        for k, obj in enumerate(data if isinstance(data, list) else [data]):
            self._native_choice(out.choices[obj.get("index", k) or 0], obj, req.logprobs)

    async def _generate_stream(self, req: SoakRequest, out: Outcome, t0: float) -> None:
        path, plan, chunks, done, aborting = "/generate", req.abort, 0, False, None
        async with self.session.post(self.base + path, json=self._generate_body(req, True), headers=self.headers) as r:
            if not await self._status_ok(path, r, out):
                return
            async for ev in _sse(r):
                if ev is _DONE:
                    done = True
                    break
                if "error" in ev:
                    self.error_event(path, ev["error"], out)
                    continue
                ch = out.choices[ev.get("index") or 0]
                ids, text = list(ev["output_ids"]), ev["text"]
                prev_ids, prev_text = ch.token_ids or [], ch.text
                if ids[: len(prev_ids)] != prev_ids or not text.startswith(prev_text):
                    out.fail(f"{path} #{req.index}: a cumulative event does not extend the previous one")
                if len(ids) > len(prev_ids):
                    chunks += 1
                    out.ttft = out.ttft or time.perf_counter() - t0
                self._native_choice(ch, ev, req.logprobs)
                if plan and not out.abort_sent and chunks >= plan.after_chunks:
                    out.abort_sent = True
                    if plan.mode == "disconnect":
                        out.disconnected = True
                        r.close()
                        return
                    aborting = asyncio.create_task(self.abort_rids(self._rids(req)))
        if aborting is not None:
            await aborting
        if not done:
            out.fail(f"{path} #{req.index}: the stream ended without data: [DONE]")
