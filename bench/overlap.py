"""Overlap benchmark: how close the decode loop gets to back-to-back forwards.

For each setting (overlap on, overlap off) one engine runs `--batch` requests of `--input-len`
prompt tokens and `--output-len` new tokens (greedy, EOS ignored), all submitted at once. Every
forward is timed where it runs (on the device stream's thread; `Engine.recent_steps()`), so we
know the time the device was busy with decode forwards. The printed ratio is

    decode-phase wall time per step / forward-only time per step

where the decode phase runs from the start of the first decode forward to the end of the last.
1.00 means the scheduler added nothing between forwards; SGLang's target for its overlap
scheduler is "zero overhead". Target here: <= 1.10 with overlap on.

    python -m bench.overlap                            # default model, batch 32
    python -m bench.overlap --batch 32 --output-len 64 --threads 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import uvloop

from engine import Engine, SamplingParams


async def run_one(args: argparse.Namespace, overlap: bool) -> dict[str, float]:
    engine = Engine(
        args.model,
        dtype=args.dtype,
        device="cpu",
        torch_threads=args.threads,
        enable_overlap=overlap,
        max_running_requests=max(64, args.batch),
    )
    async with engine:
        rng = random.Random(0)
        vocab = engine.model_info.vocab_size
        prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.batch)]
        params = SamplingParams(temperature=0.0, max_new_tokens=args.output_len, ignore_eos=True)
        await engine.generate(prompts[0][:8], SamplingParams(max_new_tokens=4))  # warm-up
        begin = time.perf_counter()
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        spans = [(s.start, s.end, s.mode == "DECODE") for s in engine.recent_steps() if s.start >= begin]
    decode = [(s, e) for s, e, d in spans if d]
    start, end = decode[0][0], decode[-1][1]
    wall = end - start
    # Every forward inside the decode phase counts as device time: a prefill of a late arrival
    # is work, not scheduler overhead. What is left of the wall time is the gaps between forwards.
    busy = sum(e - s for s, e, _ in spans if s >= start and e <= end)
    steps = len(decode)
    return {"steps": steps, "wall_ms": wall / steps * 1e3, "fwd_ms": busy / steps * 1e3, "ratio": wall / busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the forward thread (default: Engine's)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per setting; best is kept")
    args = ap.parse_args()
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for _ in range(args.repeats):
            for overlap in (True, False):
                results[overlap].append(runner.run(run_one(args, overlap)))
    print(
        f"model={args.model} dtype={args.dtype} batch={args.batch} in={args.input_len} "
        f"out={args.output_len} threads={args.threads}"
    )
    print(f"{'overlap':>8} {'steps':>6} {'wall/step ms':>13} {'fwd/step ms':>12} {'wall/fwd':>9}")
    for overlap in (True, False):
        best = min(results[overlap], key=lambda r: r["ratio"])
        print(
            f"{'on' if overlap else 'off':>8} {best['steps']:>6} {best['wall_ms']:>13.2f} "
            f"{best['fwd_ms']:>12.2f} {best['ratio']:>9.3f}"
        )


if __name__ == "__main__":
    main()
