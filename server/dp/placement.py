"""Where the replicas run: this host (`LocalPlacement`) or a Ray cluster (`--ray-address`,
`server/dp/ray_placement.py`, imported only then, since Ray is an optional dependency).

A placement plans the resource split (`server/dp/resources.py`) for its kind, creates the
`Replica` objects the supervisor drives, waits until its resources are there (`ready`) and
releases them (`close`).

Local replica logs go to a fresh temporary directory, one file per replica (restarts append); it
is printed at start-up and removed at a clean exit, but kept (and named again) after a start-up
failure or a restart, when someone will want to read it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from server.config import ServerConfig
from server.dp.replica import LocalReplica, Replica
from server.dp.resources import ReplicaPlan, plan_replicas, probe_machine


class Placement(Protocol):
    name: str
    replicas: list[Replica]

    async def ready(self) -> None: ...

    def close(self, keep_logs: bool = False) -> None: ...


class LocalPlacement:
    name = "local"

    def __init__(self, plans: Sequence[ReplicaPlan], argv: Sequence[str]) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix="asyncllm-dp-"))
        self.replicas: list[Replica] = [LocalReplica(plan, argv, self.log_dir) for plan in plans]

    async def ready(self) -> None:
        return None

    def close(self, keep_logs: bool = False) -> None:
        if keep_logs:
            print(f"replica logs kept in {self.log_dir}", flush=True)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def make_placement(argv: Sequence[str], engine_options: Mapping[str, Any], config: ServerConfig) -> Placement:
    """Raises `ResourceError` (a split that cannot work) or, for Ray, `RayPlacementError`."""
    ray = config.ray_address is not None
    if ray:  # before anything else: without Ray installed this is the one error to show
        from server.dp.ray_placement import import_ray

        import_ray()
    plans = plan_replicas(config.dp_size, engine_options, probe_machine(engine_options), ray=ray)
    if config.ray_address is not None:
        from server.dp.ray_placement import RayPlacement

        return RayPlacement(config.ray_address, plans, argv)
    return LocalPlacement(plans, argv)


__all__ = ["LocalPlacement", "Placement", "make_placement"]
