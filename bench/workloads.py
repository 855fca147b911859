"""bench.offline's workloads, their results, and our engine's run on one (`run_ours`).

Shared by every benchmark that compares engines on the same prompts (bench.offline, bench.peer,
bench.peer_vllm, ...): the prompts are token ids drawn with a seed from the model's vocabulary,
so every engine and every run gets identical requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import uvloop

from engine import Engine, SamplingParams


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Skip the first ids: SmolLM2 keeps its special tokens there.
    return [rng.randrange(100, vocab) for _ in range(n)]


FAMILY = tuple(f"M{i}" for i in range(6))


def family_shape(index: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """Member `index` of the mixed family: (requests, prompt length range, output length range).
    M0 is the shape a user tried; the others come from their own seeds, fixed across runs."""
    if index == 0:
        return 32, (64, 384), (32, 160)
    rng = random.Random(1000 + index)
    prompt_lo, output_lo = rng.choice((16, 32, 64, 128)), rng.choice((8, 16, 32, 64))
    prompt = (prompt_lo, prompt_lo * rng.choice((2, 4, 8)))
    output = (output_lo, output_lo * rng.choice((2, 4, 8)))
    return rng.choice((16, 32, 64, 128)), prompt, output


def make_workload(name: str, vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    if name in FAMILY:
        n, (p_lo, p_hi), (o_lo, o_hi) = family_shape(FAMILY.index(name))
        prompts = [_ids(rng, rng.randint(p_lo, p_hi), vocab) for _ in range(n)]
        return Workload(name, prompts, [rng.randint(o_lo, o_hi) for _ in range(n)])
    if name == "W1":
        prompts = [_ids(rng, rng.randint(64, 512), vocab) for _ in range(64)]
        return Workload(name, prompts, [rng.randint(32, 256) for _ in range(64)])
    if name == "W2":
        prompts = []
        for _ in range(8):
            prefix = _ids(rng, 512, vocab)
            prompts += [prefix + _ids(rng, 64, vocab) for _ in range(8)]
        return Workload(name, prompts, [64] * len(prompts))
    if name == "W3":
        return Workload(name, [_ids(rng, 32, vocab) for _ in range(32)], [256] * 32)
    if name == "single":
        return Workload(name, [_ids(rng, 32, vocab)], [128])
    if name == "single200":  # issue 17's end-to-end single-stream shape (200-token prompt, 256 out)
        return Workload(name, [_ids(rng, 200, vocab)], [256])
    raise ValueError(f"unknown workload {name!r}; choose from W1 W2 W3 single single200")


@dataclass
class Result:
    workload: str
    method: str
    seconds: float
    output_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


# ---- ours -----------------------------------------------------------------------------------


def run_ours(wl: Workload, args: argparse.Namespace, disable_radix: bool = False, **options: Any) -> Result:
    """Our engine on `wl`, with the engine's defaults plus `options` (a benchmark comparing one
    option on and off, e.g. bench.flight_recorder): its first pass after a 16-token warm-up."""
    return run_ours_passes(wl, args, 1, disable_radix, **options)[0]


def run_ours_passes(
    wl: Workload, args: argparse.Namespace, rounds: int, disable_radix: bool = False, **options: Any
) -> list[Result]:
    """`rounds` passes of `wl` through one engine (the radix cache flushed before each): the
    first pass (`ours`), what a user's first minutes see, and with `rounds` > 1 the best of the
    later ones (`ours-steady`), once every shape's first-call costs are paid."""
    engine = Engine(
        args.model_path,
        dtype=args.dtype,
        device="cpu",
        torch_threads=args.threads,  # None unless --threads: the engine's default, as a user gets it
        max_running_requests=max(len(wl.prompts), 1),
        disable_radix_cache=disable_radix,
        max_total_tokens=args.max_total_tokens,
        disable_cascade_attention=args.disable_cascade_attention,
        **options,
    )
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in wl.output_lens]

    async def one_pass() -> tuple[float, int, int]:
        await engine.flush_cache()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(wl.prompts, params)))
        elapsed = time.perf_counter() - t0
        bad = [r for r, n in zip(results, wl.output_lens) if r.completion_tokens != n]
        if bad:
            raise RuntimeError(f"{len(bad)} requests did not produce their length, e.g. {bad[0]!r}")
        return elapsed, sum(r.completion_tokens for r in results), sum(r.cached_tokens for r in results)

    async def main() -> list[tuple[float, int, int]]:
        async with engine:
            warm = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
            await engine.generate(wl.prompts[0][:16], warm)  # first-call costs are not throughput
            return [await one_pass() for _ in range(max(rounds, 1))]

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        passes = runner.run(main())
    name = "ours-noradix" if disable_radix else "ours"
    speeds = [round(tokens / elapsed, 1) for elapsed, tokens, _ in passes]
    elapsed, tokens, cached = passes[0]
    out = [Result(wl.name, name, elapsed, tokens, {"cached_prompt_tokens": cached, "passes_tok_s": speeds})]
    if len(passes) > 1:
        elapsed, tokens, cached = min(passes[1:], key=lambda p: p[0])
        out.append(Result(wl.name, f"{name}-steady", elapsed, tokens, {"cached_prompt_tokens": cached}))
    return out
