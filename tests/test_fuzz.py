"""Fuzzing the live server: schemathesis against /openapi.json, hypothesis against /ws.

Every operation of the served OpenAPI document gets a bounded number of schemathesis cases,
schema-valid ones (positive) and, for operations with a body, invalid ones (negative). Each answer
must be: never a 5xx; every 4xx OpenAI's error body `{"error": {"message", "type", "param",
"code"}}`; a documented status and content type; a 2xx body that fits its documented schema; an
SSE stream of JSON events ending in [DONE] whose error events have the error body. The WebSocket
gets random text and binary frames (bytes, JSON values, messages resembling generate/cancel with
fuzzed fields, deep nesting) on one socket; after each one the socket must still be open and serve
a generation to its finish_reason. Raw bodies that schemathesis never sends (tests/fuzz_inputs.py)
go to every POST route. Every request must be answered within ANSWER_WITHIN seconds, and the
server's log must show no traceback.

Failures are collected, not raised at the first one, so that one run reports every distinct
problem with a reproduction (hypothesis's shrinking is off: the run stays bounded). Examples are
derandomized: the same cases every run. The server's context is small (CONTEXT) so that every
generation a fuzzed request asks for, whatever its max_tokens, stays short.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server.openapi import build_openapi
from tests.fuzz_inputs import PROBE, error_problem, raw_requests, response_problem, ws_frames, ws_message_problem
from tests.server_helpers import TINY_ARGS, ServerProcess, shared_server, tiny_model_dir, wait_clean  # noqa: F401

# Hypothesis caches what it learns from the source under .hypothesis/ in the working directory.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "asyncllm-hypothesis"))
pytestmark = pytest.mark.timeout(300)
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}  # pass copies: schemathesis adds its headers to the dict it gets
CONTEXT = 128
BODY_OPS = ["POST /v1/completions", "POST /v1/chat/completions", "POST /generate", "POST /abort_request"]
BODY_OPS += ["POST /start_profile"]
BODY_OPS += ["POST /tokenize", "POST /v1/tokenize", "POST /detokenize", "POST /v1/detokenize"]
BODY_OPS += ["POST /v1/embeddings", "POST /encode"]
BODY_OPS += ["POST /update_weights_from_disk"]  # any path fuzzing names is not a checkpoint: a 400
BODY_OPS += ["POST /load_lora_adapter", "POST /unload_lora_adapter"]  # LoRA is off there: a 400
# A pause holds for every later case of the shared server, so these are in the document's checks
# but not fuzzed; their inputs are checked in tests/test_server_rollout.py.
PAUSE_OPS = ["POST /pause_generation", "POST /continue_generation"]
PAUSE_OPS += ["POST /release_memory_occupation", "POST /resume_memory_occupation"]
# joining a group waits for a trainer that fuzzing never starts (the rendezvous timeout)
PAUSE_OPS += ["POST /init_weights_update_group", "POST /update_weights_from_distributed"]
PAUSE_OPS += ["POST /destroy_weights_update_group"]
OPEN_OPS = ["GET /health", "GET /health_generate", "GET /metrics", "GET /openapi.json"]
OPS = BODY_OPS + OPEN_OPS
OPS += ["GET /v1/models", "GET /get_model_info", "GET /model_info", "GET /get_server_info", "GET /server_info"]
OPS += ["POST /flush_cache", "GET /flush_cache", "GET /ws", "POST /stop_profile", "POST /dump_flight_recorder"]
OPS += ["GET /dashboard", "GET /dashboard/ws"]
OPS += ["GET /tokenizer_info", "GET /version", "GET /get_load"]
OPS += PAUSE_OPS
EXAMPLES = {schemathesis.GenerationMode.POSITIVE: 30, schemathesis.GenerationMode.NEGATIVE: 30}
BODYLESS_EXAMPLES = 3  # a GET without parameters has one case; hypothesis would repeat it
RAW_EXAMPLES = 40
# Every fuzzed request is short (small context, few tokens): one not answered by then hangs.
ANSWER_WITHIN = 20
WS_EXAMPLES = 150
LOG_MARKERS = ("Traceback", "unhandled error", "error in mid-stream", "internal error")  # a logged 500


def fuzz_settings(max_examples: int) -> settings:
    """Bounded and reproducible: no deadline (generations take time), derandomized, no example
    database (nothing written to the tree), no shrinking (failures are collected, not raised)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


