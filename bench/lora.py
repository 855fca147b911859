"""Multi-LoRA serving throughput against the base model alone, in one run:

    python -m bench.lora [--adapters 1 4 16] [--rank 16] [--max-loras-per-batch N] [--dtype auto]

A W1-shaped workload (bench.offline's W1: 64 requests, prompts U[64, 512], outputs U[32, 256],
greedy, EOS ignored) runs through our `Engine` on the base model, then with its requests spread
round-robin over 1, 4 and 16 rank-`rank` adapters of the default model (every projection adapted,
seeded random A and B, written in PEFT's format), each adapter count a fresh engine with the
adapters given at start-up (`lora_paths`) and every other option at the engine's default (dtype
auto: bf16 where the CPU computes in it, else fp32; `max_loras_per_batch` 8: with 16 adapters the
scheduler bounds the adapters per forward; `--max-loras-per-batch 16` is what a user serving 16
adapters at once would set). The base model runs before and after each adapter count, and each
ratio is against the mean of those two.

Prints output tok/s, the ratio to the base model, the mean decode batch (with more adapters than
`max_loras_per_batch` some requests wait for a slot, so batches are smaller), and the time LoRA
adds to a decode step: for each batch size both runs decoded (from `Engine.recent_steps`), the
mean step with adapters minus the base model's, averaged over the adapter run's steps — the
shrink/expand matmuls and their gathers, compared at equal batch sizes. The CPU's vector ISA is
printed beside the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.lora_adapters import write_adapter
from bench.offline import make_workload
from bench.weight_update import cpu_isa
from engine import Engine, SamplingParams, resolve_model


def run(
    model: str, wl, adapters: list[str], lora_paths: list[str] | None, max_loras: int | None = None, dtype: str = "auto"
) -> tuple[float, dict[int, list[float]], str]:
    """(output tok/s, decode step times in ms by batch size, the dtype it ran in) of `wl`."""
    extra = {} if max_loras is None else {"max_loras_per_batch": max_loras}
    engine = Engine(model, dtype=dtype, max_running_requests=len(wl.prompts), lora_paths=lora_paths, **extra)

    async def main() -> tuple[float, dict[int, list[float]], str]:
        async with engine:
            warm = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
            await engine.generate(wl.prompts[0][:16], warm, lora_path=adapters[0] if adapters else None)
            await engine.flush_cache()
            params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in wl.output_lens]
            names = [adapters[i % len(adapters)] if adapters else None for i in range(len(wl.prompts))]
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(engine.generate(p, sp, lora_path=n) for p, sp, n in zip(wl.prompts, params, names))
            )
            elapsed = time.perf_counter() - t0
            steps: dict[int, list[float]] = defaultdict(list)
            for s in engine.recent_steps():
                if s.mode == "DECODE":
                    steps[s.batch_size].append(1000 * (s.end - s.start))
            ran_in = engine.model_info.dtype
        tokens = sum(r.completion_tokens for r in results)
        if tokens != sum(wl.output_lens):
            raise RuntimeError("a request did not produce its length")
        return tokens / elapsed, dict(steps), ran_in

    return asyncio.run(main())


def mean_batch(steps: dict[int, list[float]]) -> float:
    """The mean rows of a decode step."""
    return sum(b * len(t) for b, t in steps.items()) / max(1, sum(len(t) for t in steps.values()))


def lora_step_cost(with_lora: dict[int, list[float]], base: list[dict[int, list[float]]]) -> float:
    """Mean ms LoRA adds to a decode step: per batch size both sides decoded (8 rows or more, where
    a step's time is mostly matmuls), the adapter run's mean step minus the base runs' mean,
    weighted by the adapter run's step counts."""
    pooled: dict[int, list[float]] = defaultdict(list)
    for run_steps in base:
        for b, times in run_steps.items():
            pooled[b].extend(times)
    pairs = [
        (len(t), statistics.fmean(t) - statistics.fmean(pooled[b]))
        for b, t in with_lora.items()
        if b >= 8 and b in pooled
    ]
    n = sum(count for count, _ in pairs)
    return sum(count * delta for count, delta in pairs) / n if n else float("nan")


def main(argv: list[str] | None = None) -> dict[int, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="the engine's flag (default auto, the engine's default)")
    ap.add_argument(
        "--max-loras-per-batch", type=int, default=None, help="the engine's flag (default: the engine's default, 8)"
    )
    args = ap.parse_args(argv)
    source = resolve_model(args.model_path)
    wl = make_workload("W1", source.hf_config.vocab_size, args.seed)
    max_loras = args.max_loras_per_batch
    # The base model runs before and after each adapter count, and each ratio is against the mean
    # of its two neighbours: a busy machine's speed drifts within a run.
    base = [run(args.model_path, wl, [], None, dtype=args.dtype)]
    print(
        f"model={args.model_path} dtype={base[0][2]} isa={cpu_isa()} rank={args.rank} requests={len(wl.prompts)} "
        f"max_loras_per_batch={max_loras or 'default'}"
    )

    def show_base(result: tuple[float, dict[int, list[float]], str]) -> None:
        print(
            f"  base model       : {result[0]:7.1f} tok/s, mean decode batch {mean_batch(result[1]):5.1f}", flush=True
        )

    show_base(base[0])
    ratios: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.adapters:
            names = [f"a{i}" for i in range(n)]
            for i, name in enumerate(names):
                write_adapter(Path(tmp) / name, source.hf_config, args.rank, args.seed + i)
            paths = [f"{name}={Path(tmp) / name}" for name in names]
            tps, steps, _ = run(args.model_path, wl, names, paths, max_loras, args.dtype)
            base.append(run(args.model_path, wl, [], None, dtype=args.dtype))
            ratios[n] = tps / ((base[-2][0] + base[-1][0]) / 2)
            cost = lora_step_cost(steps, [base[-2][1], base[-1][1]])
            print(
                f"  {n:2d} adapter(s)     : {tps:7.1f} tok/s, {ratios[n]:.2f}x base, mean decode batch "
                f"{mean_batch(steps):5.1f}, LoRA +{cost:.2f} ms a decode step (equal batch sizes)",
                flush=True,
            )
            show_base(base[-1])
    return ratios


if __name__ == "__main__":
    main()
