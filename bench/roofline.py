"""A workload's time floor on this machine, against our measured time and a peer's rate.

    python -m bench.roofline                                  # W1, default model, bf16
    python -m bench.roofline --workload M2 --run-ours --peer-tok-s 307

Why: a target such as "2x vLLM's CPU backend on W1" can only be met where half the peer's time
is above what the machine allows. This prints the floor: the workload's arithmetic at the best
bf16 (or fp32) GEMM rate measured here on the model's own projection shapes, plus the KV cache
its decode attention must read at the measured read bandwidth. Every engine's time is above it,
so `ceiling / peer rate` bounds any ratio to that peer.

Counted (so the floor is a lower bound on any engine's time):
- prefill: every prompt token through every decoder linear (2 FLOPs a weight), its causal
  attention (QK^T and PV: 4 x heads x head_dim FLOPs per query-key pair), and the LM head once per
  request (its first output token);
- decode: every later output token through every linear and the LM head, and its attention over
  the context so far; attention FLOPs are charged at the GEMM rate too;
- decode's KV reads: each decode token reads its context's K and V once per layer (the batch
  shares weights, never KV).
Not counted: weight reads (at W1's decode batches the arithmetic hides them), norms, rotary,
sampling and scheduling. Dense models only (a MoE model's active weights vary per token).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.floor import read_bandwidth
from bench.workloads import make_workload, run_ours
from engine import default_torch_threads, resolve_model


def model_shapes(cfg) -> dict[str, int | list[tuple[int, int]]]:
    """A dense decoder's projection shapes (in, out) per layer, its layer count, head and KV sizes."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    inter = cfg.intermediate_size
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        raise SystemExit("bench.roofline counts dense models only")
    shapes = [(h, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, h), (h, 2 * inter), (inter, h)]
    return {"shapes": shapes, "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "hidden": h, "vocab": cfg.vocab_size}  # fmt: skip


def gemm_rate(shapes: list[tuple[int, int]], dtype: torch.dtype, threads: int, rows=(64, 512)) -> float:
    """The best FLOP/s of one layer's projections (hot weights; bf16 prepacked for oneDNN, the
    library's rate, which the engine's own VNNI-pair GEMM matches where it runs, docs/PERFORMANCE.md)
    over `rows` rows, best of several passes."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for k, n in shapes]
    if dtype == torch.bfloat16:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]

        def linear(x, i):
            return torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [None], "")
    else:

        def linear(x, i):
            return F.linear(x, weights[i])

    best = 0.0
    for m in rows:
        xs = [torch.randn(m, k, generator=gen).to(dtype) for k, _ in shapes]
        flops = 2 * m * sum(k * n for k, n in shapes)
        for _ in range(2):  # warm-up: primitive creation, page faults
            for i, x in enumerate(xs):
                linear(x, i)
        for _ in range(5):
            t0 = time.perf_counter()
            for i, x in enumerate(xs):
                linear(x, i)
            best = max(best, flops / (time.perf_counter() - t0))
    return best


def workload_counts(wl, m: dict) -> dict[str, float]:
    """FLOPs of prefill and decode and decode's KV bytes for workload `wl` on shapes `m`."""
    per_token = 2 * m["layers"] * sum(k * n for k, n in m["shapes"])
    head = 2 * m["hidden"] * m["vocab"]
    attn_pair = 4 * m["layers"] * m["heads"] * m["head_dim"]  # QK^T and PV per query-key pair
    kv_per_token = 2 * m["layers"] * m["kv_heads"] * m["head_dim"]  # elements of K and V
    prefill = decode = kv = 0.0
    for prompt, out in zip(wl.prompts, wl.output_lens):
        p = len(prompt)
        prefill += p * per_token + attn_pair * p * (p + 1) / 2 + head
        for i in range(1, out):  # token i is decoded at context p + i
            ctx = p + i
            decode += per_token + head + attn_pair * ctx
            kv += kv_per_token * ctx
    return {"prefill_flops": prefill, "decode_flops": decode, "kv_elements": kv}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="default: as Engine() picks them")
    ap.add_argument("--run-ours", action="store_true", help="also time our engine on the workload (one pass)")
    ap.add_argument("--peer-tok-s", type=float, default=None, help="a peer's measured tok/s on this workload")
    a = ap.parse_args(argv)
    threads = a.threads or default_torch_threads()
    dtype = getattr(torch, a.dtype)
    source = resolve_model(a.model_path)
    m = model_shapes(source.hf_config)
    wl = make_workload(a.workload, source.hf_config.vocab_size, 0)
    counts = workload_counts(wl, m)
    rate = gemm_rate(m["shapes"], dtype, threads)
    bandwidth = read_bandwidth(threads)
    kv_bytes = counts["kv_elements"] * dtype.itemsize
    t_prefill = counts["prefill_flops"] / rate
    t_decode = counts["decode_flops"] / rate
    t_kv = kv_bytes / bandwidth
    floor = t_prefill + t_decode + t_kv
    out_tokens = sum(wl.output_lens)
    ceiling = out_tokens / floor
    print(f"{a.workload} on {a.model_path} ({a.dtype}, {threads} threads): {out_tokens} output tokens")
    print(f"  measured: {a.dtype} GEMM {rate / 1e9:.0f} GFLOP/s (one layer's projections, best of 64 and 512 rows)")
    print(f"            read {bandwidth / 1e9:.1f} GB/s")
    print(f"  prefill  {counts['prefill_flops'] / 1e12:6.2f} TFLOP  {t_prefill:6.2f} s")
    print(f"  decode   {counts['decode_flops'] / 1e12:6.2f} TFLOP  {t_decode:6.2f} s")
    print(f"  KV reads {kv_bytes / 1e9:6.1f} GB     {t_kv:6.2f} s")
    print(f"  floor {floor:.2f} s: at most {ceiling:.1f} output tok/s on this machine")
    result = {"ceiling_tok_s": ceiling, "floor_s": floor, "gemm_flops": rate, "bandwidth": bandwidth}
    if a.peer_tok_s:
        print(f"  peer at {a.peer_tok_s:.1f} tok/s is {a.peer_tok_s / ceiling:.0%} of the ceiling: "
              f"no engine can exceed {ceiling / a.peer_tok_s:.2f}x it here")  # fmt: skip
        result["max_ratio_to_peer"] = ceiling / a.peer_tok_s
    if a.run_ours:
        args = argparse.Namespace(model_path=a.model_path, dtype=a.dtype, threads=a.threads, max_total_tokens=None,
                                  disable_cascade_attention=False)  # fmt: skip
        ours = run_ours(wl, args)
        print(f"  ours: {ours.tokens_per_s:.1f} tok/s, {ours.tokens_per_s / ceiling:.0%} of the ceiling")
        result["ours.tokens_per_s"] = ours.tokens_per_s
    return result


if __name__ == "__main__":
    main()