@pytest.fixture
def server(request, tiny_model_dir) -> ServerProcess:
    profiles = request.config._tmp_path_factory.mktemp("fuzz-profiles")  # type: ignore[attr-defined]
    args = (*TINY_ARGS, "--enable-metrics", "--api-key", KEY, "--context-length", str(CONTEXT))
    args += ("--profile-dir", str(profiles), "--flight-recorder-dir", str(profiles / "flight"))
    return shared_server(request, "tiny-fuzz", tiny_model_dir, *args)


_schemas: dict[str, Any] = {}


@pytest.fixture
def schema(server):
    """The live document, loaded by schemathesis once."""
    if server.url not in _schemas:
        _schemas[server.url] = schemathesis.openapi.from_url(server.url + "/openapi.json", timeout=30)
    return _schemas[server.url]


# ---- what every answer must look like -----------------------------------------------------------


def _content_type(response: schemathesis.Response) -> str | None:
    for name, values in response.headers.items():
        if name.lower() == "content-type":
            return values[0]
    return None


def openai_answer(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """No 5xx; a 4xx carries the error body as JSON; a stream is JSON events ending in [DONE]
    (unless schemathesis stopped reading it: it reads a bounded number of events)."""
    complete = not response.stream_cut_short
    problem = response_problem(response.status_code, _content_type(response), response.content, complete)
    assert problem is None, problem


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    openai_answer,
]


class Findings:
    """Distinct failures (by check and status) with one reproduction each, and the log to scan."""

    def __init__(self, server: ServerProcess) -> None:
        self.found: dict[str, str] = {}
        self.log: Path = server.log_path
        self.log_start = self.log.stat().st_size

    def add(self, key: str, repro: str) -> None:
        self.found.setdefault(key, repro[:1500])

    def assert_none(self) -> None:
        log = self.log.read_bytes()[self.log_start :].decode(errors="replace")
        hits = [at for m in LOG_MARKERS if (at := log.find(m)) >= 0]
        if hits:
            self.add("server log: an error was logged", log[max(0, min(hits) - 300) : min(hits) + 1500])
        report = "\n\n".join(f"## {k}\n{v}" for k, v in self.found.items())
        assert not self.found, f"{len(self.found)} distinct failures:\n{report}"


# ---- the document ---------------------------------------------------------------------------------


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [r for k, v in node.items() for r in ([v] if k == "$ref" else _refs(v))]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []


