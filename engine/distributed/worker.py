"""`python -m engine.distributed.worker`: one tensor-parallel rank other than 0.

It builds the same `ModelRunner` as rank 0 (its shard of the weights, its share of each KV
slot's heads) and then loops: receive a step from rank 0, run the same forward, take part in
its collectives, keep the sampled ids. Any error ends the process with status 1: its peers'
collectives then fail at once (closed sockets), which rank 0 turns into a dead engine, never a
hang. Started by engine/distributed/launcher.py; not a user command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

from engine.child_process import exit_when_orphaned
from engine.distributed.launcher import RENDEZVOUS_S
from engine.distributed.parallel_state import TPGroup
from engine.distributed.step_message import RANK_CALLS, TPRunnerCall, TPStop, TPUpdateTensors, TPUpdateWeights, decode
from engine.errors import EngineError
from engine.model_executor.model_runner import ModelRunner
from engine.server_args import ServerArgs

log = logging.getLogger("engine.distributed.worker")


def serve_steps(runner: ModelRunner) -> str:
    """Run rank 0's steps until it says stop; why it stopped."""
    while True:
        msg = decode(runner.tp.broadcast_bytes(None))
        if isinstance(msg, TPStop):
            return msg.reason
        if isinstance(msg, (TPUpdateWeights, TPUpdateTensors, TPRunnerCall)):
            try:
                if isinstance(msg, TPUpdateWeights):
                    runner.update_weights_from_disk(msg.model_path)
                elif isinstance(msg, TPUpdateTensors):
                    runner.receive_tensor_update(msg)
                elif msg.method in RANK_CALLS:
                    getattr(runner, msg.method)(**msg.kwargs)
            except EngineError as e:  # rank 0 failed it too (the ranks agree): the old state serves on
                log.warning("%s refused: %s", type(msg).__name__, e)
            continue
        runner.run_worker_step(msg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.distributed.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--local-size", type=int, required=True)
    p.add_argument("--options", required=True, help="the engine's ServerArgs as JSON")
    p.add_argument("--parent-pid", type=int, required=True, help="the process that started this rank")
    ns = p.parse_args(argv)
    # Forked from whichever thread loaded the model (so no PR_SET_PDEATHSIG): a rank whose engine was
    # killed must not wait out a rendezvous or a forward; a collective fails too, but not mid-load.
    exit_when_orphaned(ns.parent_pid)
    args = ServerArgs(**json.loads(ns.options))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{ns.rank} %(name)s: %(message)s")
    torch.set_num_threads(ns.threads)
    device = args.resolved_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        tp = TPGroup.init(ns.rank, args.tp_size, ns.local_size, ns.init_method, device, RENDEZVOUS_S, args.ep_size)
        runner = ModelRunner(args, tp=tp)
        reason = serve_steps(runner)
    except Exception:
        log.exception("tensor-parallel rank %d failed; leaving the group", ns.rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: a half-torn gloo group must not block the exit
    log.info("tensor-parallel rank %d stopping: %s", ns.rank, reason)
    tp.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
