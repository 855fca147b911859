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

Prints output tok/s, the ratio to the base model, and the time LoRA adds to a decode step: the
mean decode step (batches of 32-64 rows, from `Engine.recent_steps`) with adapters minus the
base model's, which is the shrink/expand matmuls and their gathers. The CPU's vector ISA is
printed beside the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.lora_adapters import write_adapter
from bench.offline import make_workload
from bench.weight_update import cpu_isa
from engine import Engine, SamplingParams, resolve_model


def run(
    model: str, wl, adapters: list[str], lora_paths: list[str] | None, max_loras: int | None = None, dtype: str = "auto"
) -> tuple[float, float, str]:
    """(output tok/s, mean decode step in ms over batches of 32-64 rows, the dtype it ran in) of `wl`."""
    extra = {} if max_loras is None else {"max_loras_per_batch": max_loras}
    engine = Engine(model, dtype=dtype, max_running_requests=len(wl.prompts), lora_paths=lora_paths, **extra)

    async def main() -> tuple[float, float, str]:
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
            steps = [s for s in engine.recent_steps() if s.mode == "DECODE" and 32 <= s.batch_size <= 64]
            ran_in = engine.model_info.dtype
        tokens = sum(r.completion_tokens for r in results)
        if tokens != sum(wl.output_lens):
            raise RuntimeError("a request did not produce its length")
        step_ms = statistics.fmean(1000 * (s.end - s.start) for s in steps) if steps else float("nan")
        return tokens / elapsed, step_ms, ran_in

    return asyncio.run(main())


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
    print(f"  base model       : {base[0][0]:7.1f} tok/s, decode step {base[0][1]:6.2f} ms", flush=True)
    ratios: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.adapters:
            names = [f"a{i}" for i in range(n)]
            for i, name in enumerate(names):
                write_adapter(Path(tmp) / name, source.hf_config, args.rank, args.seed + i)
            paths = [f"{name}={Path(tmp) / name}" for name in names]
            tps, step, _ = run(args.model_path, wl, names, paths, max_loras, args.dtype)
            base.append(run(args.model_path, wl, [], None, dtype=args.dtype))
            base_tps = (base[-2][0] + base[-1][0]) / 2
            base_step = (base[-2][1] + base[-1][1]) / 2
            ratios[n] = tps / base_tps
            print(
                f"  {n:2d} adapter(s)     : {tps:7.1f} tok/s, {ratios[n]:.2f}x base, decode step {step:6.2f} ms "
                f"(LoRA +{step - base_step:.2f} ms)",
                flush=True,
            )
            print(f"  base model       : {base[-1][0]:7.1f} tok/s, decode step {base[-1][1]:6.2f} ms", flush=True)
    return ratios


if __name__ == "__main__":
    main()
