"""The fp32 small-batch loop (csrc/cpu_gemv.cpp, engine/kernels/cpu_gemv.py) and where it runs.

- Within fp32 rounding of an fp64 reference (as close as MKL's `F.linear`), with and without a
  bias, for K a multiple of the vector width and not (the scalar tail), 1 to 8 rows.
- A row's result is the same bits whatever the other rows, its position and the thread count
  (each output a fixed-order sum).
- Loaded fp32 projections on a CPU take it for 1..MAX_ROWS rows and `F.linear` above; bf16,
  deterministic inference and bad input do not reach it.
- The default model in fp32 still gives transformers' greedy tokens (decode steps now run it).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_gemv
from engine.kernels.cpu_extension import load
from engine.layers.linear import BatchInvariantLinear, DenseLinear, RowTiles, finalize_linear

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ CPU kernels are not built here")
CPU = torch.device("cpu")


def dense(n: int, k: int, dtype=torch.float32, bias: bool = False) -> DenseLinear:
    layer = DenseLinear(k, (n,), bias, CPU, dtype)
    layer.weight.data.normal_(0, 0.05)
    if bias:
        layer.bias.data.normal_(0, 1.0)
    return layer


@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (7, 100), (33, 8), (5, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp64_as_closely_as_mkl(n, k, bias):
    layer = dense(n, k, bias=bias)
    for m in range(1, cpu_gemv.MAX_ROWS + 1):
        x = torch.randn(m, k)
        ref = torch.nn.functional.linear(
            x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double()
        )
        got = cpu_gemv.gemv(x, layer.weight, layer.bias)
        mkl = torch.nn.functional.linear(x, layer.weight, layer.bias)
        scale = ref.abs().max().item()
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert (got.double() - ref).abs().max().item() <= max(4 * (mkl.double() - ref).abs().max().item(), 1e-6 * scale)


def test_a_rows_result_is_the_same_bits_in_any_batch_and_thread_count():
    layer = dense(49152 // 8, 576)
    probe = torch.randn(576)
    alone = cpu_gemv.gemv(probe[None], layer.weight)[0]
    threads = torch.get_num_threads()
    for m in range(2, cpu_gemv.MAX_ROWS + 1):
        x = torch.randn(m, 576)
        for at in (0, m - 1, m // 2):
            x[at] = probe
            assert torch.equal(cpu_gemv.gemv(x, layer.weight)[at], alone), (m, at)
    for t in {1, max(threads, 2)}:
        try:
            torch.set_num_threads(t)
            assert torch.equal(cpu_gemv.gemv(probe[None], layer.weight)[0], alone), t
        finally:
            torch.set_num_threads(threads)


def test_bad_input_is_a_clear_error():
    w = torch.randn(16, 32)
    for x, match in (
        (torch.randn(9, 32), "1 to 8 rows"),
        (torch.randn(0, 32), "1 to 8 rows"),
        (torch.randn(2, 31), r"x \[M, K\]"),
        (torch.randn(2, 32).bfloat16(), "float32 only"),
    ):
        with pytest.raises(RuntimeError, match=match):
            cpu_gemv.gemv(x, w)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_gemv.gemv(torch.randn(1, 32), w, torch.randn(15))


def test_fp32_projections_take_it_for_few_rows_only(monkeypatch):
    layer = finalize_linear(dense(64, 96, bias=True), None, 0)
    assert isinstance(layer, DenseLinear) and layer.small_rows == cpu_gemv.MAX_ROWS
    calls = []
    real = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (1, 3, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 64):
        x = torch.randn(m, 96)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert calls == [1, 3, cpu_gemv.MAX_ROWS]
    assert layer(torch.randn(0, 96)).shape == (0, 64) and calls == [1, 3, cpu_gemv.MAX_ROWS]
    # bf16 keeps its own forms; deterministic inference its fixed tiles
    assert getattr(finalize_linear(dense(64, 96, torch.bfloat16), None, 0), "small_rows", 0) == 0
    tiled = finalize_linear(dense(64, 96), None, 0, RowTiles())
    assert isinstance(tiled, BatchInvariantLinear) and tiled.inner.small_rows == 0


def test_default_model_fp32_greedy_tokens_equal_transformers(default_source, default_tokenizer, hf_default_model):
    """Decode steps of 1 to 6 requests, each taking the loop in every projection and the LM head:
    the tokens are transformers' (test_greedy_default_model.py covers batches of up to 32)."""
    from bench.parity_prompts import parity_prompts
    from engine import SyncScheduler
    from engine.model_executor.model_runner import ModelRunner
    from engine.sampling import SamplingParams
    from engine.server_args import ServerArgs
    from tests.hf_reference import hf_greedy_outputs

    # q4_max_tokens=0: the GGUF's dense weights, as a Hugging Face checkpoint's (with its blocks
    # the layers and head take the quantized loops instead: test_cpu_quant_f32.py)
    args = ServerArgs(dtype="float32", device="cpu", max_total_tokens=8192, max_running_requests=6, q4_max_tokens=0)
    runner = ModelRunner(args, default_source)
    assert runner.model.lm_head.small_rows == cpu_gemv.MAX_ROWS
    calls, real = {"n": 0}, cpu_gemv.gemv

    def counting(*a):
        calls["n"] += 1
        return real(*a)

    prompts = parity_prompts(default_tokenizer)[:6]
    sched = SyncScheduler(runner)
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    cpu_gemv.gemv = counting
    try:
        reqs = [sched.add_request(p, params) for p in prompts]
        sched.run_until_idle()
    finally:
        cpu_gemv.gemv = real
    assert calls["n"] > 0
    assert [r.output_ids for r in reqs] == hf_greedy_outputs(hf_default_model, prompts, 32)
