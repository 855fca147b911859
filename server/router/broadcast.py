"""Admin calls sent to every worker: the same body POSTed to each healthy one.

/flush_cache; /abort_request (only the worker that holds a rid has it); the profiler and flight
recorder endpoints (each worker writes its own file); and the calls that change what a worker
serves (weights, adapters, pause, memory: `journal.STATE_ROUTES`), which hold for the whole
engine as in SGLang's data parallelism. Those are sent one at a time under the journal's lock and
recorded when any worker took them; a worker that did not take one (it failed it, or it was
unhealthy and skipped) is behind and held out of routing until the call is replayed on it
(server/router/state.py, `catch_up`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from server.router.errors import no_healthy_worker
from server.router.journal import STATE_ROUTES, parse_body
from server.router.policy import Worker
from server.router.state import ROUTER, STATE_TIMEOUT, Router

SKIPPED = "unhealthy: skipped"


def broadcaster(timeout: aiohttp.ClientTimeout):
    """A handler that POSTs the request's body to every healthy worker; success only if all of
    them succeeded. The answer holds the first worker's own keys (so it has a single server's
    shape: `trace`, `path`, `weight_version`, ...), `success` for them all and `workers`, each
    worker's status and body."""

    async def broadcast(request: web.Request) -> web.Response:
        router = request.app[ROUTER]
        body = await request.read()
        if request.path not in STATE_ROUTES:
            return answer(router, await send(router, request, body, timeout))
        async with router.journal.lock:
            results = await send(router, request, body, STATE_TIMEOUT)
            record(router, request.path, body, results)
            return answer(router, results)

    return broadcast


async def send(
    router: Router, request: web.Request, body: bytes, timeout: aiohttp.ClientTimeout
) -> list[dict[str, Any]]:
    assert router.session is not None
    session, headers = router.session, router.forward_headers(request)

    async def one(worker: Worker) -> dict[str, Any]:
        if not worker.healthy:
            return {"url": worker.url, "status": None, "success": False, "message": SKIPPED}
        try:
            async with session.post(worker.url + request.path, data=body, headers=headers, timeout=timeout) as r:
                return {"url": worker.url, "status": r.status, "success": r.status == 200, "body": await r.text()}
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return {"url": worker.url, "status": None, "success": False, "message": f"{type(e).__name__}: {e}"}

    return list(await asyncio.gather(*(one(w) for w in router.workers)))


def record(router: Router, path: str, body: bytes, results: list[dict[str, Any]]) -> None:
    """Journal a state-changing call that some worker took; hold out the ones that did not."""
    took = [r["success"] for r in results]
    if not any(took):
        return  # nothing changed anywhere (a bad path, a name in use): nothing to replay
    first = _json_or_none(next(r["body"] for r in results if r["success"]))
    before = router.journal.seq
    seq = router.journal.record(path, parse_body(body), first if isinstance(first, dict) else {})
    for worker, ok, result in zip(router.workers, took, results, strict=True):
        if worker.synced != before:
            continue  # behind already: it catches up through the journal
        if ok:
            worker.synced = seq
        elif result.get("message") != SKIPPED:  # one skipped is behind as it is: it catches up when back
            why = result.get("message") or f"answered {result['status']}: {str(result.get('body'))[:300]}"
            worker.sync_error = f"{path} failed on it ({why})"
            router.set_health(worker, False, f" ({worker.sync_error}; held out until it is replayed)")
    router.journal.trim([w.synced for w in router.workers])


def answer(router: Router, results: list[dict[str, Any]]) -> web.Response:
    answered = [r for r in results if r["status"] is not None]
    if not answered and not any(w.healthy for w in router.workers):
        raise no_healthy_worker()
    ok = any(r["success"] for r in results) and all(r["success"] or r["status"] is None for r in results)
    if not ok and answered and all(r["status"] == 400 for r in answered):  # e.g. no profile running
        return web.Response(body=answered[0]["body"], status=400, content_type="application/json")
    first: Any = next((_json_or_none(r["body"]) for r in results if r["success"]), None)
    first = first if isinstance(first, dict) else {}
    return web.json_response({**first, "success": ok, "workers": results}, status=200 if ok else 502)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


__all__ = ["broadcaster"]
