"""GET /metrics of the --dp-size front end (on unless --disable-metrics, as a single server).

One scrape target for the whole deployment: the router's own `sgl_router_*` metrics, then every
replica's `sglang:*` metrics with a `dp_rank` label added, merged family by family (the text
format allows each family once, so replicas' outputs cannot just be concatenated). Replicas
listen on loopback, so without this a scraper elsewhere could not reach them. A replica that does
not answer is left out of that scrape; `sgl_router_worker_healthy` says which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from server.router.state import ROUTER, Router

RANK_LABEL = "dp_rank"
SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


class MergedReplicaMetrics:
    """A prometheus_client collector over already-scraped texts, one per dp rank."""

    def __init__(self, texts: Sequence[tuple[int, str]]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for rank, text in self.texts:
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for s in family.samples:
                    merged.add_sample(s.name, {RANK_LABEL: str(rank), **s.labels}, s.value, s.timestamp, s.exemplar)
        yield from families.values()


def merge(router_registry: CollectorRegistry, texts: Sequence[tuple[int, str]]) -> bytes:
    """The router's exposition followed by the replicas' merged one."""
    replicas = CollectorRegistry(auto_describe=False)
    replicas.register(MergedReplicaMetrics(texts))  # type: ignore[arg-type]
    return generate_latest(router_registry) + generate_latest(replicas)


async def scrape(router: Router) -> list[tuple[int, str]]:
    """(rank, text) of every healthy worker that answers in time."""
    assert router.session is not None
    session = router.session

    async def one(rank: int, url: str) -> tuple[int, str] | None:
        try:
            async with session.get(url + "/metrics", headers=router.auth_headers(), timeout=SCRAPE_TIMEOUT) as r:
                return (rank, await r.text()) if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    found = await asyncio.gather(*(one(i, w.url) for i, w in enumerate(router.workers) if w.healthy))
    return [f for f in found if f is not None]


async def metrics_handler(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    body = merge(router.metrics.registry, await scrape(router))
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


__all__ = ["RANK_LABEL", "MergedReplicaMetrics", "merge", "metrics_handler", "scrape"]
