"""End-to-end checks of the GPU path (Triton attention backend, decode graphs) on a tiny model.

Run by tests/test_gpu_path.py in a subprocess; on CPU the Triton kernels need the interpreter,
which must be enabled before triton is imported, hence the separate process:

    TRITON_INTERPRET=1 python tests/gpu_path_checks.py            # CPU: interpreter, graphs replayed eagerly
    python tests/gpu_path_checks.py --device cuda                 # GPU: compiled kernels, real CUDA graphs

Checks (each prints `ok` or `FAIL`; the last line is `ALL OK` when all pass):
- greedy: the same prompts through prefill + decode (scheduler, overlap on) give the same tokens
  with attention_backend="torch" and "triton" (on CUDA: with graphs and with --disable-cuda-graph;
  on CPU: eager, and through the decode graph runner's static-buffer path, run eagerly with the
  host-side arguments a capture would have frozen).
- static: for decode batches of 3 and 5 requests (padded to graphs of 4 and 8), the static-buffer
  path (captured and replayed on CUDA; called eagerly on CPU) gives the eager path's logits, leaves
  the request table untouched and writes no KV slot other than the real ones and padding slot 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine import SyncScheduler
from engine.model_executor.cuda_graph_runner import DecodeGraphRunner, padded_batch_size
from engine.model_executor.model_runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.req import Req
from engine.server_args import ServerArgs
from tests.sched_harness import make_runner, make_tiny_llama, new_req, random_prompts

FAILURES: list[str] = []
MAX_BS = 8


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}".rstrip(), flush=True)
    if not ok:
        FAILURES.append(f"{name} {detail}")


def runner_for(folder: Path, device: str, backend: str, graphs: bool) -> tuple[ModelRunner, ServerArgs]:
    return make_runner(
        folder,
        device=device,
        attention_backend=backend,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=MAX_BS,
        max_running_requests=16,
        max_total_tokens=2048,
        disable_radix_cache=True,  # every run frees all it took
    )


class FrozenHostArgs(DecodeGraphRunner):
    """Replays the static-buffer forward the way a captured graph would: every host-side argument
    frozen at its capture value (sequence lengths all 1), so only the device buffers carry the
    batch. The Triton backend must not care; the torch backend would (its decode gather width
    comes from host lengths), which is why graphs are only used with Triton."""

    def run_static(self, bs: int, seq_lens_cpu: list[int]) -> None:
        super().run_static(bs, [1] * bs)


def eager_graph_runner(runner: ModelRunner) -> DecodeGraphRunner:
    """The decode graph runner over this runner's model and memory, not captured (CPU); with the
    Triton backend its replays use capture-time host arguments (FrozenHostArgs)."""
    cls = FrozenHostArgs if runner.attn_backend_name == "triton" else DecodeGraphRunner
    return cls(
        runner.model,
        runner.attn_backend,
        runner.req_to_token_pool,
        runner.kv_cache,
        runner.model_config.vocab_size,
        MAX_BS,
        runner.device,
    )


def greedy_tokens(runner: ModelRunner, args: ServerArgs, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    sched = SyncScheduler(runner, args)
    # different lengths: the decode batch shrinks 3 -> 2 -> 1 (padded to 4, 2, 1)
    params = [SamplingParams(temperature=0.0, max_new_tokens=max_new + 2 * i) for i in range(len(prompts))]
    reqs = [new_req(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs:
        sched.add(r)
    sched.run_until_idle(overlap=True)
    sched.scheduler.check_memory()
    return [r.output_ids for r in reqs]


def check_greedy(folder: Path, device: str) -> None:
    prompts = random_prompts(3, 3, 11, seed=1)
    max_new = 5
    ref_runner, ref_args = runner_for(folder, device, "torch", graphs=False)
    ref = greedy_tokens(ref_runner, ref_args, prompts, max_new)
    del ref_runner
    runner, args = runner_for(folder, device, "triton", graphs=device == "cuda")
    variants = [("triton eager", None)]
    if device == "cuda":
        variants.append(("triton cuda-graphs", runner.graph_runner))
        report("greedy graphs captured", runner.graph_runner is not None and runner.graph_runner.captured)
    else:
        variants.append(("triton static-buffers", eager_graph_runner(runner)))
    for name, graph_runner in variants:
        runner.graph_runner = graph_runner
        t0 = time.perf_counter()
        got = greedy_tokens(runner, args, prompts, max_new)
        report(f"greedy {name} == torch", got == ref, f"{got} vs {ref} [{time.perf_counter() - t0:.1f}s]")


def _prefill(runner: ModelRunner, prompts: list[list[int]]) -> ScheduleBatch:
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    reqs = [Req(f"s{i}", p, params, seed=i + 1, max_context_len=runner.context_len) for i, p in enumerate(prompts)]
    for r in reqs:
        r.init_next_round_input()
    batch = ScheduleBatch.init_new(
        reqs, runner.req_to_token_pool, runner.token_to_kv_pool_allocator, None, runner.model_config.vocab_size
    )
    assert batch.prepare_for_extend()
    out = runner.forward_batch_generation(batch.get_model_worker_batch())
    for r, t in zip(reqs, out.next_token_ids_list()):
        r.output_ids.append(t)
    return batch


def _release(runner: ModelRunner, batch: ScheduleBatch) -> None:
    for r in batch.reqs:
        runner.token_to_kv_pool_allocator.free(
            runner.req_to_token_pool.req_to_token[r.req_pool_idx, : r.kv_committed_len].to(torch.int64).cpu()
        )
        runner.req_to_token_pool.free(r.req_pool_idx)


def check_static(folder: Path, device: str, backend: str = "triton") -> None:
    runner, _ = runner_for(folder, device, backend, graphs=device == "cuda")
    graph_runner = runner.graph_runner or eager_graph_runner(runner)  # captured on CUDA + triton
    if device == "cuda" and backend == "triton":
        report("static graphs captured", graph_runner.captured, f"sizes={graph_runner.sizes}")
    runner.graph_runner = None  # runner.forward below is the eager reference
    for n, expect_bs, on_device in ((3, 4, True), (5, 8, False)):
        batch = _prefill(runner, random_prompts(n, 2, 13, seed=n))
        assert batch.prepare_for_decode(inputs_on_device=on_device)
        mwb = batch.get_model_worker_batch()
        eager = runner.forward(mwb)
        table = runner.req_to_token_pool.req_to_token.clone()
        pool = [t.clone() for t in runner.kv_cache.k_buffer + runner.kv_cache.v_buffer]
        static = graph_runner.replay(runner.init_forward_batch(mwb)).clone()
        err = ((static - eager).abs().max() / eager.abs().max()).item()
        same_argmax = torch.equal(static.argmax(-1), eager.argmax(-1))
        label = f"static {backend} n={n} padded to {padded_batch_size(n, graph_runner.sizes)}"
        report(f"{label} logits", static.shape == eager.shape and err < 1e-4 and same_argmax, f"rel_err={err:.1e}")
        report(f"{label} padded size", padded_batch_size(n, graph_runner.sizes) == expect_bs)
        report(f"{label} table untouched", torch.equal(table, runner.req_to_token_pool.req_to_token))
        after = runner.kv_cache.k_buffer + runner.kv_cache.v_buffer
        kv_ok = all(torch.allclose(a[1:], b[1:], rtol=1e-4, atol=1e-5) for a, b in zip(pool, after))
        report(f"{label} KV writes only real slots and slot 0", kv_ok)
        _release(runner, batch)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--group", default="all", choices=("all", "greedy", "static"))
    args = ap.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 to run the Triton kernels on CPU", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_llama(Path(tmp))
        if args.group in ("all", "greedy"):
            check_greedy(folder, args.device)
        if args.group in ("all", "static"):
            check_static(folder, args.device)
    print(f"checks took {time.perf_counter() - t0:.1f}s", flush=True)
    if FAILURES:
        print(f"{len(FAILURES)} FAILED:", *FAILURES, sep="\n  ", flush=True)
        return 1
    print("ALL OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
