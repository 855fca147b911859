"""GPU benchmark, one command, one run, one table per question:

    python -m bench.gpu                                   # both models, bf16, batch 1 32 256
    python -m bench.gpu --models smollm2-135m --batch-sizes 1 32 --json out.json

Models: the default `smollm2-135m` (GGUF) and a Qwen2.5-0.5B-shaped model with random bf16
weights that transformers builds and saves in a temp dir (with a synthetic word-level tokenizer).
For each, on the same GPU in the same run:

1. decode-step latency (synchronous: schedule + forward + sample + ids on the host) at each batch
   size, context --input-len: ours with CUDA graphs and eager; transformers' forward with its KV
   cache; the memory-bandwidth floor (weights + KV read once, at the measured copy bandwidth).
2. prefill throughput (tokens/s) of the same batches: ours vs transformers (logits_to_keep=1).
3. generation throughput: our Engine (overlap + graphs) vs transformers' `generate_batch`
   (continuous batching), same token prompts, same output length.
4. GPU idle time between consecutive decode steps, overlap on/off x graphs on/off, from a
   torch.profiler trace (bench/gpu_metrics.py). The profiler's own host overhead inflates
   host-bound gaps: compare the settings with each other, not with untraced runs.

A measurement that fails prints `error` in its cell and the reason below the tables; the exit
status is then 1. Without a CUDA device it exits 2 at once.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.gpu_metrics import bandwidth_floor_s, format_table
from bench.gpu_runs import (
    build_random_qwen,
    build_sync,
    decode_profile,
    engine_generate,
    engine_options,
    hf_batch,
    hf_generate_batch,
    load_hf,
    measure_copy_bandwidth,
    ours_batch,
    parameter_count,
    random_prompts,
    w1_prompts,
)

QWEN_RANDOM = "qwen2.5-0.5b-random"
MODELS = ("smollm2-135m", QWEN_RANDOM)
ERRORS: list[str] = []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=list(MODELS), help=f"{MODELS[0]}, {QWEN_RANDOM}, or a model path")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32, 256])
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens per request = decode context")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument(
        "--throughput-workload",
        default="W1x8",
        help="W1xN: bench.offline's W1 prompts N times over (64N requests, U[64, 512] tokens); "
        "uniform: --throughput-requests prompts of --input-len",
    )
    ap.add_argument("--throughput-requests", type=int, default=256, help="with --throughput-workload uniform")
    ap.add_argument("--output-len", type=int, default=128, help="new tokens per request in the throughput runs")
    ap.add_argument("--idle-batch", type=int, default=32, help="requests in the traced (idle-time) runs")
    ap.add_argument("--idle-steps", type=int, default=24, help="decode steps per traced run")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers baselines")
    ap.add_argument("--json", type=Path, help="also write every number to this file")
    args = ap.parse_args(argv)
    for name in ("input_len", "decode_steps", "throughput_requests", "output_len", "idle_batch", "idle_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error("--batch-sizes must be >= 1")
    scale = args.throughput_workload.removeprefix("W1x")
    if args.throughput_workload != "uniform" and not (scale.isdigit() and int(scale) >= 1):
        ap.error(f"--throughput-workload must be uniform or W1xN with N >= 1, not {args.throughput_workload!r}")
    return args


def require_cuda() -> torch.device:
    """The GPU, or exit 2 with a message saying why there is none."""
    if not torch.cuda.is_available():
        print(
            f"bench.gpu needs a CUDA GPU, and torch.cuda.is_available() is False here (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); run it on a machine with a GPU.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return torch.device("cuda")


def attempt(label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args), or the string 'error' (and the reason in ERRORS) if it raises: one failure keeps
    the rest. Progress goes to stderr, so a long run shows where it is."""
    t0 = time.perf_counter()
    try:
        value = fn(*args, **kwargs)
        shown = f" -> {value!r}"[:120] if isinstance(value, float | int | tuple) else ""
        print(f"[{time.perf_counter() - t0:6.1f}s] {label}{shown}", file=sys.stderr, flush=True)
        return value
    except Exception as e:
        print(f"[{time.perf_counter() - t0:6.1f}s] {label}: FAILED {e!r}", file=sys.stderr, flush=True)
        ERRORS.append(f"{label}: {type(e).__name__}: {e}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return "error"


# ---- one model ----------------------------------------------------------------------------------


def _free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_model(name: str, args: argparse.Namespace, bandwidth: float, tmp: Path) -> dict[str, list[list[Any]]]:
    from engine import resolve_model

    path = build_random_qwen(tmp / "qwen") if name == QWEN_RANDOM else name
    source = resolve_model(path)
    cfg = source.hf_config
    vocab = cfg.vocab_size
    if args.throughput_workload == "uniform":
        tp_prompts = random_prompts(args.throughput_requests, args.input_len, vocab, seed=1)
    else:
        tp_prompts = w1_prompts(int(args.throughput_workload.removeprefix("W1x")), vocab)
    max_bs = max(*args.batch_sizes, len(tp_prompts), args.idle_batch)
    longest = max(args.input_len, *map(len, tp_prompts))
    context = longest + max(args.decode_steps, args.output_len, args.idle_steps) + 16
    options = engine_options(max_bs, context, max_bs * context + 64)
    hf = None if args.skip_hf else attempt(f"{name} load transformers", load_hf, source)
    weight_bytes = 2 * parameter_count(cfg)  # bf16
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * 2  # K and V, bf16
    out: dict[str, list[list[Any]]] = {"decode": [], "prefill": [], "throughput": [], "idle": [], "profile": []}
    profiles: dict[str, Any] = {}
    batches = {bs: random_prompts(bs, args.input_len, vocab, seed=bs) for bs in args.batch_sizes}
    timings: dict[tuple[int, bool], Any] = {}
    for graphs in (True, False):
        kind = "graphs" if graphs else "eager"
        sync = attempt(f"{name} build ({kind})", build_sync, path, **{**options, "disable_cuda_graph": not graphs})
        for bs, prompts in batches.items():
            if sync == "error":
                timings[bs, graphs] = "error"
                continue
            # The same batch first: Triton specializes kernels on their integer arguments (a batch of 1
            # and of 32 compile apart), so a smaller warm-up would leave compiles inside the timing.
            attempt(f"{name} bs={bs} warm-up", ours_batch, sync, prompts, 2)
            timings[bs, graphs] = attempt(f"{name} bs={bs} ours {kind}", ours_batch, sync, prompts, args.decode_steps)
        if sync != "error":  # where a small batch's step time goes (host vs kernels), per setting
            prof = attempt(f"{name} bs={min(batches)} {kind} profile", decode_profile, sync, batches[min(batches)], 8)
            out["profile"].append([name, kind, *_profile_cells(prof)])
            profiles[kind] = prof
        del sync
        _free_gpu()
    for bs, prompts in batches.items():
        g, e = timings[bs, True], timings[bs, False]
        h = "error"
        if hf not in (None, "error"):
            attempt(f"{name} bs={bs} transformers warm-up", hf_batch, hf, prompts, 2)
            h = attempt(f"{name} bs={bs} transformers", hf_batch, hf, prompts, args.decode_steps)
        ctx = [args.input_len + args.decode_steps // 2 + 1] * bs  # the median step's context
        floor = bandwidth_floor_s(weight_bytes, kv_per_token, ctx, bandwidth)
        ms = {k: (v[1] * 1e3 if isinstance(v, tuple) else None) for k, v in (("g", g), ("e", e), ("h", h))}
        out["decode"].append(
            [
                name,
                bs,
                floor * 1e3,
                ms["g"],
                ms["e"],
                None if hf is None else ms["h"],
                ms["g"] / (floor * 1e3) if ms["g"] else None,
            ]
        )
        tok = bs * args.input_len
        tps = {k: (tok / v[0] if isinstance(v, tuple) else None) for k, v in (("g", g), ("h", h))}
        speedup = tps["g"] / tps["h"] if tps["g"] and tps["h"] else None
        out["prefill"].append([name, bs, tok, tps["g"], tps["h"], speedup])
    prompts = tp_prompts
    ours_tps = attempt(f"{name} engine throughput", engine_generate, path, options, prompts, args.output_len, True)
    hf_r = None
    if hf not in (None, "error"):
        hf_r = attempt(f"{name} transformers generate_batch", hf_generate_batch, hf, prompts, args.output_len)
    hf_tps, hf_len = hf_r if isinstance(hf_r, tuple) else (hf_r, None)
    ratio = ours_tps / hf_tps if isinstance(ours_tps, float) and isinstance(hf_tps, float) else None
    out["throughput"].append(
        [name, f"{args.throughput_workload} ({len(prompts)} req)+{args.output_len}", ours_tps, hf_tps, hf_len, ratio]
    )
    idle_prompts = random_prompts(args.idle_batch, min(args.input_len, 128), vocab, seed=2)
    for overlap in (True, False):
        for graphs in (True, False):
            trace = tmp / f"trace-{overlap}-{graphs}.json"
            opts = {**options, "disable_cuda_graph": not graphs}
            label = f"{name} idle overlap={overlap} graphs={graphs}"
            r = attempt(label, engine_generate, path, opts, idle_prompts, args.idle_steps, overlap, trace)
            frac, gap, pairs = r if isinstance(r, tuple) else ("error", None, None)
            if pairs == 0:  # no two consecutive decode steps with GPU work in the trace
                frac = gap = None
            out["idle"].append(
                [
                    name,
                    "on" if overlap else "off",
                    "on" if graphs else "off",
                    frac * 100 if isinstance(frac, float) else frac,
                    gap,
                    pairs,
                ]
            )
    del hf
    _free_gpu()
    for kind, prof in profiles.items():
        if isinstance(prof, dict):
            host = format_table(["op", "calls", "us"], prof["top_host_us"])
            kernels = format_table(["kernel", "calls", "us"], prof["top_kernels_us"])
            print(f"\n{name} {kind}, smallest batch: host ops (per step)\n{host}\ntop kernels (per step)\n{kernels}")
    out["profile_detail"] = [[name, kind, prof] for kind, prof in profiles.items()]
    return out


def _profile_cells(prof: Any) -> list[Any]:
    if not isinstance(prof, dict):
        return [prof] * 4
    share = prof["kernel_us"] / prof["wall_us"] * 100 if prof["wall_us"] else None
    return [prof["wall_us"], prof["kernel_us"], prof["kernels"], share]


TABLES = {
    "decode": (
        "decode step (ms, synchronous)",
        ["model", "batch", "floor", "ours graphs", "ours eager", "transformers", "graphs/floor"],
    ),
    "prefill": ("prefill throughput (tokens/s)", ["model", "batch", "tokens", "ours", "transformers", "ours/tf"]),
    "throughput": (
        "generation throughput (output tokens/s)",
        ["model", "workload+out", "ours", "tf generate_batch", "tf out/req", "ours/tf"],
    ),
    "profile": (
        "one decode step at the smallest batch, profiled (per step)",
        ["model", "setting", "wall us", "kernel us", "kernels", "kernel % of wall"],
    ),
    "idle": (
        "GPU idle between consecutive decode steps (traced)",
        ["model", "overlap", "graphs", "idle %", "mean gap us", "step pairs"],
    ),
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = require_cuda()
    import transformers
    import triton

    bandwidth = measure_copy_bandwidth(device)
    print(
        f"{torch.cuda.get_device_name(device)} | torch {torch.__version__} triton {triton.__version__} "
        f"transformers {transformers.__version__} | copy bandwidth {bandwidth / 1e9:.0f} GB/s | bf16 | "
        f"input_len={args.input_len} decode_steps={args.decode_steps} | {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    results: dict[str, list[list[Any]]] = {k: [] for k in TABLES}
    details: list[list[Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            r = attempt(f"{name}", bench_model, name, args, bandwidth, Path(tmp))
            for k in TABLES:
                results[k] += r[k] if isinstance(r, dict) else []
            details += r["profile_detail"] if isinstance(r, dict) else []
            if args.json is not None:  # after each model: a run cut short keeps what it measured
                report = {"bandwidth": bandwidth, **results, "profile_detail": details, "errors": ERRORS}
                args.json.write_text(json.dumps(report, indent=1, default=str))
    for key, (title, header) in TABLES.items():
        print(f"\n{title}\n{format_table(header, results[key])}")
    if ERRORS:
        print("\nerrors:", *ERRORS, sep="\n  ")
    return 1 if ERRORS else 0


if __name__ == "__main__":
    sys.exit(main())
