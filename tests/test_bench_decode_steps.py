"""bench.decode_steps: decode step time by batch size through the real scheduler."""

from __future__ import annotations

import torch

from bench import decode_steps


def test_steps_by_batch_on_the_default_model(capsys):
    before = torch.get_num_threads()
    try:
        steps = decode_steps.main(["--batches", "1", "3", "--context", "24", "--output-len", "4", "--threads", "1"])
    finally:
        torch.set_num_threads(before)
    assert set(steps) == {1, 3} and all(ms > 0 for ms in steps.values())
    assert "batch   3 x 24 tokens: decode step" in capsys.readouterr().out
