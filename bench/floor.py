"""The single-stream (batch 1) decode step against the memory-bandwidth floor (issue 17, item 3).

A bs-1 decode step must read every weight it multiplies by once: nothing is reused across rows,
so its time can never be below

    floor = bytes one step reads / read bandwidth of this machine (same thread count)

Bytes per step: each linear in the form the bs-1 path runs (the packed 4-bit blocks and scales of
an int4 layer; the bf16/fp32 weight of a dense or oneDNN one), a MoE layer's router and its top-k
experts (in blocks or dense), the LM head, one embedding row, and the KV cache of the context.
Bandwidth: the best of several sums over a 512 MiB buffer (a pure streaming read) with the bs-1
forward's thread count (as the engine measured it for small forwards). The step time: the median
decode forward of one request (200-token prompt, 256 tokens; `SyncScheduler`, so forwards are
timed one by one).

    python -m bench.floor                    # engine defaults (bf16, threads as Engine() picks)
    python -m bench.floor --dtype float32 --prompt-len 32 --output-len 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import SamplingParams, ServerArgs, SyncScheduler, default_torch_threads, resolve_model

BUFFER_BYTES = 512 * 2**20


def read_bandwidth(threads: int, repeats: int = 7) -> float:
    """Bytes per second of a streaming read (`sum` of a buffer far larger than the caches)."""
    torch.set_num_threads(threads)
    buf = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return BUFFER_BYTES / best


def weight_bytes_per_step(model: torch.nn.Module, rows: int = 1) -> dict[str, int]:
    """Bytes of weights a forward of `rows` rows reads, by kind (the linears' run-time forms)."""
    out = {"int4 linears": 0, "dense linears": 0, "routed experts": 0, "lm head": 0, "embedding row": 0}
    inside_quant: list[str] = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if any(name.startswith(prefix + ".") for prefix in inside_quant):
            continue  # a quantized layer's fallback: not read for `rows` <= its bound
        tiles = kind == "QuantLinear" and type(module.big).__name__ == "DequantTilesLinear"  # blocks at any rows
        if kind == "QuantLinear" and (rows <= module.max_rows or tiles):
            inside_quant.append(name)
            out["lm head" if name.endswith("lm_head") else "int4 linears"] += module.packed.nbytes
        elif kind in ("DenseLinear", "OneDNNLinear", "VnniLinear", "QuantLinear"):
            size = module.out_features * module.in_features * _dtype_bytes(module)
            out["lm head" if name.endswith("lm_head") else "dense linears"] += size
        elif kind == "FusedMoE":  # the router, and each row's top-k experts (distinct ones at most all)
            experts = module.num_local_experts
            quant = module.quant
            per_expert = quant.nbytes / experts if quant is not None else (module.w13[0].nbytes + module.w2[0].nbytes)
            routed = min(experts, rows * module.top_k)
            out["routed experts"] += int(routed * per_expert) + module.gate.nbytes
        elif kind == "VocabEmbedding":
            out["embedding row"] += module.weight.shape[1] * module.weight.element_size() * rows
    return out


def _dtype_bytes(module: torch.nn.Module) -> int:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.element_size()
    bias = getattr(module, "bias", None)
    return bias.element_size() if isinstance(bias, torch.Tensor) else 2  # oneDNN's and VNNI pairs are bf16


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None, help="default: as Engine() picks them")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args(argv)
    threads = args.threads or default_torch_threads()
    torch.set_num_threads(threads)
    sched = SyncScheduler.from_args(ServerArgs(model_path=args.model_path, dtype=args.dtype, device="cpu"))
    runner = sched.runner
    vocab = resolve_model(args.model_path).hf_config.vocab_size
    prompt = [100 + (i * 7919) % (vocab - 100) for i in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.output_len, ignore_eos=True)
    sched.add_request(prompt[:16], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    sched.run_until_idle()  # warm-up: first-call costs are not a step
    sched.steps.clear()
    sched.add_request(prompt, params)
    sched.run_until_idle()
    decode = [s.end - s.start for s in sched.steps if s.mode == "DECODE"]
    step_s = statistics.median(decode)
    cfg = runner.model_config
    weights = weight_bytes_per_step(runner.model)
    context = args.prompt_len + args.output_len // 2  # the median step's context
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * runner.dtype.itemsize
    total = sum(weights.values()) + kv_bytes
    # a forward of one token runs with the threads the engine measured for small forwards at
    # start-up (StepThreads: all, or one fewer to leave a core to the event loop)
    step_threads = runner.step_threads.threads_for(1, threads) if runner.step_threads is not None else threads
    bandwidth = read_bandwidth(step_threads)
    floor_s = total / bandwidth
    print(
        f"model={args.model_path} dtype={str(runner.dtype).removeprefix('torch.')} threads={threads} "
        f"(bs-1 step: {step_threads}) int4 rows<={runner.q4_max_tokens} "
        f"fused decode: {'on' if runner.model.fused_decode is not None else 'off'}"
    )
    for kind, n in [*weights.items(), ("kv cache (median step)", kv_bytes)]:
        print(f"  {kind:>24}: {n / 1e6:8.1f} MB")
    print(f"  {'bytes per step':>24}: {total / 1e6:8.1f} MB; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(
        f"bs-1 decode step: {step_s * 1e3:.2f} ms median ({1 / step_s:.1f} tok/s); floor {floor_s * 1e3:.2f} ms "
        f"({1 / floor_s:.0f} tok/s): {step_s / floor_s:.2f}x the floor"
    )
    return {"step_ms": step_s * 1e3, "floor_ms": floor_s * 1e3, "bytes": total, "bandwidth": bandwidth}


if __name__ == "__main__":
    main()
