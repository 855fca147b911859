"""Starting, watching and stopping the tensor-parallel ranks of one engine.

Layout (SGLang's flags): `tp_size` ranks over `nnodes` hosts, `tp_size / nnodes` per host; host
`node_rank` runs ranks `[node_rank * per_node, (node_rank + 1) * per_node)`. Rank 0, on node 0,
is the engine's own process (the actors); every other rank is a child process running
`python -m engine.distributed.worker`, spawned by its host: node 0 by the `Engine` itself, the
other hosts by `python -m server ... --node-rank K` (which then only runs its workers).

The rendezvous is torch.distributed's TCP store at `dist_init_addr` (node 0's HOST:PORT); on one
host without it, a free loopback port. Two hosts:

    node 0: python -m server --tp-size 4 --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:5757
    node 1: python -m server --tp-size 4 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5757

Threads and memory: the ranks on one host share it, so each gets the host's default torch
threads divided by the ranks there, and the KV pool budget (`mem_fraction_static` of the free
memory) is divided the same way (engine/model_executor/model_runner.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from engine.device.cpu_threads import default_torch_threads
from engine.distributed.parallel_state import TPGroup
from engine.distributed.sharding import check_tp_size
from engine.errors import InvalidServerArgsError
from engine.model_config import ModelConfig
from engine.models.loader import ModelSource
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)

WORKER_MODULE = "engine.distributed.worker"
STOP_GRACE_S = 10.0
RENDEZVOUS_S = 300.0  # every rank must have joined by then (they start in a few seconds)


@dataclass(frozen=True)
class RankLayout:
    """Where the ranks of one engine live."""

    tp_size: int
    nnodes: int
    node_rank: int
    init_method: str  # tcp://HOST:PORT of the rendezvous

    @property
    def per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        first = self.node_rank * self.per_node
        return range(first, first + self.per_node)

    @classmethod
    def of(cls, args: ServerArgs) -> RankLayout:
        """The layout of verified options (`ServerArgs.verify` checks the sizes and the address)."""
        addr = args.dist_init_addr if args.dist_init_addr is not None else f"127.0.0.1:{free_port()}"
        return cls(args.tp_size, args.nnodes, args.node_rank, f"tcp://{addr}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_threads(args: ServerArgs) -> int:
    """Torch threads of each rank's forward: the given `torch_threads`, else this host's default
    split among its ranks."""
    if args.torch_threads is not None:
        return args.torch_threads
    return max(1, default_torch_threads() // max(1, args.tp_size // max(1, args.nnodes)))


def rank_args(args: ServerArgs, layout: RankLayout, rank: int) -> ServerArgs:
    """The options rank `rank` runs with: on CUDA, the host's GPU `local rank`."""
    device = args.resolved_device()
    if device.type != "cuda":
        return args
    local = rank - layout.node_rank * layout.per_node
    return dataclasses.replace(args, device=f"cuda:{(device.index or 0) + local}")


class WorkerProcesses:
    """This host's worker ranks (child processes) and how to watch and stop them."""

    def __init__(self, args: ServerArgs, layout: RankLayout) -> None:
        self.layout = layout
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        threads = rank_threads(args)
        for rank in layout.local_ranks:
            if rank == 0:
                continue  # the engine's own process
            options = json.dumps(dataclasses.asdict(rank_args(args, layout, rank)))
            cmd = [
                sys.executable,
                "-m",
                WORKER_MODULE,
                f"--rank={rank}",
                f"--init-method={layout.init_method}",
                f"--threads={threads}",
                f"--local-size={layout.per_node}",
                f"--options={options}",
                f"--parent-pid={os.getpid()}",
            ]
            self.procs[rank] = subprocess.Popen(cmd)
            log.info("tensor-parallel rank %d: pid %d, %d torch thread(s)", rank, self.procs[rank].pid, threads)

    def dead(self) -> str | None:
        """Why a worker is gone (the first one found), or None while all run."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {code}"
        return None

    def wait(self) -> int:
        """Block until every worker has exited; the first non-zero status, else 0."""
        codes = [proc.wait() for proc in self.procs.values()]
        return next((c for c in codes if c), 0)

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Wait up to `grace_s` for the workers to leave (after the stop message), then kill them."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()


def run_worker_node(model: str = "smollm2-135m", **options: object) -> int:
    """A host other than node 0 (`node_rank` > 0): run its worker ranks until they exit (the engine
    on node 0 stops them, or a rank fails); the exit status for the process. `options` are the
    engine's (`ServerArgs`), the same on every host."""
    args = ServerArgs(model_path=model, **options)  # type: ignore[arg-type]
    args.verify()
    layout = RankLayout.of(args)
    if layout.node_rank == 0:
        raise InvalidServerArgsError("node 0 runs the engine itself, not only workers", "node_rank")
    workers = WorkerProcesses(args, layout)
    print(f"node {layout.node_rank}: ranks {list(layout.local_ranks)} joining {layout.init_method}", flush=True)
    try:
        return workers.wait()
    except KeyboardInterrupt:
        workers.kill()
        return 0


def start_driver(args: ServerArgs, source: ModelSource) -> tuple[WorkerProcesses, TPGroup]:
    """Node 0: check the split, spawn this host's worker ranks and join the group as rank 0.
    The workers are killed if the rendezvous fails."""
    args.verify()  # before any process starts: the options, then the model's split
    cfg = ModelConfig.from_hf(source.hf_config, source.architecture, source.generation_eos)
    check_tp_size(cfg, args.tp_size, args.ep_size)
    layout = RankLayout.of(args)
    if layout.node_rank != 0:
        raise InvalidServerArgsError("only node 0 runs the engine; start other nodes with their node_rank", "node_rank")
    workers = WorkerProcesses(args, layout)
    try:
        device = args.resolved_device()
        group = TPGroup.init(0, layout.tp_size, layout.per_node, layout.init_method, device, RENDEZVOUS_S, args.ep_size)
    except BaseException:
        workers.kill()
        raise
    return workers, group
