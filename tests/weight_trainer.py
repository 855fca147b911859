"""A trainer process for the weight-update group tests: `python -m tests.weight_trainer PORT WORLD
FOLDER...` hosts a group of WORLD members (it is rank 0, the engine's ranks 1..WORLD-1) and
broadcasts each folder's weights in turn, in state-dict order (what the engine is told to
expect), then exits 0."""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM

from engine.distributed.weight_sync import broadcast_weights, join_weight_update_group

GROUP = "rl-test"


def state(folder: str) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def main(argv: list[str]) -> int:
    port, world, folders = int(argv[0]), int(argv[1]), argv[2:]
    group = join_weight_update_group("127.0.0.1", port, 0, world, GROUP)
    for folder in folders:
        broadcast_weights(group, state(folder).values())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
