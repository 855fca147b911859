"""Micro-benchmark in the spirit of SGLang's bench_one_batch: one static batch, no scheduler.

For each dtype and batch size it measures, in one run, on the same weights:
  - prefill latency of `batch` prompts of `--input-len` tokens,
  - median decode-step latency (forward + greedy sampling) at that context length,
for our ModelRunner and for transformers' forward with its KV cache, and prints ours / theirs.

    python -m bench.one_batch                      # default model, fp32 and bf16, batch 1 8 32 64
    python -m bench.one_batch --dtypes bfloat16 --batch-sizes 32 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from bench.offline import load_hf  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.models.loader import resolve_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.schedule_batch import Req, ScheduleBatch  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab, (batch, length), generator=g).tolist()


def bench_ours(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode-step seconds); frees everything afterwards."""
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 1)
    reqs = [Req(f"b{i}", p, params, seed=i, max_context_len=runner.context_len) for i, p in enumerate(prompts)]
    for r in reqs:
        r.init_next_round_input()
    batch = ScheduleBatch.init_new(reqs, pool, alloc, None, runner.model_config.vocab_size)
    assert batch.prepare_for_extend(), "KV pool too small for the benchmark"
    t0 = time.perf_counter()
    out = runner.forward_batch_generation(batch.get_model_worker_batch())
    prefill = time.perf_counter() - t0
    for r, t in zip(reqs, out.next_token_ids.tolist()):
        r.output_ids.append(t)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        assert batch.prepare_for_decode()
        out = runner.forward_batch_generation(batch.get_model_worker_batch())
        ids = out.next_token_ids.tolist()  # the scheduler needs the ids on the host each step
        times.append(time.perf_counter() - t0)
        for r, t in zip(reqs, ids):
            r.output_ids.append(t)
    for r in reqs:
        alloc.free(pool.req_to_token[r.req_pool_idx, : r.kv_committed_len].to(torch.int64))
        pool.free(r.req_pool_idx)
    return prefill, statistics.median(times)


@torch.inference_mode()
def bench_hf(model, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    ids = torch.tensor(prompts)
    cache = DynamicCache()
    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
    prefill = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
        nxt.tolist()
        times.append(time.perf_counter() - t0)
    return prefill, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    source = resolve_model(args.model_path)
    print(f"model={args.model_path} input_len={args.input_len} decode_steps={args.decode_steps} "
          f"threads={args.threads} torch={torch.__version__}")  # fmt: skip
    header = f"{'dtype':>9} {'batch':>5} | {'prefill ours':>12} {'hf':>9} {'ratio':>6} | {'decode ours':>11} {'hf':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        max_bs = max(args.batch_sizes)
        tokens = max_bs * (args.input_len + args.decode_steps + 2) + 64
        runner = ModelRunner(
            ServerArgs(model_path=args.model_path, dtype=dtype_name, device="cpu", max_total_tokens=tokens,
                       max_running_requests=max_bs, context_length=args.input_len + args.decode_steps + 8),
            source,
        )  # fmt: skip
        hf = load_hf(source, dtype)
        for bs in args.batch_sizes:
            prompts = _prompts(bs, args.input_len, runner.model_config.vocab_size)
            bench_ours(runner, prompts[:1], 2)  # warm-up
            p_ours, d_ours = bench_ours(runner, prompts, args.decode_steps)
            bench_hf(hf, prompts[:1], 2)
            p_hf, d_hf = bench_hf(hf, prompts, args.decode_steps)
            print(
                f"{dtype_name:>9} {bs:>5} | {p_ours * 1e3:>10.1f}ms {p_hf * 1e3:>7.1f}ms {p_ours / p_hf:>6.2f} | "
                f"{d_ours * 1e3:>9.2f}ms {d_hf * 1e3:>7.2f}ms {d_ours / d_hf:>6.2f}",
                flush=True,
            )
        del runner, hf



if __name__ == "__main__":
    main()
