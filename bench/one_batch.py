"""Micro-benchmark in the spirit of SGLang's bench_one_batch: one static batch at a time.

For each dtype and batch size it measures, in one run, on the same weights:
  - prefill latency of `batch` prompts of `--input-len` tokens,
  - median decode-step latency (forward + greedy sampling) at that context length,
for our model runner (driven by the synchronous scheduler step, so the whole batch prefills at once
and then decodes together) and for transformers' forward with its KV cache; prints ours / theirs.

    python -m bench.one_batch                      # default model, fp32 and bf16, batch 1 8 32 64
    python -m bench.one_batch --dtypes bfloat16 --batch-sizes 32 --threads 2
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.gpu_runs import hf_batch, ours_batch
from bench.offline import load_hf
from engine import ServerArgs, SyncScheduler, resolve_model


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab, (batch, length), generator=g).tolist()


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
    print(
        f"model={args.model_path} input_len={args.input_len} decode_steps={args.decode_steps} "
        f"threads={args.threads} torch={torch.__version__}"
    )
    header = (
        f"{'dtype':>9} {'batch':>5} | {'prefill ours':>12} {'hf':>9} {'ratio':>6} | "
        f"{'decode ours':>11} {'hf':>9} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        max_bs = max(args.batch_sizes)
        tokens = max_bs * (args.input_len + args.decode_steps + 2) + 64
        sync = SyncScheduler.from_args(
            ServerArgs(
                model_path=args.model_path,
                dtype=dtype_name,
                device="cpu",
                max_total_tokens=tokens,
                max_prefill_tokens=tokens,
                chunked_prefill_size=-1,  # the whole batch in one prefill
                disable_radix_cache=True,  # random prompts share nothing
                max_running_requests=max_bs,
                context_length=args.input_len + args.decode_steps + 8,
            )
        )
        hf = load_hf(source, dtype)
        for bs in args.batch_sizes:
            prompts = _prompts(bs, args.input_len, source.hf_config.vocab_size)
            ours_batch(sync, prompts[:1], 2)  # warm-up
            p_ours, d_ours = ours_batch(sync, prompts, args.decode_steps)
            hf_batch(hf, prompts[:1], 2)
            p_hf, d_hf = hf_batch(hf, prompts, args.decode_steps)
            print(
                f"{dtype_name:>9} {bs:>5} | {p_ours * 1e3:>10.1f}ms {p_hf * 1e3:>7.1f}ms {p_ours / p_hf:>6.2f} | "
                f"{d_ours * 1e3:>9.2f}ms {d_hf * 1e3:>7.2f}ms {d_ours / d_hf:>6.2f}",
                flush=True,
            )
        del sync, hf


if __name__ == "__main__":
    main()
