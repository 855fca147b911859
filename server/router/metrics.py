"""The router's own Prometheus metrics, on its own registry (the workers keep theirs), named
after SGLang's router (`sgl_router_*`): routed requests per worker, worker health, in-flight
requests, retries, and errors by kind."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter(
            "sgl_router_requests", "Requests the router sent to each worker", ["worker", "route"], registry=reg
        )
        self.healthy = Gauge(
            "sgl_router_worker_healthy", "1 when the worker passes health checks", ["worker"], registry=reg
        )
        self.inflight = Gauge(
            "sgl_router_worker_inflight", "Requests in flight at each worker", ["worker"], registry=reg
        )
        self.retries = Counter("sgl_router_retries", "Requests retried on another worker", ["worker"], registry=reg)
        self.errors = Counter("sgl_router_errors", "Requests that failed in the router", ["kind"], registry=reg)

    def render(self) -> web.Response:
        resp = web.Response(body=generate_latest(self.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp


__all__ = ["RouterMetrics"]
