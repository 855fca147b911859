"""Decode step time by batch size and context length.

    python -m bench.decode_steps [--batches 1 2 4 8 16 32] [--context 500] [--output-len 100]

Why: under light load a stream's inter-token latency is the step time at the batch size of the
moment, so how a step grows with the batch (weights are read once per step, each request adds
its KV reads and its rows of compute) decides how far ITL p99 sits above the median TPOT, and
the same growth sets batched throughput at moderate contexts. For each batch size B, B requests
of `--context` random prompt tokens decode `--output-len` tokens together through the real
scheduler and model runner in one thread (`engine.SyncScheduler`, with the engine's thread
choice: steps of at most 8 tokens leave one of `--threads` free); the median decode step is
printed.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from engine import SamplingParams, ServerArgs, SyncScheduler


def decode_step_ms(sched: SyncScheduler, batch: int, context: int, output_len: int, seed: int) -> float:
    """Median decode step (ms) of `batch` requests of `context` prompt tokens decoding together."""
    rng = random.Random(seed)
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(context)]
        params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
        sched.add_request(prompt, params, seed=i + 1)
    first = len(sched.steps)
    sched.run_until_idle()
    return 1000 * statistics.median(s.end - s.start for s in sched.steps[first:] if s.mode == "DECODE")


def main(argv: list[str] | None = None) -> dict[int, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sched = SyncScheduler.from_args(ServerArgs(model_path=a.model_path, device="cpu"))
    decode_step_ms(sched, 1, 16, 4, seed=0)  # warm-up: first calls at new shapes plan and allocate
    steps = {}
    for batch in a.batches:
        steps[batch] = decode_step_ms(sched, batch, a.context, a.output_len, seed=batch)
        print(f"batch {batch:3d} x {a.context} tokens: decode step {steps[batch]:6.2f} ms", flush=True)
    return steps


if __name__ == "__main__":
    main()
