"""bench.floor: the bytes a bs-1 decode step reads, counted from the model's run-time layer forms."""

from __future__ import annotations

from bench.floor import read_bandwidth, weight_bytes_per_step
from tests.sched_harness import make_runner, make_tiny_llama


def test_weight_bytes_count_every_linear_once(tmp_path):
    runner, _ = make_runner(make_tiny_llama(tmp_path))
    model, cfg = runner.model, runner.model_config
    got = weight_bytes_per_step(model)
    dense = sum(m.weight.nbytes for name, m in model.named_modules() if type(m).__name__ == "DenseLinear")
    head = cfg.vocab_size * cfg.hidden_size * 4  # fp32
    assert got["lm head"] == head
    assert got["dense linears"] == dense - head
    assert got["embedding row"] == cfg.hidden_size * 4 and got["int4 linears"] == 0


def test_read_bandwidth_is_plausible():
    assert 1e8 < read_bandwidth(1, repeats=2) < 1e12  # bytes/s: between 0.1 GB/s and 1 TB/s


def test_a_moe_step_reads_the_router_and_top_k_experts(tmp_path):
    from transformers import Qwen3MoeConfig

    from engine.model_executor.model_runner import ModelRunner
    from tests.test_model_families import family_args, save_random_model
    from tests.test_model_moe import INIT, QWEN

    save_random_model(Qwen3MoeConfig(**QWEN, norm_topk_prob=True), INIT, tmp_path)
    model = ModelRunner(family_args(str(tmp_path))).model
    moe = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
    cfg = model.cfg
    expert = 3 * cfg.hidden_size * moe[0].intermediate_size * 4  # gate, up, down; fp32, dense
    router = cfg.num_experts * cfg.hidden_size * 4
    assert weight_bytes_per_step(model)["routed experts"] == len(moe) * (cfg.num_experts_per_tok * expert + router)
    assert weight_bytes_per_step(model, rows=8)["routed experts"] == len(moe) * (cfg.num_experts * expert + router)
