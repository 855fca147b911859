"""bench.roofline: a workload's FLOPs and KV reads, counted from the model's config."""

from __future__ import annotations

import torch

from bench.prefill_rate import chunk_flops, prefill_seconds
from bench.prefill_rate import main as prefill_main
from bench.roofline import gemm_rate, model_shapes, workload_counts
from bench.workloads import Workload
from engine import resolve_model
from tests.sched_harness import make_runner, make_tiny_llama


def test_counts_are_the_models_linears_and_attention(tmp_path):
    folder = make_tiny_llama(tmp_path)
    runner, _ = make_runner(folder)
    cfg = resolve_model(str(folder)).hf_config
    m = model_shapes(cfg)
    linears = sum(p.numel() for name, p in runner.model.named_parameters() if name.endswith("proj.weight"))
    assert m["layers"] * sum(k * n for k, n in m["shapes"]) == linears  # q|k|v, o, gate|up, down
    per_token, head = 2 * linears, 2 * cfg.hidden_size * cfg.vocab_size
    pair = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * m["head_dim"]
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * m["head_dim"]
    # a 3-token prompt with 1 output (prefill only) and a 5-token one with 3 (two decode steps)
    counts = workload_counts(Workload("t", [[1] * 3, [1] * 5], [1, 3]), m)
    assert counts["prefill_flops"] == 8 * per_token + 2 * head + pair * (6 + 15)
    assert counts["decode_flops"] == 2 * (per_token + head) + pair * (6 + 7)
    assert counts["kv_elements"] == kv * (6 + 7)


def test_gemm_rate_is_plausible():
    rate = gemm_rate([(64, 128), (128, 64)], torch.float32, threads=1, rows=(16,))
    assert 1e7 < rate < 1e14  # FLOP/s


def test_prefill_rate_times_whole_chunks_of_the_real_model(tmp_path):
    """bench.prefill_rate: each pass is one EXTEND forward of the whole prompt (the radix cache is
    off, so later passes prefill it all again), and its FLOPs are roofline's counting of one chunk."""
    folder = make_tiny_llama(tmp_path)
    m = model_shapes(resolve_model(str(folder)).hf_config)
    per_token = 2 * m["layers"] * sum(k * n for k, n in m["shapes"])
    pair = 4 * m["layers"] * m["heads"] * m["head_dim"]
    assert chunk_flops(m, 40) == 40 * per_token + pair * 40 * 41 / 2 + 2 * m["hidden"] * m["vocab"]
    times = prefill_seconds(str(folder), "float32", chunk=40, passes=3)
    assert len(times) == 3 and all(t > 0 for t in times)
    out = prefill_main(["--model-path", str(folder), "--dtype", "float32", "--chunk", "24", "--passes", "2"])
    assert out["chunk_flops"] == chunk_flops(m, 24) and out["first_share"] > 0 and out["steady_share"] > 0
