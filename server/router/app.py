"""The router's aiohttp application: the generation routes proxied to one worker each, the
admin routes answered for all of them.

Proxying: the body goes to the chosen worker unchanged and the answer comes back as it is (the
worker's status, a 400 included). An SSE answer is relayed chunk by chunk as it arrives. A
failure before anything reached the client (the connection refused or reset, or a worker's 503,
e.g. one that is draining) is retried once on another healthy worker: the client never saw the
first try. Once a stream has started the status line is spent, so a worker lost in mid-stream
ends the client's stream with an error event in OpenAI's shape, then `[DONE]`: never a hang,
never a stream that just stops. Run it with `handler_cancellation=True`: a client that goes
away cancels its handler, which closes the upstream connection, so the worker aborts too.

Routes: every route a single server has, but /dashboard (and its feed) and /openapi.json, which
need the engine's modules: the --dp-size front end adds those (server/dp/frontend.py). Proxied to
one worker: generations, embeddings, tokenizer; sent to every worker: /flush_cache,
/abort_request, the profiler and the flight recorder; aggregated: /health, /get_server_info,
/get_load, /metrics. Anything else is a 404 (405 for a wrong method) naming the route.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from server.router.broadcast import broadcaster
from server.router.errors import RouterError, no_healthy_worker
from server.router.policy import Worker, routing_text
from server.router.state import ADMIN_TIMEOUT, INFO_TIMEOUT, ROUTER, ExtraInfo, Router, RouterConfig
from server.router.ws_relay import ws_handler

log = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize")
EMBEDDING_ROUTES = ("/v1/embeddings", "/encode")  # routed like a generation (on "": the least loaded)
# to every worker, as SGLang's DP (a weight update and a pause hold for the whole engine)
ADMIN_ROUTES = (
    "/start_profile",
    "/stop_profile",
    "/dump_flight_recorder",
    "/update_weights_from_disk",
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/load_lora_adapter",
    "/unload_lora_adapter",
)
# A trainer's weight-update group names each engine rank by its own rank offset: the trainer
# addresses each replica itself (a front end sending one body to all would give every replica
# the same ranks).
PER_WORKER_ROUTES = ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group")


async def per_worker_only(request: web.Request) -> web.Response:
    raise RouterError(
        400, f"{request.path} names one engine's ranks: send it to each replica's own URL", code="per_replica_route"
    )


_OPEN_PATHS = ("/health", "/metrics", "/openapi.json")  # probes, scrapers and client generators need no key
_DONE = b"data: [DONE]"
WORKER_HEADER = "X-Router-Worker"  # which worker answered: for operators and tests
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Retry(Exception):
    """This worker failed before the client saw a byte: try another one."""


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RouterError as e:
        request.app[ROUTER].metrics.errors.labels(str(e.code)).inc()
        return e.response()
    except web.HTTPNotFound:
        return RouterError(404, f"no route {request.method} {request.path} on the router").response()
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        message = f"{request.method} is not allowed on {request.path} (allowed: {allowed})"
        return RouterError(405, message, code="method_not_allowed").response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return RouterError(e.status, e.text or e.reason).response()
    except ConnectionResetError:
        raise  # the client is gone: nobody to answer
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        request.app[ROUTER].metrics.errors.labels("internal").inc()
        return RouterError(500, f"internal router error: {type(e).__name__}: {e}").response()


def _api_key_middleware(key: str, query_key_paths: tuple[str, ...]):
    expected = f"Bearer {key}".encode()

    def query_key_ok(request: web.Request) -> bool:  # the dashboard's `?api_key=` (server/dashboard.py)
        given = request.query.get("api_key", "") if request.path in query_key_paths else ""
        return hmac.compare_digest(given.encode(), key.encode())

    @web.middleware
    async def api_key_middleware(request: web.Request, handler) -> web.StreamResponse:
        if not request.path.startswith(_OPEN_PATHS):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected) and not query_key_ok(request):
                raise RouterError(
                    401, "missing or invalid API key (send 'Authorization: Bearer <key>')", "invalid_api_key"
                )
        return await handler(request)

    return api_key_middleware


async def _relay_stream(request: web.Request, upstream: aiohttp.ClientResponse, worker: Worker) -> web.StreamResponse:
    """Pass the worker's SSE through as it arrives; end it with an error event if the worker
    is lost before its `[DONE]`."""
    resp = web.StreamResponse(status=upstream.status, headers={**_SSE_HEADERS, WORKER_HEADER: worker.url})
    await resp.prepare(request)
    tail, failure = b"", ""
    while True:
        try:
            chunk = await upstream.content.readany()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            failure = f"{type(e).__name__}: {e}"
            break
        if not chunk:
            break
        await resp.write(chunk)  # ConnectionResetError: the client left; the caller closes upstream
        tail = (tail + chunk)[-64:]
    if failure or not tail.rstrip().endswith(_DONE):
        log.warning("worker %s lost in mid-stream: %s", worker.url, failure or "the stream ended without [DONE]")
        request.app[ROUTER].metrics.errors.labels("worker_lost_mid_stream").inc()
        err = RouterError(502, f"the worker {worker.url} failed in mid-stream", code="worker_failed")
        with contextlib.suppress(ConnectionResetError):
            await resp.write(err.sse_event() + _DONE + b"\n\n")
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


async def _forward(request: web.Request, router: Router, worker: Worker, body: bytes) -> web.StreamResponse:
    """One try at one worker; raises _Retry when nothing reached the client yet."""
    assert router.session is not None
    url = worker.url + request.path_qs
    try:
        upstream = await router.session.post(url, data=body, headers=router.forward_headers(request))
    except aiohttp.ClientConnectorError as e:  # refused, unreachable: it is down
        router.set_health(worker, False, f" ({e})")
        raise _Retry(str(e)) from e
    except (TimeoutError, aiohttp.ClientConnectionError, OSError) as e:  # reset before the headers
        raise _Retry(f"{type(e).__name__}: {e}") from e
    finished = False
    try:
        ctype = upstream.headers.get("Content-Type", "application/json")
        if upstream.status == 200 and ctype.startswith("text/event-stream"):
            resp = await _relay_stream(request, upstream, worker)
            finished = True
            return resp
        try:
            data = await upstream.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise _Retry(f"{type(e).__name__}: {e}") from e
        finished = True
        if upstream.status == 503:  # draining or full: another worker may take it
            raise _Retry(f"503: {data[:200]!r}")
        return web.Response(
            body=data, status=upstream.status, headers={"Content-Type": ctype, WORKER_HEADER: worker.url}
        )
    finally:
        if finished:
            upstream.release()
        else:  # the client left or the read failed: drop the connection so the worker aborts
            upstream.close()


async def proxy(request: web.Request) -> web.StreamResponse:
    """A generation request, routed by its text; retried once elsewhere on an early failure."""
    router = request.app[ROUTER]
    body = await request.read()
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = None  # the worker answers the 400
    text = routing_text(request.path, parsed)
    tried: set[str] = set()
    last_failure = ""
    for attempt in range(2):
        worker = router.pick(text, tried)
        if worker is None:
            break
        if attempt:
            router.metrics.retries.labels(worker.url).inc()
        router.metrics.requests.labels(worker.url, request.path).inc()
        router.begin(worker)
        try:
            return await _forward(request, router, worker, body)
        except _Retry as e:
            log.warning("worker %s failed before answering (%s)%s", worker.url, e, "" if attempt else "; retrying")
            tried.add(worker.url)
            last_failure = f"{worker.url}: {e}"
        finally:
            router.end(worker)
    if len(tried) < 2:  # no worker (left) to try: the only one(s) failed or none is healthy
        err = no_healthy_worker()
        if last_failure:
            err.message += f" (last failure: {last_failure})"
        raise err
    raise RouterError(502, f"the worker failed before answering ({last_failure})", code="worker_failed")


async def health(request: web.Request) -> web.Response:
    """200 while any worker is healthy ("degraded" when some are not), else 503."""
    router = request.app[ROUTER]
    if router.any_healthy() is None:
        return no_healthy_worker().response()
    healthy, total = sum(w.healthy for w in router.workers), len(router.workers)
    status = "ok" if healthy == total else "degraded"
    return web.json_response({"status": status, "healthy_workers": healthy, "workers": total})


async def first_healthy(request: web.Request) -> web.Response:
    """GET the same path from the first healthy worker that answers (/v1/models, /get_model_info,
    /tokenizer_info, /version, /health_generate: every replica serves the same model, and one
    that generates is enough)."""
    router = request.app[ROUTER]
    assert router.session is not None
    for worker in [w for w in router.workers if w.healthy]:
        try:
            async with router.session.get(
                worker.url + request.path, headers=router.forward_headers(request), timeout=INFO_TIMEOUT
            ) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except (TimeoutError, aiohttp.ClientError, OSError):
            continue
    raise no_healthy_worker()


async def _worker_info(router: Router, worker: Worker, headers: dict[str, str]) -> dict[str, Any] | None:
    assert router.session is not None
    try:
        async with router.session.get(worker.url + "/get_server_info", headers=headers, timeout=INFO_TIMEOUT) as r:
            return await r.json() if r.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None


def aggregate(workers: list[Worker], infos: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Per worker its URL, health, in-flight count and own info; summed counters; the cache hit
    rate weighted by `prompt_tokens` when the workers report it, else their plain mean. Also a
    single server's keys: `version` (the first worker's) and `internal_states`, one entry per
    worker's engine with `dp_rank` its index (SGLang's data-parallel /get_server_info)."""
    totals = {"running_requests": 0, "waiting_requests": 0, "generated_tokens": 0}
    rates: list[tuple[float, float | None]] = []
    states: list[dict[str, Any]] = []
    for rank, info in enumerate(infos):
        for st in (info or {}).get("internal_states") or []:
            states.append({**st, "dp_rank": rank})
            for key in totals:
                totals[key] += int(st.get(key) or 0)
            if isinstance(st.get("cache_hit_rate"), (int, float)):
                weight = st.get("prompt_tokens")
                rates.append((float(st["cache_hit_rate"]), float(weight) if isinstance(weight, (int, float)) else None))
    hit_rate = None
    if rates:
        if all(w is not None for _, w in rates) and sum(w for _, w in rates if w is not None) > 0:
            hit_rate = sum(r * (w or 0.0) for r, w in rates) / sum(w or 0.0 for _, w in rates)
        else:
            hit_rate = sum(r for r, _ in rates) / len(rates)
    version = next((info["version"] for info in infos if info and isinstance(info.get("version"), str)), None)
    return {
        "version": version,
        "workers": [
            {"url": w.url, "healthy": w.healthy, "inflight": w.inflight, "server_info": info}
            | ({"sync_error": w.sync_error} if w.sync_error else {})  # held out: why (server/router/journal.py)
            for w, info in zip(workers, infos, strict=True)
        ],
        **totals,
        "cache_hit_rate": hit_rate,
        "internal_states": states,
    }


