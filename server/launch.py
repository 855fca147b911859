"""Process lifecycle: load the engine, listen, serve until SIGTERM/SIGINT, then shut down
gracefully and exit 0.

Shutdown: stop listening and admitting (new generations get 503 `shutting_down`), let in-flight
requests finish within --graceful-shutdown-timeout; at that deadline, end every generation still
open (`GenerationGroup.abort`, "server shutting down"): each handler then answers the way it
answers any error (an SSE stream gets an error event and [DONE], a non-streaming request a 503
JSON body, a WebSocket generation its final `abort` delta, then the socket closes 1001). aiohttp's
own shutdown timeout, which cancels handlers outright, is only a backstop a few seconds later
for a handler stuck writing to a client that does not read. The engine stops last, once every
handler has let go of its generations.

Startup failures a user can cause (bad model path, port in use, bad engine option) end with one
line on stderr and a non-zero status; a traceback is shown only with --log-level debug.

With `--dp-size` above 1 (or `--ray-address`), `main` runs the data-parallel controller instead
(`server/dp/controller.py`): replicas of this very server behind a routing front end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from server.config import ServerConfig

if TYPE_CHECKING:
    from aiohttp import web

    from server.state import ServerState

log = logging.getLogger("server")

EXIT_USAGE = 2  # a bad flag (argparse) or an engine option that cannot work
EXIT_ENGINE_DIED = 3  # the engine died while serving (an actor crashed, the watchdog fired)
SHUTTING_DOWN = "server shutting down"  # why generations still open at the deadline end
# After the deadline's aborts: how long handlers get to write their last event before aiohttp
# cancels them, and how long the engine waits for cancelled ones to let go of their generations.
ABORT_GRACE_S = 5.0


def _fail(message: str, config: ServerConfig, status: int = 1) -> int:
    if config.log_level == "debug":
        log.exception("startup failed")
    print(f"error: {message}", file=sys.stderr, flush=True)
    return status


async def serve(engine_options: dict[str, Any], config: ServerConfig) -> int:
    from aiohttp import web

    from engine import Engine, EngineError, InvalidServerArgsError
    from server.app import build_app
    from server.http_protocol import ApiRunner
    from server.state import STATE

    t0 = time.perf_counter()
    try:
        engine = Engine(config.model_path, **engine_options)
        engine.args.resolved_dtype()  # an unknown dtype fails now, not after loading
        await engine.start()
    except InvalidServerArgsError as e:  # an option that cannot work: a usage error, like a bad flag
        return _fail(str(e), config, EXIT_USAGE)
    except EngineError as e:
        return _fail(str(e), config)
    except Exception as e:  # e.g. a torch error from an impossible memory setting
        return _fail(f"cannot start the engine: {type(e).__name__}: {e}", config)
    runner = None
    try:
        app = build_app(engine, config)
        runner = ApiRunner(  # web.AppRunner with JSON protocol errors and a connection cap
            app,
            handler_cancellation=True,
            shutdown_timeout=config.graceful_shutdown_timeout + ABORT_GRACE_S,
            keepalive_timeout=config.timeout_keep_alive,
            max_connections=config.max_connections,
        )
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
        if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: dump the flight recorder, keep serving
            loop.add_signal_handler(signal.SIGUSR1, _dump_flight_recorder, engine)
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
            f"Shutting down: waiting up to {config.graceful_shutdown_timeout:g}s for {state.inflight} "
            "in-flight generation(s)",
            flush=True,
        )
        pending, runner = runner, None
        await shut_down(pending, state, config.graceful_shutdown_timeout)
        return code
    finally:
        if runner is not None:
            await runner.cleanup()
        await engine.stop()


def _dump_flight_recorder(engine: Any) -> None:
    from engine import EngineError

    try:
        print(f"flight recorder dumped to {engine.dump_flight_recorder('SIGUSR1')}", flush=True)
    except (EngineError, OSError) as e:
        print(f"error: cannot dump the flight recorder: {e}", file=sys.stderr, flush=True)


async def shut_down(runner: web.AppRunner, state: ServerState, grace: float) -> None:
    """Close the HTTP side within `grace` seconds (see the module doc); `state.draining` is set.

    `runner.cleanup()` closes the listener, runs the on_shutdown hooks (WebSockets drain) and
    waits for the handlers; at the deadline the generations still open are ended so that their
    handlers finish with a proper last message instead of being cancelled mid-write.
    """
    from server.errors import unavailable

    cleanup = asyncio.ensure_future(runner.cleanup())
    done, _ = await asyncio.wait({cleanup}, timeout=grace)
    if not done:
        groups = list(state.live)
        if groups:
            print(f"Grace period over: ending {len(groups)} request(s) still running", flush=True)
        error = unavailable(SHUTTING_DOWN, code="shutting_down")
        for group in groups:
            group.abort(error)
    await cleanup
    # A handler aiohttp had to cancel closes its generations as it unwinds, and every abort is a
    # message still on its way through the actors: the engine, stopped next, must take them all
    # first (an actor stopped under a message in flight logs an error).
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(ABORT_GRACE_S):
            await state.idle.wait()
            await _engine_settled(state)


async def _engine_settled(state: ServerState) -> None:
    """Return once the engine holds no request (a control round trip also flushes the messages
    queued before it), or at once if it is down."""
    from engine import EngineError

    while state.engine.healthy:
        try:
            st = await state.engine.get_internal_state()
        except EngineError:
            return
        if not st["running_requests"] and not st["waiting_requests"]:
            return
        await asyncio.sleep(0.01)


def _run_worker_node(engine_options: dict[str, Any], config: ServerConfig) -> int:
    """`--node-rank K` (K > 0): this host only runs its tensor-parallel ranks (no HTTP); node 0's
    server drives them and stops them when it stops."""
    from engine import EngineError, InvalidServerArgsError, run_worker_node

    try:
        return run_worker_node(config.model_path, **engine_options)
    except InvalidServerArgsError as e:
        return _fail(str(e), config, EXIT_USAGE)
    except EngineError as e:
        return _fail(str(e), config)


def main(argv: list[str] | None = None) -> int:
    from server.cli import parse_args

    argv = sys.argv[1:] if argv is None else list(argv)
    engine_options, config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    if engine_options.get("node_rank", 0) > 0:  # a host of tensor-parallel ranks other than node 0
        return _run_worker_node(engine_options, config)
    if config.dp_size > 1 or config.ray_address is not None:  # a controller of replicas (server/dp/)
        from server.dp.controller import serve_dp

        job = serve_dp(argv, engine_options, config)
    else:
        job = serve(engine_options, config)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            return runner.run(job)
        except KeyboardInterrupt:
            return 0
