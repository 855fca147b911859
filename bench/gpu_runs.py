"""The measurements behind bench/gpu.py: models, our scheduler / engine, transformers, copy bandwidth.

Each function runs one measurement and returns plain numbers; bench/gpu.py decides what to run and
prints the tables. Device-agnostic where it costs nothing (`_sync` is a no-op without CUDA), so
the plumbing can be dry-run on CPU with a tiny model; the numbers only mean something on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.gpu_metrics import copy_bandwidth, idle_between_steps, step_spans

if TYPE_CHECKING:  # engine and transformers are imported where used: `--help` stays fast
    from engine import ModelSource, SyncScheduler

# Qwen2.5-0.5B's shape (random weights are built from it).
QWEN_SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
)


def _sync() -> None:
    """Wait for the GPU (timings end when the device is done); nothing to wait for on CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Memory bandwidth (bytes/s) from `reps` device-to-device copies of `nbytes` (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return copy_bandwidth(nbytes * reps, time.perf_counter() - t0)


# ---- models -----------------------------------------------------------------------------------


def build_random_qwen(folder: Path, shape: dict[str, Any] = QWEN_SHAPE, device: str = "cuda") -> str:
    """Qwen2.5-0.5B's shape with random bf16 weights, plus a word-level tokenizer ("t0".."tN")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    cfg = Qwen2Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds, not a minute on the host
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t0", eos_token="t1")
    fast.save_pretrained(folder)
    return str(folder)


def engine_options(max_bs: int, context_len: int, tokens: int, graphs: bool = True) -> dict[str, Any]:
    """Our engine on the GPU: bf16, Triton attention, decode graphs up to `max_bs` (or none), a KV
    pool of `tokens` (explicit, so both models get what the benchmark needs whatever the GPU's
    size), whole prompts in one prefill, no prefix cache (the prompts are random)."""
    return dict(
        dtype="bfloat16",
        device="cuda",
        attention_backend="triton",
        max_running_requests=max_bs,
        cuda_graph_max_bs=max_bs,
        disable_cuda_graph=not graphs,
        max_total_tokens=tokens,
        context_length=context_len,
        disable_radix_cache=True,
        chunked_prefill_size=-1,
        max_prefill_tokens=tokens,
    )


def build_sync(model_path: str, **options: Any) -> SyncScheduler:
    """Our scheduler and model runner, stepped synchronously (see `engine_options`)."""
    from engine import ServerArgs, SyncScheduler

    return SyncScheduler.from_args(ServerArgs(model_path=model_path, **options))


def load_hf(source: ModelSource) -> torch.nn.Module:
    """transformers' model on the same weights (bench/offline.py's loader: dense bf16), on the GPU."""
    from bench.offline import load_hf as load_hf_cpu

    return load_hf_cpu(source, torch.bfloat16).to("cuda").eval()


def parameter_count(hf_config: Any) -> int:
    """Parameters of the model `hf_config` describes (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n token-id prompts of `length` (ids >= 2: clear of the synthetic tokenizer's specials)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def w1_prompts(scale: int, vocab: int) -> list[list[int]]:
    """bench.offline's W1 prompts (64 requests, U[64, 512] tokens) `scale` times over, seeds 0.."""
    from bench.offline import make_workload

    return [p for seed in range(scale) for p in make_workload("W1", vocab, seed).prompts]


# ---- measurements -----------------------------------------------------------------------------


def ours_batch(sync: SyncScheduler, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode-step seconds) of one static batch, through the synchronous
    scheduler step (each step ends when its sampled ids are on the host); everything is freed after.

    The scheduler must take the whole batch in one prefill: no chunking, enough prefill tokens
    and request rows (`engine_options` sets them)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 1, ignore_eos=True)
    for p in prompts:
        sync.add_request(p, params)
    _sync()
    first = len(sync.steps)
    sync.run_until_idle()
    records = sync.steps[first:]
    prefill = [r for r in records if r.mode == "EXTEND"]
    decode = [r.end - r.start for r in records if r.mode == "DECODE"]
    if len(prefill) != 1 or prefill[0].batch_size != len(prompts) or len(decode) != steps:
        raise RuntimeError(f"expected one prefill of {len(prompts)} and {steps} decode steps, got {records}")
    return prefill[0].end - prefill[0].start, statistics.median(decode)


def decode_profile(sync: SyncScheduler, prompts: list[list[int]], steps: int, top: int = 8) -> dict[str, Any]:
    """Where a synchronous decode step's time goes, from the torch profiler over `steps` steps:
    wall time, device kernel time and kernel count per step, and the top host ops and kernels.
    Kernel time far under wall time means the step is host-bound; many short kernels per step mean
    launch- or fusion-bound (a graph removes launch cost, not the kernels' own minimum time)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 3, ignore_eos=True)
    for p in prompts:
        sync.add_request(p, params)
    sync.step()  # the prefill
    sync.step()  # one decode step outside the trace
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            sync.step()
    wall = (time.perf_counter() - t0) / steps
    sync.run_until_idle()
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)

    kernels = [e for e in events if device_us(e) > 0]
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "wall_us": wall * 1e6,
        "kernel_us": sum(device_us(e) for e in kernels) / steps,
        "kernels": sum(e.count for e in kernels) / steps,
        "top_host_us": [[e.key[:60], e.count / steps, e.self_cpu_time_total / steps] for e in host],
        "top_kernels_us": [
            [e.key[:60], e.count / steps, device_us(e) / steps]
            for e in sorted(kernels, key=device_us, reverse=True)[:top]
        ],
    }


@torch.inference_mode()
def hf_batch(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode-step seconds) of transformers' forward with its KV cache."""
    from transformers import DynamicCache

    ids = torch.tensor(prompts, device=model.device)
    cache = DynamicCache()
    _sync()
    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
    nxt.tolist()
    prefill = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
        nxt.tolist()
        times.append(time.perf_counter() - t0)
    return prefill, statistics.median(times)


def hf_generate_batch(model: torch.nn.Module, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(output tokens/s, mean output tokens per request) of transformers' continuous batching
    (greedy). It may stop a request at EOS where ours ignores EOS: the mean length shows it."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=output_len, do_sample=False)
    warm = GenerationConfig(max_new_tokens=4, do_sample=False)
    model.generate_batch(inputs=prompts[:64], generation_config=warm, progress_bar=False)  # as ours: warmed up
    _sync()
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    _sync()
    n = sum(len(o.generated_tokens) for o in outs.values())
    return n / (time.perf_counter() - t0), n / max(len(outs), 1)


def engine_generate(
    model_path: str,
    options: dict[str, Any],
    prompts: list[list[int]],
    output_len: int,
    overlap: bool,
    trace: Path | None = None,
) -> float | tuple[float, float, int]:
    """Our Engine (actors + device stream): output tokens/s, or with `trace` the decode idle stats
    (fraction, mean gap us, pairs) of a profiled run (the engine annotates every forward).

    Only the generation is timed (or traced): the engine is started and warmed up first (a few tokens
    for up to 64 of the prompts, so the kernels' shapes are compiled), as a served engine would be.
    """
    import uvloop

    from engine import Engine, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)

    async def run() -> float | Any:
        async with Engine(model_path, enable_overlap=overlap, **options) as engine:
            await asyncio.gather(*(engine.generate(p, warm) for p in prompts[:64]))
            if trace is None:
                t0 = time.perf_counter()
                results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
                return sum(r.completion_tokens for r in results) / (time.perf_counter() - t0)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            return prof

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        out = runner.run(run())
    if trace is None:
        return out
    out.export_chrome_trace(str(trace))
    return idle_between_steps(step_spans(json.loads(trace.read_text())["traceEvents"]))
