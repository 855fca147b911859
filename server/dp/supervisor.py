"""Start-up, restarts and shutdown of the replicas, the same for every placement.

Start-up: every replica starts at once (they load in parallel); the first one that fails (exits,
or misses the start-up timeout) ends the start-up: the others are stopped and its error is what
the controller reports, so a bad flag or a bad model path ends the controller at once instead of
leaving it waiting for the replicas that would fail the same way later.

While serving, a replica that exits for any reason the controller did not ask for is restarted
after a back-off that doubles from 1 s up to 30 s, and goes back to 1 s once a replica has served
a minute. `on_down` (the router stops sending it anything at once, without waiting for a failed
health check) and `on_up` (the router takes it back, at its new URL) tell the front end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from server.dp.process import ReplicaStartError
from server.dp.replica import Replica

log = logging.getLogger("server.dp")

START_TIMEOUT_S = 600.0  # a replica must answer /health this soon after launch (model load included)
STOP_GRACE_S = 10.0  # after its own graceful shutdown timeout, before a replica is killed
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # serving this long resets the back-off


def backoff(failures: int) -> float:
    """Seconds to wait before restart number `failures + 1` of a row of quick failures."""
    return min(BACKOFF_S * 2**failures, BACKOFF_MAX_S)


class Supervisor:
    def __init__(
        self,
        replicas: Sequence[Replica],
        start_timeout: float = START_TIMEOUT_S,
        stop_timeout: float = 30.0 + STOP_GRACE_S,
    ) -> None:
        self.replicas = list(replicas)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.stopping = False  # set by the controller's signal handler: no more restarts
        self.on_down: Callable[[Replica, str], None] = lambda replica, why: None
        self.on_up: Callable[[Replica], Awaitable[None]] | None = None
        self.tasks: list[asyncio.Task] = []

    async def start_all(self) -> None:
        """Start every replica; raise the first `ReplicaStartError` (the others are cancelled,
        their processes are left for `stop_all`)."""
        starts = [asyncio.ensure_future(r.start(self.start_timeout)) for r in self.replicas]
        try:
            await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
            for task in starts:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in starts:
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)

    def watch(self) -> None:
        """Restart replicas that exit from now on."""
        self.tasks = [asyncio.create_task(self.supervise(r), name=f"dp-replica-{r.index}") for r in self.replicas]

    async def supervise(self, replica: Replica) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            status = await replica.wait_exit()
            if self.stopping:
                return
            replica.last_exit = status
            if time.monotonic() - started >= STABLE_S:
                failures = 0
            self.on_down(replica, f"exited with status {status}")
            while True:
                delay = backoff(failures)
                failures += 1
                log.warning(
                    "replica %d (pid %s) exited with status %s; restart %d in %.0f s",
                    replica.index,
                    replica.pid,
                    replica.last_exit,
                    replica.restarts + 1,
                    delay,
                )
                await asyncio.sleep(delay)
                if self.stopping:
                    return
                replica.restarts += 1
                try:
                    await replica.start(self.start_timeout)
                except ReplicaStartError as e:
                    replica.last_exit = e.status
                    log.error("replica %d failed to restart: %s\n%s", replica.index, e, e.log_tail)
                    continue
                except Exception:  # e.g. a Ray error: keep trying, as for a failed start
                    log.exception("replica %d failed to restart", replica.index)
                    continue
                log.warning("replica %d restarted: pid %s, %s", replica.index, replica.pid, replica.url)
                if self.on_up is not None:
                    await self.on_up(replica)
                break

    async def stop_all(self) -> None:
        """No more restarts; stop every replica (SIGTERM, then SIGKILL after `stop_timeout`)."""
        self.stopping = True
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        results = await asyncio.gather(*(r.stop(self.stop_timeout) for r in self.replicas), return_exceptions=True)
        for replica, result in zip(self.replicas, results):
            if isinstance(result, BaseException):
                log.error("replica %d: stop failed: %s", replica.index, result)


__all__ = ["BACKOFF_MAX_S", "BACKOFF_S", "START_TIMEOUT_S", "STOP_GRACE_S", "Supervisor", "backoff"]
