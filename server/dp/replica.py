"""A replica as the controller sees it, whatever runs it: `Replica` is the contract the supervisor
and the front end use, `LocalReplica` the one that runs `python -m server` on this host.

Why a contract: the local placement and the Ray placement (`server/dp/ray_placement.py`) differ
only in where the process runs and who starts it; start-up, restarts, shutdown and the `dp`
section of /get_server_info are the same code for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.dp.process import ServerProcess, free_port
from server.dp.replica_args import replica_argv
from server.dp.resources import ReplicaPlan

LOCAL_HOST = "127.0.0.1"  # local replicas listen on loopback only: the front end is their one client


class Replica:
    """One replica: started, watched, restarted and stopped by the supervisor."""

    def __init__(self, plan: ReplicaPlan) -> None:
        self.plan = plan
        self.index = plan.index
        self.restarts = 0
        self.last_exit: int | None = None  # the status of its last unexpected exit
        self.facts: dict[str, Any] = {}  # device, threads, KV pool: as it reported them at start-up

    @property
    def url(self) -> str | None:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        raise NotImplementedError

    async def start(self, timeout: float) -> None:
        """Launch it (again) and return once it answers /health; `ReplicaStartError` otherwise."""
        raise NotImplementedError

    async def wait_exit(self) -> int:
        """Return its exit status once it ends."""
        raise NotImplementedError

    async def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        raise NotImplementedError

    def log_tail(self) -> str:
        return ""

    def describe(self) -> dict[str, Any]:
        """Its entry in the front end's /get_server_info `dp` section (health is the router's)."""
        return {
            "index": self.index,
            "url": self.url,
            "pid": self.pid,
            "restarts": self.restarts,
            "last_exit_status": self.last_exit,
            "device": self.facts.get("device") or self.plan.device,
            "torch_threads": self.facts.get("threads") or self.plan.torch_threads,
            "kv_pool_tokens": self.facts.get("kv_tokens"),
            "mem_fraction_static": self.plan.mem_fraction_static,
        }


class LocalReplica(Replica):
    """`python -m server` on this host, on a fresh loopback port at every (re)start."""

    def __init__(self, plan: ReplicaPlan, argv: Sequence[str], log_dir: Path) -> None:
        super().__init__(plan)
        self.argv = list(argv)
        self.process = ServerProcess(plan.index, log_dir / f"replica-{plan.index}.log", plan.env)

    @property
    def url(self) -> str | None:
        return self.process.url

    @property
    def pid(self) -> int | None:
        return self.process.pid

    async def start(self, timeout: float) -> None:
        port = free_port(LOCAL_HOST)
        args = replica_argv(self.argv, self.plan.overrides(), LOCAL_HOST, port)
        self.process.launch(args, f"http://{LOCAL_HOST}:{port}")
        await self.process.wait_ready(timeout)

    async def wait_exit(self) -> int:
        return await self.process.wait_exit()

    async def stop(self, timeout: float) -> None:
        await self.process.stop(timeout)

    def log_tail(self) -> str:
        return self.process.log_tail()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "log": str(self.process.log_path)}


__all__ = ["LOCAL_HOST", "LocalReplica", "Replica"]
