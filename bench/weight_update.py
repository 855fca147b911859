"""How long the RL rollout controls keep a serving engine from generating, on one model:

    python -m bench.weight_update [--model smollm2-135m] [--repeats 3]

Times (best of `repeats`, seconds, the engine idle, its defaults otherwise): update_weights_from_disk
(the same checkpoint again: a new model loaded beside the old one, swapped), update_weights_from_tensor
with every weight (as a trainer sends them: fp32 tensors, staged then applied, derived forms rebuilt),
release_memory_occupation and resume_memory_occupation of both tags, and the process RSS each way.
Prints the CPU's vector ISA beside the numbers (AMX / AVX512-BF16 change the rebuild costs).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from pathlib import Path

import psutil

from engine import Engine, SamplingParams, resolve_model


def cpu_isa() -> str:
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    have = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return "+".join(have) or "unknown"


def rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


async def best(repeats: int, call) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t0)
    return min(times)


async def main(model: str, repeats: int) -> None:
    named = list(resolve_model(model).iter_weights())
    sp = SamplingParams(max_new_tokens=8, temperature=0)
    async with Engine(model) as engine:
        want = (await engine.generate("The capital of France is", sp)).token_ids
        disk = await best(repeats, lambda: engine.update_weights_from_disk(model))
        tensor = await best(repeats, lambda: engine.update_weights_from_tensor(named))
        held = rss_mib()
        t0 = time.perf_counter()
        await engine.release_memory_occupation()
        release, released = time.perf_counter() - t0, rss_mib()
        t0 = time.perf_counter()
        await engine.resume_memory_occupation()
        resume = time.perf_counter() - t0
        await engine.update_weights_from_disk(model)  # the tensors above were fp32 dequantized: back to the file's
        same = (await engine.generate("The capital of France is", sp)).token_ids == want
    print(f"model={model} cpu_isa={cpu_isa()} cores={psutil.cpu_count(logical=False)}")
    print(f"update_weights_from_disk   {disk:7.2f} s")
    print(f"update_weights_from_tensor {tensor:7.2f} s  ({len(named)} tensors)")
    print(f"release_memory_occupation  {release:7.2f} s  RSS {held:.0f} -> {released:.0f} MiB")
    print(f"resume_memory_occupation   {resume:7.2f} s")
    print(f"same greedy output after the round trip: {same}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.weight_update")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=3)
    ns = p.parse_args()
    asyncio.run(main(ns.model, ns.repeats))
