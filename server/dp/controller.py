"""`python -m server --dp-size N`: the data-parallel controller's life, start to exit.

1. Plan the replicas (`placement.py`: this host, or Ray with `--ray-address`) and check that the
   front end's address is free, so neither mistake costs a model load.
2. Start every replica at once (`supervisor.py`); the first that fails ends the controller with
   its own error line and every replica's log tail, exit status 2 for a usage error (as the
   replica's), else 1. Print one line per replica: index, pid, URL, device, threads, KV pool.
3. Serve the router front end (`frontend.py`) on --host/--port; restart replicas that exit.
4. SIGTERM/SIGINT (also during start-up): no more restarts; the front end closes its listener
   and lets requests in flight finish within --graceful-shutdown-timeout (aiohttp's runner
   cleanup, as the standalone router does), then every replica gets SIGTERM (each drains what it
   still holds) and is killed if it has not exited 10 s after its own grace period. Exit 0.

Replicas stay in the controller's process group: a Ctrl-C at a terminal reaches them too, and
each drains its own requests, which ends the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from server.config import ServerConfig
from server.dp.frontend import build_frontend
from server.dp.placement import Placement, make_placement
from server.dp.process import ReplicaStartError
from server.dp.replica import Replica
from server.dp.resources import ResourceError
from server.dp.supervisor import STOP_GRACE_S, Supervisor
from server.http_protocol import RedactingAccessLogger

log = logging.getLogger("server.dp")

EXIT_USAGE = 2  # as launch.py: a flag or option that cannot work


def fail(message: str, status: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return status


def check_listen(host: str, port: int) -> str | None:
    """Why the front end could not listen on host:port, or None (checked before any replica loads)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            return None
    except OSError as e:
        return f"cannot listen on {host}:{port}: {e.strerror or e}"


def report_start_failure(error: ReplicaStartError, replicas: Sequence[Replica]) -> int:
    """The failed replica's error line, then every replica's log tail; the exit status."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    for replica in replicas:
        tail = error.log_tail if replica.index == error.index else replica.log_tail()
        if tail.strip():
            print(f"--- replica {replica.index} log (last lines) ---\n{tail}", file=sys.stderr, flush=True)
    return EXIT_USAGE if error.status == EXIT_USAGE else 1


async def replica_facts(replica: Replica, api_key: str | None) -> dict[str, Any]:
    """Device, threads and KV pool as the replica itself reports them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    facts: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=headers) as s:
            async with s.get(f"{replica.url}/get_model_info") as r:
                facts["device"] = (await r.json()).get("device")
            async with s.get(f"{replica.url}/get_server_info") as r:
                state = ((await r.json()).get("internal_states") or [{}])[0]
                facts["kv_tokens"] = state.get("total_tokens")
                facts["threads"] = (state.get("torch_threads") or {}).get("forward")
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        log.warning("replica %d: cannot read its info: %s", replica.index, e)
    return facts


def replica_line(replica: Replica, facts: Mapping[str, Any]) -> str:
    where = replica.describe().get("log")
    return (
        f"replica {replica.index}: pid {replica.pid}, {replica.url}, device {facts.get('device', '?')}, "
        f"{facts.get('threads', '?')} torch threads, KV pool {facts.get('kv_tokens', '?')} tokens"
        + (f", log {where}" if where else "")
    )


class Controller:
    def __init__(self, argv: Sequence[str], engine_options: Mapping[str, Any], config: ServerConfig) -> None:
        self.argv, self.engine_options, self.config = list(argv), engine_options, config
        self.stop = asyncio.Event()
        self.supervisor: Supervisor | None = None

    def on_signal(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stopping = True  # before any replica the same signal reached can exit
        self.stop.set()

    async def run(self) -> int:
        t0 = time.perf_counter()
        config = self.config
        why = check_listen(config.host, config.port)
        if why is not None:
            return fail(why)
        try:
            placement = make_placement(self.argv, self.engine_options, config)
        except ResourceError as e:
            return fail(str(e), EXIT_USAGE)
        except RuntimeError as e:  # RayPlacementError, ReplicaArgsError
            return fail(str(e))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal)
        stop_timeout = config.graceful_shutdown_timeout + STOP_GRACE_S
        supervisor = self.supervisor = Supervisor(placement.replicas, stop_timeout=stop_timeout)
        status = 1  # an exception on the way out keeps the logs too
        try:
            started = await self.start(placement, supervisor)
            status = await self.serve(placement, supervisor, t0) if started is None else started
            return status
        finally:
            await supervisor.stop_all()
            placement.close(keep_logs=status != 0 or any(r.restarts for r in placement.replicas))

    async def start(self, placement: Placement, supervisor: Supervisor) -> int | None:
        """Start every replica; an exit status if the controller must end instead of serving."""
        print(
            f"Starting {len(placement.replicas)} data-parallel replicas ({placement.name} placement)",
            flush=True,
        )
        for replica in placement.replicas:
            if replica.describe().get("log"):
                print(f"replica {replica.index} log: {replica.describe()['log']}", flush=True)

        async def start_all() -> None:
            await placement.ready()
            await supervisor.start_all()

        starting = asyncio.ensure_future(start_all())
        stopped = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if self.stop.is_set():  # a signal during start-up (replicas it also reached may have failed)
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
            print("Interrupted during start-up: stopping the replicas", flush=True)
            return 0
        error = starting.exception()
        if isinstance(error, ReplicaStartError):
            return report_start_failure(error, placement.replicas)
        if error is not None:
            return fail(str(error))
        facts = await asyncio.gather(*(replica_facts(r, self.config.api_key) for r in placement.replicas))
        for replica, fact in zip(placement.replicas, facts):
            replica.facts = fact
            print(replica_line(replica, fact), flush=True)
        return None

    async def serve(self, placement: Placement, supervisor: Supervisor, t0: float) -> int:
        config = self.config
        app = build_frontend(config, supervisor, placement.name)
        runner = web.AppRunner(
            app,
            handler_cancellation=True,  # a client that leaves closes the upstream stream
            shutdown_timeout=config.graceful_shutdown_timeout,
            keepalive_timeout=config.timeout_keep_alive,
            access_log_class=RedactingAccessLogger,  # the dashboard's `?api_key=` masked, as on a single server
        )
        await runner.setup()
        try:
            try:
                await web.TCPSite(runner, config.host, config.port).start()
            except OSError as e:
                return fail(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}")
            supervisor.watch()
            print(
                f"Serving {config.model_name!r} with {len(placement.replicas)} data-parallel replicas "
                f"({config.load_balance_method}) at http://{config.host}:{config.port} "
                f"[ready in {time.perf_counter() - t0:.1f}s]",
                flush=True,
            )
            await self.stop.wait()
            print(
                f"Shutting down: the front end drains for up to {config.graceful_shutdown_timeout:g}s, "
                "then the replicas",
                flush=True,
            )
        finally:
            await runner.cleanup()
        return 0


async def serve_dp(argv: Sequence[str], engine_options: Mapping[str, Any], config: ServerConfig) -> int:
    return await Controller(argv, engine_options, config).run()


__all__ = ["Controller", "check_listen", "replica_line", "serve_dp"]