async def server_info(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    headers = router.forward_headers(request)
    infos = await asyncio.gather(*(_worker_info(router, w, headers) for w in router.workers))
    info = aggregate(router.workers, list(infos))
    info["load_balance_method"] = router.policy.name
    if router.extra_info is not None:
        info.update(router.extra_info(router))
    return web.json_response(info)


async def _worker_load(router: Router, worker: Worker, headers: dict[str, str]) -> list[Any]:
    assert router.session is not None
    if not worker.healthy:
        return []
    try:
        async with router.session.get(worker.url + "/get_load", headers=headers, timeout=INFO_TIMEOUT) as r:
            body = await r.json() if r.status == 200 else []
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return []
    return [e for e in body if isinstance(e, dict)] if isinstance(body, list) else []


async def get_load(request: web.Request) -> web.Response:
    """SGLang's GET /get_load over the workers: each one's entries, `dp_rank` renumbered to the
    worker's index (each engine calls itself rank 0); a worker that is down or does not answer
    is left out, so a balancer reading this sees only ranks it can route to."""
    router = request.app[ROUTER]
    headers = router.forward_headers(request)
    loads = await asyncio.gather(*(_worker_load(router, w, headers) for w in router.workers))
    out = [{**entry, "dp_rank": index} for index, entries in enumerate(loads) for entry in entries]
    return web.json_response(out)


async def metrics(request: web.Request) -> web.Response:
    return request.app[ROUTER].metrics.render()


def build_router_app(config: RouterConfig, extra_info: ExtraInfo | None = None) -> web.Application:
    """The router's application; its startup checks the workers once and starts the health loop.

    `extra_info(router)` adds keys to GET /get_server_info (the --dp-size front end's `dp` section).
    """
    middlewares = [errors_middleware]
    if config.api_key:
        middlewares.append(_api_key_middleware(config.api_key, config.query_key_paths))
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    router = app[ROUTER] = Router(config)
    router.extra_info = extra_info
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    for path in GENERATION_ROUTES:
        app.router.add_post(path, proxy)
    app.router.add_get("/health", health)
    app.router.add_get("/ws", ws_handler)
    for path in ("/v1/models", "/get_model_info", "/model_info", "/health_generate", "/tokenizer_info", "/version"):
        app.router.add_get(path, first_healthy)
    for path in TOKENIZER_ROUTES:  # any worker tokenizes alike; proxied for its retry on a failed worker
        app.router.add_post(path, proxy)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/get_server_info", server_info)
    for path in EMBEDDING_ROUTES:
        app.router.add_post(path, proxy)
    app.router.add_get("/server_info", server_info)  # SGLang's alias, as a single server
    broadcast, admin_broadcast = broadcaster(INFO_TIMEOUT), broadcaster(ADMIN_TIMEOUT)
    for path in ("/flush_cache", "/abort_request"):
        app.router.add_post(path, broadcast)
    app.router.add_get("/flush_cache", broadcast)  # a single server takes both; the workers get a POST
    for path in ADMIN_ROUTES:
        app.router.add_post(path, admin_broadcast)
    for path in PER_WORKER_ROUTES:
        app.router.add_post(path, per_worker_only)
    if config.enable_metrics:
        app.router.add_get("/metrics", metrics)
    return app


__all__ = [
    "ADMIN_ROUTES",
    "EMBEDDING_ROUTES",
    "GENERATION_ROUTES",
    "TOKENIZER_ROUTES",
    "WORKER_HEADER",
    "aggregate",
    "build_router_app",
    "proxy",
]
