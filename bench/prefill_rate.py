"""Prefill FLOP/s of one chunk against this machine's GEMM rate (issue 33's prefill target).

    python -m bench.prefill_rate                                   # default model, a 2,048-token chunk
    python -m bench.prefill_rate --model-path /tmp/llama1b-rand --chunk 2048 --passes 4

Why: prefill is GEMM work, so its honest yardstick is the fastest GEMM this CPU runs on the model's
own projection shapes (bench.roofline's `gemm_rate`: hot weights, prepacked for oneDNN in bf16,
AMX where oneDNN finds it), not another engine. This times whole prefill forwards of one prompt of
`--chunk` tokens (a full chunk: the engine's default `chunked_prefill_size`) through the real
scheduler and model runner in one thread (`engine.SyncScheduler`, the radix cache off so every
pass prefills the whole prompt), counts the forward's arithmetic as bench.roofline does (every
decoder linear, causal attention's QK^T and PV, the LM head on the last position) and prints its
FLOP/s as a share of that rate: the first pass (what a user's first request sees) and the best later
pass. Everything else a forward does (norms, rotary, KV stores, sampling) is in the measured time,
not in the counted FLOPs, so the share is a lower bound on how well the GEMMs themselves run.
"""

from __future__ import annotations

import argparse

import torch

from bench.roofline import gemm_rate, model_shapes, workload_counts
from bench.workloads import Workload
from engine import SamplingParams, ServerArgs, SyncScheduler, default_torch_threads, resolve_model


def chunk_flops(m: dict, n: int) -> float:
    """FLOPs of one prefill forward of `n` tokens on shapes `m`: bench.roofline's count for a
    one-request workload whose prompt is the chunk."""
    return workload_counts(Workload("chunk", [[0] * n], [1]), m)["prefill_flops"]


def prefill_seconds(model_path: str, dtype: str, chunk: int, passes: int, seed: int = 0) -> list[float]:
    """Seconds of each of `passes` prefill forwards of one `chunk`-token prompt (random ids, seeded)."""
    source = resolve_model(model_path)
    args = ServerArgs(model_path=model_path, dtype=dtype, device="cpu", disable_radix_cache=True,
                      chunked_prefill_size=chunk, max_running_requests=1)  # fmt: skip
    sched = SyncScheduler.from_args(args)
    gen = torch.Generator().manual_seed(seed)
    times = []
    for i in range(passes):
        ids = torch.randint(0, source.hf_config.vocab_size, (chunk,), generator=gen).tolist()
        sched.add_request(ids, SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True), seed=i + 1)
        done = len(sched.steps)
        sched.run_until_idle()
        extends = [s for s in sched.steps[done:] if s.mode == "EXTEND"]
        assert len(extends) == 1 and extends[0].num_tokens == chunk, "the prompt must prefill as one chunk"
        times.append(extends[0].end - extends[0].start)
    return times


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="default: as Engine() picks them")
    ap.add_argument("--chunk", type=int, default=2048, help="prompt tokens, prefilled as one chunk")
    ap.add_argument("--passes", type=int, default=4, help="prefill forwards timed (the first and the best later one)")
    a = ap.parse_args(argv)
    if a.passes < 2:
        ap.error("--passes must be at least 2 (the first pass and a later one)")
    threads = a.threads or default_torch_threads()
    torch.set_num_threads(threads)
    m = model_shapes(resolve_model(a.model_path).hf_config)
    rate = gemm_rate(m["shapes"], getattr(torch, a.dtype), threads, rows=(64, 512, a.chunk))
    times = prefill_seconds(a.model_path, a.dtype, a.chunk, a.passes)
    flops = chunk_flops(m, a.chunk)
    first, steady = flops / times[0], flops / min(times[1:])
    print(f"prefill of {a.chunk} tokens on {a.model_path} ({a.dtype}, {threads} threads): {flops / 1e12:.3f} TFLOP")
    print(f"  GEMM rate measured here: {rate / 1e9:.0f} GFLOP/s (one layer's projections, prepacked, hot)")
    print(f"  first pass  {times[0]:7.3f} s  {first / 1e9:6.0f} GFLOP/s  {first / rate:5.0%} of the GEMM rate")
    print(f"  best later  {min(times[1:]):7.3f} s  {steady / 1e9:6.0f} GFLOP/s  {steady / rate:5.0%} of the GEMM rate")
    return {"gemm_flops": rate, "first_share": first / rate, "steady_share": steady / rate, "chunk_flops": flops}


if __name__ == "__main__":
    main()
