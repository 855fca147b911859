"""Scale-out on one machine: data-parallel replicas vs one engine vs tensor parallelism, same run.

Each layout is a real `python -m server` (so DP goes through its routing front end), started with
nothing but its layout flags, and gets the same offline workload (bench.offline's W1 and W2,
greedy, EOS ignored) sent all at once through the native `/generate` API with token ids:

    dp1     one engine, the machine's default torch threads (2 on the 2-core box)
    dp2     --dp-size 2: two replicas (1 thread each), cache-aware routing
    dp2-rr  --dp-size 2 --load-balance-method round_robin (W2 only: what the cache-aware router buys)
    tp      --tp-size N: N ranks (threads split among them); N = the smallest size > 1 that splits the
            model's heads (3 for SmolLM2-135M's 9 query / 3 KV heads), or --tp-size

Prints output tokens/s, the ratio to dp1 and the prompt tokens served from the radix cache.

    python -m bench.scaling                                # W1 and W2, every layout
    python -m bench.scaling --workloads W2 --layouts dp1 dp2 dp2-rr
    python -m bench.scaling --output-file scaling.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from bench.offline import Workload, make_workload
from bench.soak_server import LaunchedServer
from engine import resolve_model

LAYOUTS = ("dp1", "dp2", "dp2-rr", "tp")
READY_TIMEOUT_S = 600.0


@dataclass
class LayoutResult:
    workload: str
    layout: str
    flags: list[str]
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def smallest_tp_size(model_path: str) -> int:
    """The smallest tensor-parallel size > 1 that splits the model's query and KV heads."""
    cfg = resolve_model(model_path).hf_config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    for n in range(2, heads + 1):
        if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0) and cfg.intermediate_size % n == 0:
            return n
    raise SystemExit(f"no tensor-parallel size splits {heads} heads")


def layout_flags(layout: str, tp_size: int) -> list[str]:
    return {
        "dp1": [],
        "dp2": ["--dp-size", "2"],
        "dp2-rr": ["--dp-size", "2", "--load-balance-method", "round_robin"],
        "tp": ["--tp-size", str(tp_size)],
    }[layout]


async def _generate(session: aiohttp.ClientSession, url: str, ids: list[int], n: int) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}
    async with session.post(f"{url}/generate", json=body) as r:
        out = await r.json()
        if r.status != 200:
            raise RuntimeError(f"/generate answered {r.status}: {out}")
        return out["meta_info"]


async def run_layout(wl: Workload, layout: str, flags: list[str], model: str) -> LayoutResult:
    """Start the server, warm it, empty its cache, send the whole workload at once, stop it."""
    extra = [*flags, "--max-running-requests", str(len(wl.prompts)), "--log-level", "warning"]
    server = LaunchedServer(model, extra)
    try:
        await asyncio.to_thread(server.start, READY_TIMEOUT_S)
        url = server.url
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(
                *(_generate(session, url, wl.prompts[0][:16], 4) for _ in range(4))
            )  # warm every replica
            async with session.post(f"{url}/flush_cache") as r:
                await r.read()
            t0 = time.perf_counter()
            metas = await asyncio.gather(*(_generate(session, url, p, n) for p, n in zip(wl.prompts, wl.output_lens)))
            elapsed = time.perf_counter() - t0
    finally:
        server.stop()
    return LayoutResult(
        wl.name,
        layout,
        flags,
        elapsed,
        sum(m["completion_tokens"] for m in metas),
        sum(m["prompt_tokens"] for m in metas),
        sum(m["cached_tokens"] for m in metas),
    )


def report(results: list[LayoutResult]) -> str:
    lines = [f"{'workload':8} {'layout':8} {'tok/s':>8} {'vs dp1':>7} {'cached/prompt':>14}  flags"]
    base = {r.workload: r.tokens_per_s for r in results if r.layout == "dp1"}
    for r in results:
        ratio = f"{r.tokens_per_s / base[r.workload]:.2f}x" if r.workload in base else "-"
        hit = r.cached_tokens / max(r.prompt_tokens, 1)
        lines.append(
            f"{r.workload:8} {r.layout:8} {r.tokens_per_s:8.1f} {ratio:>7} {hit:14.1%}  {' '.join(r.flags) or '-'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[LayoutResult]:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--workloads", nargs="+", default=["W1", "W2"])
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--tp-size", type=int, default=None, help="default: the smallest size that splits the heads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    vocab = resolve_model(args.model_path).hf_config.vocab_size
    tp_size = args.tp_size or smallest_tp_size(args.model_path)
    results = []
    for name in args.workloads:
        wl = make_workload(name, vocab, args.seed)
        for layout in args.layouts:
            if layout == "dp2-rr" and name != "W2":
                continue
            flags = layout_flags(layout, tp_size)
            result = asyncio.run(run_layout(wl, layout, flags, args.model_path))
            print(f"{name} {layout}: {result.tokens_per_s:.1f} tok/s", flush=True)
            results.append(result)
    print(report(results))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump([asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results], f, indent=2)
    return results


if __name__ == "__main__":
    main()