def test_document_offline():
    """Every $ref resolves; without a key there is no security; with one, open ops opt out."""
    routes = [tuple(op.split(" ")) for op in OPS] + [("HEAD", "/health")]
    plain = build_openapi(routes, secured=False)
    assert plain["openapi"].startswith("3.1") and "security" not in plain
    names = plain["components"]["schemas"]
    for ref in _refs(plain):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in names, ref
    assert "head" not in plain["paths"]["/health"]
    secured = build_openapi(routes, secured=True)
    assert secured["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    for op in OPS:
        method, path = op.split(" ")
        doc = secured["paths"][path][method.lower()]
        assert (doc.get("security") == []) == (op in OPEN_OPS), op
        assert ("401" in doc["responses"]) == (op not in OPEN_OPS), op


def test_document_live(server):
    """The served document lists exactly the server's routes, and its security is what the server
    enforces: an open operation answers without the key, every other one is a 401 with the body."""
    doc = requests.get(server.url + "/openapi.json", timeout=30).json()
    ops = {f"{m.upper()} {p}": o for p, item in doc["paths"].items() for m, o in item.items()}
    assert sorted(ops) == sorted(OPS)
    assert not [k for k, o in ops.items() if o.get("x-undocumented")]
    for op, spec in ops.items():
        method, path = op.split(" ")
        r = requests.request(method, server.url + path, json={} if method == "POST" else None, timeout=60)
        if spec.get("security") == []:
            assert r.status_code != 401, op
        else:
            assert r.status_code == 401 and error_problem(r.json()) is None, (op, r.status_code, r.text)


# ---- schemathesis over every operation -------------------------------------------------------------


def _params() -> list[Any]:
    out = []
    for op in (op for op in OPS if op not in PAUSE_OPS):
        modes = [schemathesis.GenerationMode.POSITIVE]
        if op in BODY_OPS:
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        out += [pytest.param(op, mode, id=f"{op}-{mode.value}") for mode in modes]
    return out


@pytest.mark.parametrize(("op", "mode"), _params())
def test_fuzz_operation(server, schema, op: str, mode: schemathesis.GenerationMode):
    """Schemathesis cases for one operation of the live document, every answer checked (CHECKS)."""
    method, path = op.split(" ")
    findings = Findings(server)
    session = requests.Session()

    @fuzz_settings(EXAMPLES[mode] if op in BODY_OPS else BODYLESS_EXAMPLES)
    @given(case=schema[path][method].as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        try:
            response = case.call(base_url=server.url, session=session, headers=dict(AUTH), timeout=ANSWER_WITHIN)
        except requests.RequestException as e:
            findings.add(f"{op} {mode.value}: {type(e).__name__}", f"{e}\n{case.as_curl_command(headers=dict(AUTH))}")
            return
        try:
            case.validate_response(response, checks=CHECKS, headers=dict(AUTH))
        except FailureGroup as group:
            for f in group.exceptions:
                key = f"{op} {mode.value}: {f.title} (status {response.status_code})"
                body = response.content[:500].decode(errors="replace")
                findings.add(key, f"{f.message}\n{case.as_curl_command(headers=dict(AUTH))}\n-> {body}")

    run()
    findings.assert_none()


# ---- raw HTTP bodies ----------------------------------------------------------------------------------

RAW_PATHS = ["/v1/completions", "/v1/chat/completions", "/generate", "/abort_request", "/flush_cache"]
RAW_PATHS += ["/tokenize", "/detokenize", "/v1/embeddings", "/encode"]


@pytest.mark.parametrize("path", RAW_PATHS)
def test_fuzz_raw_body(server, path: str):
    """Bodies schemathesis never sends (bad UTF-8, deep nesting, truncation, NaN, bytes, a wrong
    Content-Type or Content-Encoding): each is answered, never with a 5xx, errors with the body."""
    findings = Findings(server)
    session = requests.Session()
    previous = ["(none)"]  # the request before, on the same keep-alive connection

    @fuzz_settings(RAW_EXAMPLES)
    @given(request=raw_requests(path))
    def run(request: tuple[bytes, dict[str, str]]) -> None:
        body, headers = request
        what = f"POST {path} headers={headers} body={body[:300]!r}"
        before, previous[0] = previous[0], what
        try:
            r = session.post(server.url + path, data=body, headers={**AUTH, **headers}, timeout=ANSWER_WITHIN)
        except requests.RequestException as e:
            findings.add(f"POST {path}: {type(e).__name__}", f"{e}\n{what}\nafter {before}")
            session.close()
            return
        problem = response_problem(r.status_code, r.headers.get("Content-Type"), r.content)
        if problem is not None:
            findings.add(f"POST {path}: {problem[:60]}", f"{problem}\n{what}")

    run()
    findings.assert_none()


# ---- WebSocket frames ----------------------------------------------------------------------------------


class WsFuzzer:
    """One socket for every frame; the generations each accepted frame starts are tracked until
    their last delta, and a probe generation after every frame shows the socket still serves."""

    def __init__(self, url: str, findings: Findings) -> None:
        self.url, self.findings = url, findings
        self.loop = asyncio.new_event_loop()
        self.session: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.running: set[str] = set()  # (id, index) of fuzzed generations still streaming
        self.probes = 0

    async def connect(self) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self.ws = await self.session.ws_connect(self.url + "/ws", headers=dict(AUTH), max_msg_size=0)
        self.running.clear()

    def _track(self, msg: dict) -> None:
        if msg.get("type") == "delta":
            key = json.dumps([msg.get("id"), msg.get("index")])
            if msg.get("finish_reason") is None:
                self.running.add(key)
            else:
                self.running.discard(key)

    async def receive(self, timeout: float = 60) -> dict | None:
        """The next server message (checked), or None after recording why the socket failed."""
        msg = await self.ws.receive(timeout=timeout)
        if msg.type != aiohttp.WSMsgType.TEXT:
            self.findings.add(f"ws: socket ended ({msg.type.name})", f"{msg.data!r} {msg.extra!r}")
            return None
        try:
            data = json.loads(msg.data)
        except ValueError:
            self.findings.add("ws: a message that is not JSON", repr(msg.data[:300]))
            return {}
        problem = ws_message_problem(data)
        if problem is not None:
            self.findings.add(f"ws: bad message: {problem[:80]}", problem)
        self._track(data)
        return data

    async def exchange(self, kind: str, payload: str | bytes) -> None:
        what = f"{kind} frame {payload[:300]!r}"
        if self.ws is None or self.ws.closed:
            await self.connect()
        await (self.ws.send_str(payload) if kind == "text" else self.ws.send_bytes(payload))
        self.probes += 1
        pid = f"{PROBE}-{self.probes}"
        probe = {"type": "generate", "id": pid, "text": "Hello", "sampling_params": {"max_new_tokens": 2}}
        await self.ws.send_str(json.dumps(probe))
        while True:
            msg = await self.receive()
            if msg is None:
                self.findings.add(f"ws: the socket closed after a {kind} frame", what)
                return
            if msg.get("id") == pid:
                if msg["type"] == "error":
                    self.findings.add("ws: the probe failed", f"{what}\n-> {msg}")
                    return
                if msg.get("finish_reason") is not None:
                    return

    async def exchange_bounded(self, kind: str, payload: str | bytes) -> None:
        """`exchange`, but a frame left unanswered is a finding (and a fresh socket), not a hang."""
        try:
            async with asyncio.timeout(120):
                await self.exchange(kind, payload)
        except TimeoutError:
            self.findings.add("ws: no answer within 120 s", f"{kind} frame {payload[:300]!r}")
            if self.ws is not None:
                await self.ws.close()
        except aiohttp.WSServerHandshakeError as e:
            log = self.findings.log.read_bytes()[-1200:].decode(errors="replace")
            self.findings.add(f"ws: handshake refused ({e.status})", f"{e!r} before a {kind} frame\n{log}")

    async def settle(self) -> None:
        """Every fuzzed generation still running ends with its finish_reason."""
        try:
            async with asyncio.timeout(90):
                while self.running and await self.receive() is not None:
                    pass
        except TimeoutError:
            self.findings.add("ws: generations never finished", str(sorted(self.running)))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        async def _close() -> None:
            if self.ws is not None:
                await self.ws.close()
            if self.session is not None:
                await self.session.close()

        self.run(_close())
        self.loop.close()


def test_fuzz_websocket(server):
    findings = Findings(server)
    fuzzer = WsFuzzer(server.url, findings)
    try:

        @fuzz_settings(WS_EXAMPLES)
        @given(frame=ws_frames)
        def run(frame: tuple[str, str | bytes]) -> None:
            fuzzer.run(fuzzer.exchange_bounded(*frame))

        run()
        fuzzer.run(fuzzer.settle())
    finally:
        fuzzer.close()
    findings.assert_none()


async def test_clean_after_fuzzing(server):
    """Whatever the fuzzers sent, the server ends idle with every KV slot free or cached."""
    async with aiohttp.ClientSession() as s:
        await wait_clean(s, server.url, headers=dict(AUTH))
