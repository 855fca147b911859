"""Rank 0's side of a tensor-parallel engine: start the group, watch it, stop it.

The `Engine` owns one `TPDriver` when `tp_size > 1` and otherwise knows nothing of tensor
parallelism: the model runner it gets back is rank 0's, whose forwards drive the other ranks.
"""

from __future__ import annotations

import asyncio
import logging

from engine.actors.supervisor import ActorSystem
from engine.distributed.launcher import WorkerProcesses, rank_threads, start_driver
from engine.distributed.step_message import TPStop, encode
from engine.errors import DistributedError
from engine.model_executor.model_runner import ModelRunner
from engine.models.loader import resolve_model
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often rank 0 checks that this host's worker ranks still run


class TPDriver:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.threads = rank_threads(args)  # rank 0's forward threads
        self.workers: WorkerProcesses | None = None
        self.runner: ModelRunner | None = None
        self._watch: asyncio.Task[None] | None = None

    def load(self) -> ModelRunner:
        """Spawn this host's worker ranks, join the group, load rank 0's shard (blocking)."""
        source = resolve_model(self.args.model_path)
        self.workers, group = start_driver(self.args, source)
        try:
            self.runner = ModelRunner(self.args, source, tp=group)
        except BaseException:
            self.workers.kill()
            group.destroy()
            raise
        return self.runner

    def watch(self, system: ActorSystem) -> None:
        """From now on, a worker rank that exits kills the engine at once, even while it idles
        (a forward in flight fails by itself: its collective raises)."""
        self._watch = asyncio.create_task(self._watch_workers(system))

    async def _watch_workers(self, system: ActorSystem) -> None:
        assert self.workers is not None
        while system.healthy:
            why = self.workers.dead()
            if why is not None:
                log.error("%s: the engine cannot run without it", why)
                system.record_crash("tensor-parallel", DistributedError(why))
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    def stop(self, healthy: bool) -> None:
        """After the actors and the device stream stopped (blocking): tell the worker ranks to
        leave when the group still works (`healthy`), else kill them; then leave the group."""
        if self._watch is not None:
            self._watch.get_loop().call_soon_threadsafe(self._watch.cancel)
        workers, runner = self.workers, self.runner
        if workers is None:
            return
        if runner is not None and healthy and workers.dead() is None:
            try:
                runner.tp.broadcast_bytes(encode(TPStop()))
                workers.stop()
            except DistributedError as e:
                log.warning("cannot tell the tensor-parallel workers to stop: %s", e)
                workers.kill()
        else:
            workers.kill()
        if runner is not None:
            runner.tp.destroy()
