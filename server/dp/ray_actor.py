"""The Ray actor that runs one replica server on its node (see `server/dp/ray_placement.py`).

A plain class (made a Ray actor by the controller with `ray.remote`), so this module imports
without Ray. It is an async actor: `wait_exit` stays pending for as long as the replica runs
while `stop` can still be called, and the replica process is forked from the actor's event-loop
thread, which lives as long as the actor (the replica's parent-death signal follows that thread).

Start-up failures come back as a plain dict rather than an exception: a custom exception does
not always survive Ray's pickling, and the controller needs its fields (the replica's error line
and log tail) to report it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from server.dp.process import ReplicaStartError, ServerProcess, free_port
from server.dp.replica_args import replica_argv


def node_ip() -> str:
    """The address other nodes (and the controller) reach this node at."""
    import ray

    return ray.util.get_node_ip_address()


class ReplicaActor:
    def __init__(self, index: int, env: Mapping[str, str]) -> None:
        self.index = index
        log_dir = Path(tempfile.gettempdir()) / "asyncllm-dp-ray"
        self.process = ServerProcess(index, log_dir / f"replica-{index}-{os.getpid()}.log", env)

    async def start(self, argv: Sequence[str], overrides: Mapping[str, str | None], timeout: float) -> dict[str, Any]:
        """Launch the replica on this node (its IP, a free port) and wait for /health."""
        host = node_ip()
        port = free_port(host)
        args = replica_argv(argv, overrides, host, port)
        self.process.launch(args, f"http://{host}:{port}")
        out: dict[str, Any] = {"url": self.process.url, "pid": self.process.pid, "node": host}
        out["log"] = str(self.process.log_path)
        try:
            await self.process.wait_ready(timeout)
        except ReplicaStartError as e:
            failure = {"reason": e.reason, "error_line": e.error_line, "log_tail": e.log_tail, "status": e.status}
            return {**out, "ok": False, **failure}
        return {**out, "ok": True}

    async def wait_exit(self) -> int:
        return await self.process.wait_exit()

    async def stop(self, timeout: float) -> int | None:
        return await self.process.stop(timeout)


__all__ = ["ReplicaActor", "node_ip"]
