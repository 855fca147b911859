"""The router's shared state: the workers, the policy, one HTTP client session, the metrics,
and the background health checks.

One `aiohttp.ClientSession` serves every forwarded request (its connection pool keeps
keep-alive connections to the workers). Its timeout has no total (a long stream is normal) but
a connect timeout, so a dead host fails fast and the request can be retried elsewhere.
Health checks use their own short total timeout: a worker that does not answer /health within
it is taken out of routing until it answers 200 again, and, if it missed state-changing admin
calls meanwhile (or is a fresh process), until they are replayed on it (server/router/journal.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from server.router.journal import AdminJournal, Call
from server.router.metrics import RouterMetrics
from server.router.policy import Policy, Worker, make_policy

log = logging.getLogger(__name__)

PROXY_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=5.0, sock_connect=5.0)
FORWARDED = ("Authorization", "Content-Type", "Accept", "X-Request-Id")
INFO_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
ADMIN_TIMEOUT = aiohttp.ClientTimeout(total=120.0)  # a profile or a flight-recorder dump writes for seconds
# A state-changing call (journal.STATE_ROUTES) takes as long as it takes: a weight update waits for
# the running requests to end and then reads a checkpoint. Cut short, its outcome would be unknown
# (it may still land on the worker), so only a dead worker (no connection) ends it early.
STATE_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5.0)


@dataclass
class RouterConfig:
    worker_urls: list[str]
    policy: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_tree_size: int = 1 << 20
    health_check_interval: float = 1.0
    health_check_timeout: float = 2.0
    api_key: str | None = None
    enable_metrics: bool = True  # GET /metrics (the --dp-size front end serves its own instead)
    # Paths that also take the key as `?api_key=`: the --dp-size front end's dashboard (a browser
    # sets no header on a page load or a WebSocket handshake; server/dashboard.py).
    query_key_paths: tuple[str, ...] = ()


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.workers = [Worker(url.rstrip("/"), healthy=False) for url in config.worker_urls]
        self.policy: Policy = make_policy(
            config.policy,
            config.cache_threshold,
            config.balance_abs_threshold,
            config.balance_rel_threshold,
            config.max_tree_size,
        )
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self.extra_info: ExtraInfo | None = None  # more keys for GET /get_server_info
        self.journal = AdminJournal()
        self._restoring: dict[Worker, tuple[int, int]] = {}  # a fresh worker's partial restore: (seq, calls done)
        self._catching_up: dict[Worker, asyncio.Task] = {}
        self._health_task: asyncio.Task | None = None
        for w in self.workers:
            self.metrics.healthy.labels(w.url).set(0)
            self.metrics.inflight.labels(w.url).set(0)

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def forward_headers(self, request: web.Request) -> dict[str, str]:
        """The client's headers a worker needs; the router's own key when the client sent none."""
        headers = {k: request.headers[k] for k in FORWARDED if k in request.headers}
        if "Authorization" not in headers:
            headers.update(self.auth_headers())
        return headers

    def pick(self, text: str, exclude: Collection[str] = ()) -> Worker | None:
        candidates = [w for w in self.workers if w.url not in exclude]
        return self.policy.pick(candidates, text)

    def any_healthy(self) -> Worker | None:
        return next((w for w in self.workers if w.healthy), None)

    def begin(self, worker: Worker) -> None:
        worker.inflight += 1
        self.metrics.inflight.labels(worker.url).set(worker.inflight)

    def end(self, worker: Worker) -> None:
        worker.inflight -= 1
        self.metrics.inflight.labels(worker.url).set(worker.inflight)

    def set_health(self, worker: Worker, healthy: bool, why: str = "") -> None:
        if healthy != worker.healthy:
            level = logging.INFO if healthy else logging.WARNING  # coming (back) up is routine
            log.log(level, "worker %s is now %s%s", worker.url, "healthy" if healthy else "UNHEALTHY", why)
            if not healthy:
                self.policy.forget(worker)  # its cache may be gone when it comes back
        worker.healthy = healthy
        if worker in self.workers:  # not one replaced while its check was in flight
            self.metrics.healthy.labels(worker.url).set(1 if healthy else 0)

    def replace_worker(self, index: int, url: str) -> Worker:
        """Worker `index` now lives at `url` (a replica restarted elsewhere): it starts unhealthy,
        with nothing cached, until a health check passes and the journal's state is restored on
        it. Requests in flight at the old address keep their own `Worker` object and end as they
        would have."""
        old = self.workers[index]
        self._restoring.pop(old, None)
        self.policy.forget(old)
        for gauge in (self.metrics.healthy, self.metrics.inflight):
            with contextlib.suppress(KeyError):
                gauge.remove(old.url)
        new = self.workers[index] = Worker(url.rstrip("/"), healthy=False, synced=None)  # a fresh process
        self.metrics.healthy.labels(new.url).set(0)
        self.metrics.inflight.labels(new.url).set(0)
        log.warning("worker %d moved: %s -> %s", index, old.url, new.url)
        return new

    def behind(self, worker: Worker) -> bool:
        """It missed admin calls, is a fresh process, or was held out for another reason."""
        return worker.synced != self.journal.seq or bool(worker.sync_error)

    async def check(self, worker: Worker) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout)
        try:
            async with self.session.get(worker.url + "/health", headers=self.auth_headers(), timeout=timeout) as r:
                await r.read()
                status = r.status
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self.set_health(worker, False, f" ({type(e).__name__}: {e})")
            return
        if status == 200 and self.behind(worker):
            # In its own task: the health rounds go on while it waits for a broadcast in flight
            # (the journal's lock) or replays a weight update.
            if worker not in self._catching_up:
                task = self._catching_up[worker] = asyncio.create_task(self.catch_up(worker))
                task.add_done_callback(lambda _: self._catching_up.pop(worker, None))
        else:
            self.set_health(worker, status == 200, f" (/health answered {status})")

    async def catch_up(self, worker: Worker) -> None:
        """Replay on `worker` the admin calls it missed (a fresh one: the journal's net state),
        check it serves its siblings' weights, then route to it again; on a failure it stays out,
        and the next health round retries from where it stopped."""
        async with self.journal.lock:
            if worker not in self.workers or not self.behind(worker):
                return
            replay = self._restore if worker.synced is None else self._replay_missed
            error, replayed = await replay(worker)
            if error or (error := await self._version_error(worker)):
                return self._hold(worker, error)
            worker.sync_error = ""
            self.journal.trim([w.synced for w in self.workers])
        self.set_health(worker, True, f" ({replayed} admin call(s) replayed on it)" if replayed else "")

    async def _restore(self, worker: Worker) -> tuple[str, int]:
        """A fresh worker: the journal's net state, resumed where a failed attempt stopped unless
        calls came in since; then it is synced. -> (why it failed or '', calls replayed)."""
        calls = self.journal.restore()
        seq, done = self._restoring.pop(worker, (self.journal.seq, 0))
        done = done if seq == self.journal.seq else 0  # calls came in since: restore anew
        for k in range(done, len(calls)):
            if error := await self._replay(worker, calls[k]):
                self._restoring[worker] = (self.journal.seq, k)
                return error, k - done
        worker.synced = self.journal.seq
        return "", len(calls) - done

    async def _replay_missed(self, worker: Worker) -> tuple[str, int]:
        """The calls after `worker.synced`, in order, its position moving with each."""
        missed = self.journal.missed(worker.synced or 0)
        for n, (seq, call) in enumerate(missed):
            if error := await self._replay(worker, call):
                return error, n
            worker.synced = seq
        return "", len(missed)

    async def _replay(self, worker: Worker, call: Call) -> str:
        """'' when the worker took the call, else why not."""
        assert self.session is not None
        path, body = call
        try:
            async with self.session.post(
                worker.url + path, json=body, headers=self.auth_headers(), timeout=STATE_TIMEOUT
            ) as r:
                return "" if r.status == 200 else f"replaying {path} answered {r.status}: {(await r.text())[:300]}"
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            return f"replaying {path} failed: {type(e).__name__}: {e}"

    async def _version_error(self, worker: Worker) -> str:
        """'' unless `worker` serves another weight_version than a healthy sibling: weights a
        trainer sent past the router (`/update_weights_from_distributed` to each replica's own
        URL) are not in the journal, and a replica that did not get them must not serve."""
        sibling = next((w for w in self.workers if w is not worker and w.healthy), None)
        if sibling is None:
            return ""
        mine, theirs = await asyncio.gather(self._weight_version(worker), self._weight_version(sibling))
        if mine is None or theirs is None or mine == theirs:
            return ""
        return (
            f"it serves weight_version {mine!r} and {sibling.url} serves {theirs!r}: weights were sent past the "
            f"router (/update_weights_from_distributed to each worker's URL); send them to {worker.url} too"
        )

    async def _weight_version(self, worker: Worker) -> str | None:
        assert self.session is not None
        try:
            async with self.session.get(
                worker.url + "/get_model_info", headers=self.auth_headers(), timeout=INFO_TIMEOUT
            ) as r:
                info = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None
        version = info.get("weight_version") if isinstance(info, dict) else None
        return version if isinstance(version, str) else None

    def _hold(self, worker: Worker, error: str) -> None:
        if error != worker.sync_error:  # once per distinct reason, not every health round
            log.error("worker %s is held out of routing until its state matches the others: %s", worker.url, error)
        worker.sync_error = error
        self.set_health(worker, False, f" ({error})")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not end health checking for good
                log.exception("health check round failed")

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=PROXY_TIMEOUT)
        await self.check_all()  # route from the first request on, not after one interval
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self, app: web.Application) -> None:
        for task in [self._health_task, *self._catching_up.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.session is not None:
            await self.session.close()


ROUTER = web.AppKey("router", Router)
ExtraInfo = Callable[[Router], dict[str, Any]]

__all__ = [
    "ADMIN_TIMEOUT",
    "FORWARDED",
    "INFO_TIMEOUT",
    "PROXY_TIMEOUT",
    "ROUTER",
    "STATE_TIMEOUT",
    "ExtraInfo",
    "Router",
    "RouterConfig",
]
