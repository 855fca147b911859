"""`python -m server.router --worker-urls URL [URL ...]`: see `--help`.

SIGTERM / SIGINT stop it gracefully: the listener closes, streams in flight get a grace period
(`--graceful-shutdown-timeout`), then the client session closes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from server.router.app import build_router_app
from server.router.policy import POLICIES
from server.router.state import RouterConfig

log = logging.getLogger("server.router")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server.router", description=__doc__.split("\n")[0])
    p.add_argument("--worker-urls", nargs="+", required=True, help="the engine servers, e.g. http://h1:30000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--load-balance-method", choices=POLICIES, default="cache_aware")
    p.add_argument("--cache-threshold", type=float, default=0.5, help="matched fraction that routes to the cache")
    p.add_argument("--balance-abs-threshold", type=int, default=32)
    p.add_argument("--balance-rel-threshold", type=float, default=1.0001)
    p.add_argument("--max-tree-size", type=int, default=1 << 20, help="characters per worker's approximate tree")
    p.add_argument("--health-check-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument("--health-check-timeout", type=float, default=2.0)
    p.add_argument("--graceful-shutdown-timeout", type=float, default=10.0)
    p.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY'; forwarded to workers")
    p.add_argument("--log-level", default="info")
    # GET /metrics is on by default (as vLLM's); --enable-metrics is SGLang's spelling, a no-op here.
    p.add_argument("--enable-metrics", action="store_true", help="accepted for SGLang; metrics are on by default")
    p.add_argument("--disable-metrics", action="store_true", help="do not serve GET /metrics")
    args = p.parse_args(argv)
    if args.health_check_interval <= 0:
        p.error("--health-check-interval must be positive")
    if not 0.0 <= args.cache_threshold <= 1.0:
        p.error("--cache-threshold must be within [0, 1]")
    return args


def config_from(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        worker_urls=list(args.worker_urls),
        policy=args.load_balance_method,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        max_tree_size=args.max_tree_size,
        health_check_interval=args.health_check_interval,
        health_check_timeout=args.health_check_timeout,
        api_key=args.api_key,
        enable_metrics=not args.disable_metrics,
    )


async def serve(args: argparse.Namespace) -> None:
    app = build_router_app(config_from(args))
    # handler_cancellation: a client that leaves cancels its handler, closing the upstream stream
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=args.graceful_shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info("router on http://%s:%d -> %s (%s)", args.host, args.port, args.worker_urls, args.load_balance_method)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
