"""Process lifecycle: load the engine, listen, serve until SIGTERM/SIGINT, then shut down
gracefully (stop accepting, let in-flight requests finish within the grace period, exit 0).

Startup failures a user can cause (bad model path, port in use, bad engine option) end with one
line on stderr and a non-zero status; a traceback is shown only with --log-level debug.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from typing import Any

from server.config import ServerConfig

log = logging.getLogger("server")

EXIT_ENGINE_DIED = 3  # the engine died while serving (an actor crashed, the watchdog fired)


def _fail(message: str, config: ServerConfig) -> int:
    if config.log_level == "debug":
        log.exception("startup failed")
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


async def serve(engine_options: dict[str, Any], config: ServerConfig) -> int:
    from aiohttp import web

    from engine import Engine, EngineError
    from server.app import build_app
    from server.state import STATE

    t0 = time.perf_counter()
    try:
        engine = Engine(config.model_path, **engine_options)
        engine.args.resolved_dtype()  # an unknown dtype fails now, not after loading
        await engine.start()
    except EngineError as e:
        return _fail(str(e), config)
    except Exception as e:  # e.g. a torch error from an impossible memory setting
        return _fail(f"cannot start the engine: {type(e).__name__}: {e}", config)
    runner = None
    try:
        app = build_app(engine, config)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=config.graceful_shutdown_timeout)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as e:
            return _fail(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}", config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        info = engine.model_info
        print(
            f"Serving {config.model_name!r} ({config.model_path}, {info.dtype}, {info.device}, context "
            f"{info.context_len}) at http://{config.host}:{config.port} [ready in {time.perf_counter() - t0:.1f}s; "
            f"max_running_requests={info.max_running_requests}]",
            flush=True,
        )
        stopped, died = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(engine.wait_unhealthy())
        await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if died.done() and not stopped.done():  # exit non-zero: the supervisor restarts us
            code = EXIT_ENGINE_DIED
            print(f"error: the engine died ({died.result()}); exiting with status {code}", file=sys.stderr, flush=True)
        stopped.cancel()
        died.cancel()
        state = app[STATE]
        state.draining = True
        print(
            f"Shutting down: waiting up to {config.graceful_shutdown_timeout:.0f}s for {state.inflight} "
            "in-flight generation(s)",
            flush=True,
        )
        await runner.cleanup()  # closes the listener, drains handlers within shutdown_timeout
        runner = None
        return code
    finally:
        if runner is not None:
            await runner.cleanup()
        await engine.stop()


def main(argv: list[str] | None = None) -> int:
    from server.cli import parse_args

    engine_options, config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            return runner.run(serve(engine_options, config))
        except KeyboardInterrupt:
            return 0
