"""The --dp-size front end: the standalone router's application (`server/router/`) over the
replicas, so both speak the same API and route the same way, plus what only a controller knows.

- Routing: `--load-balance-method` picks the router's policy; the router's health checks take a
  replica out while it is down and put it back once its /health answers. The supervisor also
  tells the router at once when a replica exits (no wait for a failed check) and where a restarted
  one now listens (it gets a fresh port, or under Ray maybe another node).
- State: a restarted replica starts from the command line's weights and adapters; before it is
  routed to, the router replays on it the net effect of the state-changing admin calls its
  siblings took since start-up (the last /update_weights_from_disk with its weight_version, the
  adapters loaded and unloaded, memory still released, a pause in force: server/router/journal.py).
  A replica that missed or failed one of those calls is held out until it is replayed on it.
- Auth: `--api-key` is checked by the front end and forwarded to the replicas, which were given
  the same key (their command line keeps it).
- GET /get_server_info: the router's aggregate plus `dp`: one entry per replica (index, url, pid,
  healthy, behind and why, restarts, its resources).
- GET /metrics: on unless --disable-metrics, as a single server (the flag reaches the replicas
  too): the router's metrics and every replica's, labelled by `dp_rank` (`server/dp/metrics.py`).
- GET /get_load: every replica's load entry, its `dp_rank` the replica's index (the router's).
- GET /openapi.json: a single server's document, built by the same code (`server/openapi.py`)
  from this app's routes, which are a single server's (the router's plus the two below).
- GET /dashboard, GET /dashboard/ws: a single server's page, fed by one replica's own feed
  (`?dp_rank=`, default 0), relayed, with links to every replica's (`server/dp/dashboard.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from server import openapi
from server.config import ServerConfig
from server.dashboard import DASHBOARD_PATH, FEED_PATH
from server.dp import dashboard
from server.dp.metrics import metrics_handler
from server.dp.replica import Replica
from server.dp.supervisor import Supervisor
from server.router.app import build_router_app
from server.router.state import ROUTER, Router, RouterConfig


def router_config(config: ServerConfig, urls: Sequence[str]) -> RouterConfig:
    return RouterConfig(
        worker_urls=list(urls),
        policy=config.load_balance_method,
        api_key=config.api_key,
        enable_metrics=False,  # the front end serves its own /metrics (the merged one), unless disabled
        query_key_paths=(DASHBOARD_PATH, FEED_PATH),  # a browser's `?api_key=`, as on a single server
    )


def dp_section(replicas: Sequence[Replica], router: Router, placement: str) -> dict[str, Any]:
    entries = []
    for replica, worker in zip(replicas, router.workers, strict=True):
        healthy = worker.healthy and worker.url == replica.url
        # behind: it has not (yet) taken every state-changing admin call its siblings took
        entries.append({**replica.describe(), "healthy": healthy, "behind": router.behind(worker)})
        if worker.sync_error:
            entries[-1]["sync_error"] = worker.sync_error
    return {"dp": {"size": len(replicas), "placement": placement, "replicas": entries}}


def build_frontend(config: ServerConfig, supervisor: Supervisor, placement: str) -> web.Application:
    """The router app over the supervisor's replicas (all started: their URLs are known)."""
    replicas = supervisor.replicas
    urls = [r.url for r in replicas]
    assert all(urls), "every replica must be started before the front end is built"
    app = build_router_app(
        router_config(config, [u for u in urls if u]),
        extra_info=lambda router: dp_section(replicas, router, placement),
    )
    if config.enable_metrics:
        app.router.add_get("/metrics", metrics_handler)
    router = app[ROUTER]
    dashboard.add_routes(app, lambda: dp_section(replicas, router, placement)["dp"], config.model_name)
    openapi.add_routes(app, secured=bool(config.api_key))  # last: built on startup from every route

    def on_down(replica: Replica, why: str) -> None:
        worker = router.workers[replica.index]
        worker.synced = None  # whatever comes back is a fresh process: the journal's state is restored on it
        router.set_health(worker, False, f" (replica {replica.index} {why})")

    async def on_up(replica: Replica) -> None:
        worker = router.workers[replica.index]
        if replica.url is not None and worker.url != replica.url:
            worker = router.replace_worker(replica.index, replica.url)
        if router.session is not None:
            await router.check(worker)  # restored and back in routing now, not at the next health round

    supervisor.on_down, supervisor.on_up = on_down, on_up
    return app


__all__ = ["build_frontend", "dp_section", "router_config"]
