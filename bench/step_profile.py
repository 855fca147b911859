"""Where a workload's time goes: per-forward timings and the torch profiler's top ops.

    python -m bench.step_profile --workload W2 [--model-path smollm2-135m] [--dtype bfloat16] [--threads 2] [--profile]

Runs a bench.offline workload through the real scheduler and model runner in one thread
(`engine.SyncScheduler`, the synchronous step: no overlap), so the forward passes can be timed
one by one and profiled (the torch profiler only sees the thread it was started in, which in
the `Engine` is the forward thread). Prints the time in prefill and decode forwards, decode step
time by batch-size band, and with --profile the top ops by self CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict

import torch

from bench.offline import FAMILY, make_workload
from engine import SamplingParams, ServerArgs, SyncScheduler, resolve_model


def run(workload: str, dtype: str, threads: int, profile: bool, **engine_kw) -> None:
    torch.set_num_threads(threads)
    source = resolve_model(engine_kw.get("model_path", "smollm2-135m"))
    wl = make_workload(workload, source.hf_config.vocab_size, 0)
    args = ServerArgs(dtype=dtype, device="cpu", max_running_requests=max(len(wl.prompts), 1), **engine_kw)
    sched = SyncScheduler.from_args(args)
    for i, (ids, n) in enumerate(zip(wl.prompts, wl.output_lens)):
        sched.add_request(ids, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), seed=i + 1)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    t_start = time.perf_counter()
    with prof if prof is not None else contextlib.nullcontext():
        sched.run_until_idle()
    total = time.perf_counter() - t_start
    # mode, batch size, tokens, seconds
    forwards = [(s.mode, s.batch_size, s.num_tokens, s.end - s.start) for s in sched.steps]
    out_tokens = sum(wl.output_lens)
    rate = out_tokens / total
    print(f"{workload} {dtype} threads={threads}: {total:.2f} s, {rate:.1f} out tok/s, {len(forwards)} forwards")
    by_mode: dict[str, list[float]] = defaultdict(list)
    for mode, _, _, sec in forwards:
        by_mode[mode].append(sec)
    for mode, secs in by_mode.items():
        toks = sum(t for m, _, t, _ in forwards if m == mode)
        print(f"  {mode:7s} {len(secs):5d} forwards {sum(secs):7.2f} s  {toks / sum(secs):8.1f} tok/s")
    bands: dict[int, list[float]] = defaultdict(list)
    for mode, bs, _, sec in forwards:
        if mode == "DECODE":
            bands[min(64, 1 << (bs - 1).bit_length())].append(sec)
    for band in sorted(bands):
        secs = bands[band]
        per_step = 1000 * sum(secs) / len(secs)
        print(f"  decode bs<={band:3d}: {len(secs):4d} steps, {per_step:7.1f} ms/step, {sum(secs):6.2f} s")
    print(f"  outside forwards (scheduling, sampling results): {total - sum(f[3] for f in forwards):.2f} s")
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--workload", default="W2", choices=["W1", "W2", "W3", "single", *FAMILY])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="also print the torch profiler's top ops")
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--disable-cascade-attention", action="store_true")
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    a = ap.parse_args(argv)
    kw = {
        "model_path": a.model_path,
        "disable_radix_cache": a.disable_radix_cache,
        "disable_cascade_attention": a.disable_cascade_attention,
    }
    if a.chunked_prefill_size is not None:
        kw["chunked_prefill_size"] = a.chunked_prefill_size
    run(a.workload, a.dtype, a.threads, a.profile, **kw)


if __name__ == "__main__":
    main()
