"""`--ray-address`: the replicas as Ray actors on a Ray cluster (issue 16, item 3).

The controller connects (`ray.init(address=...)`), reserves one placement-group bundle per
replica (CPUs: the replica's torch threads; GPUs: its `--tp-size`, on CUDA) and creates one
`ReplicaActor` per bundle. Each actor starts its replica server on its own node, listening on
the node's IP (replicas must be reachable from the controller's node) on a free port, and
answers with the URL the router then routes to. The cluster's nodes need this package installed
at the same Python path (Ray runs `sys.executable -m server` there); the replicas read their
environment from their node's raylet, plus the `ASYNCLLM_*`, `SGLANG_*`, `HF_*` and
`TOKENIZERS_*` variables the controller forwards (what configures a server). Replica logs stay
on their nodes (paths in `/get_server_info`'s `dp` section); `log_to_driver` is off so the
controller's own output stays readable.

Strategy SPREAD: replicas go to different nodes when the cluster has room (each gets a node's
cores, memory bandwidth and GPUs to itself, and losing a node loses fewer replicas), and share
a node when it does not (SPREAD is best effort; STRICT_SPREAD would refuse to start).

Restarts: the controller re-creates the actor (on the same bundle), rather than Ray restarting
it with `max_restarts`: the case to handle is mostly the replica process dying while its actor
lives, which Ray would not notice, and a restarted replica has a new URL the router must learn
anyway; one path (the supervisor's, as for local replicas) covers both. Shutdown stops each
replica through its actor (SIGTERM, drain), kills the actors and removes the placement group.
A replica whose actor is killed without that (the controller SIGKILLed: Ray then kills the
actors) gets SIGTERM from the kernel (`server/dp/process.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

from server.dp.process import ReplicaStartError
from server.dp.ray_actor import ReplicaActor
from server.dp.replica import Replica
from server.dp.resources import ReplicaPlan

log = logging.getLogger("server.dp")

INSTALL_HINT = "--ray-address needs Ray: pip install .[ray]"
FORWARDED_ENV_PREFIXES = ("ASYNCLLM_", "SGLANG_", "HF_", "TOKENIZERS_")
STRATEGY = "SPREAD"
PLACEMENT_TIMEOUT_S = 60.0  # the cluster must find room for every bundle this soon
CALL_GRACE_S = 30.0  # on top of a replica's own timeouts, for Ray's scheduling and calls


class RayPlacementError(RuntimeError):
    """Ray is missing, unreachable, or cannot fit the replicas: one line for the user."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayPlacementError(f"{INSTALL_HINT} ({e})") from None
    return ray


async def result(ref: Any) -> Any:
    """Await a Ray ObjectRef on any event loop (uvloop included)."""
    return await asyncio.wrap_future(ref.future())


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


class RayPlacement:
    """A placement group over the cluster and one `RayReplica` per bundle."""

    name = "ray"

    def __init__(self, address: str, plans: Sequence[ReplicaPlan], argv: Sequence[str]) -> None:
        ray = self.ray = import_ray()
        from ray.util.placement_group import placement_group

        try:
            ray.init(address=address, log_to_driver=False)
        except Exception as e:  # ConnectionError, or a version mismatch: the message says which
            raise RayPlacementError(f"cannot connect to the Ray cluster at {address}: {e}") from None
        self.bundles = [dict(p.bundle) for p in plans]
        self.group = placement_group(self.bundles, strategy=STRATEGY)
        self.actor_class = ray.remote(ReplicaActor)
        self.replicas: list[Replica] = [RayReplica(plan, argv, self) for plan in plans]

    async def ready(self) -> None:
        try:
            await asyncio.wait_for(result(self.group.ready()), PLACEMENT_TIMEOUT_S)
        except TimeoutError:
            raise RayPlacementError(
                f"the Ray cluster has no room for {len(self.bundles)} bundles of {self.bundles[0]} "
                f"(waited {PLACEMENT_TIMEOUT_S:g}s; see `ray status`)"
            ) from None

    def close(self, keep_logs: bool = False) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        finally:
            self.ray.shutdown()


class RayReplica(Replica):
    """A replica started by a `ReplicaActor` on the bundle of its index."""

    def __init__(self, plan: ReplicaPlan, argv: Sequence[str], placement: RayPlacement) -> None:
        super().__init__(plan)
        self.argv = list(argv)
        self.placement = placement
        self.actor: Any = None
        self.started: dict[str, Any] = {}

    @property
    def url(self) -> str | None:
        return self.started.get("url")

    @property
    def pid(self) -> int | None:
        return self.started.get("pid")

    def new_actor(self) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.plan.bundle
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.placement.group, placement_group_bundle_index=self.index
        )
        return self.placement.actor_class.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy
        ).remote(self.index, forwarded_env())

    async def start(self, timeout: float) -> None:
        self.discard_actor()  # a restart: the old actor's replica is gone
        self.actor = self.new_actor()
        call = self.actor.start.remote(self.argv, self.plan.overrides(), timeout)
        try:
            out = await asyncio.wait_for(result(call), timeout + CALL_GRACE_S)
        except TimeoutError:
            raise ReplicaStartError(self.index, "got no answer from its Ray actor", None, "", None) from None
        except Exception as e:  # RayActorError, RayTaskError: the actor died or raised
            raise ReplicaStartError(self.index, f"failed in its Ray actor: {e}", None, "", None) from None
        self.started = out
        if not out["ok"]:
            raise ReplicaStartError(self.index, out["reason"], out["error_line"], out["log_tail"], out["status"])

    async def wait_exit(self) -> int:
        try:
            return int(await result(self.actor.wait_exit.remote()))
        except Exception as e:  # the actor (or its node) died: its replica went with it
            log.warning("replica %d: its Ray actor died: %s", self.index, e)
            return -1

    async def stop(self, timeout: float) -> None:
        if self.actor is None:
            return
        try:
            await asyncio.wait_for(result(self.actor.stop.remote(timeout)), timeout + CALL_GRACE_S)
        except Exception as e:  # a dead actor, a lost node: nothing left to stop
            log.warning("replica %d: stopping through its Ray actor failed: %s", self.index, e)
        self.discard_actor()

    def discard_actor(self) -> None:
        if self.actor is not None:
            self.placement.ray.kill(self.actor)
            self.actor = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "node": self.started.get("node"), "log": self.started.get("log")}


__all__ = ["INSTALL_HINT", "RayPlacement", "RayPlacementError", "RayReplica", "forwarded_env", "import_ray"]
