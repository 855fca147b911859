"""bench.lora end to end on a tiny workload: the engine's default dtype (nothing a user would not
get), requests spread over adapters written in PEFT's format, every request its full length."""

from __future__ import annotations

import random

from bench.lora import lora_step_cost, mean_batch, run
from bench.lora_adapters import write_adapter
from bench.workloads import Workload
from engine import ServerArgs, resolve_model


def test_lora_bench_runs_adapters_in_the_default_dtype(tmp_path):
    source = resolve_model("smollm2-135m")
    rng = random.Random(0)
    wl = Workload("tiny", [[rng.randrange(100, 49152) for _ in range(24)] for _ in range(4)], [3, 5, 4, 6])
    names = ["a0", "a1"]
    for i, name in enumerate(names):
        write_adapter(tmp_path / name, source.hf_config, rank=4, seed=i)
    tok_s, steps, dtype = run("smollm2-135m", wl, names, [f"{n}={tmp_path / n}" for n in names])
    assert tok_s > 0
    # decode steps by batch size: each request's first token comes from its prefill (the warm-up
    # request's 4 tokens included)
    assert steps and 0 < sum(b * len(t) for b, t in steps.items()) <= sum(n - 1 for n in wl.output_lens) + 3
    assert dtype == str(ServerArgs(model_path="smollm2-135m").resolved_dtype()).removeprefix("torch.")


def test_lora_step_cost_compares_equal_batch_sizes():
    """With 16 adapters and 8 slots the adapter run decodes smaller batches than the base model:
    its mean step is shorter, but at each batch size it is slower, and that is what is printed."""
    base = [{64: [70.0, 72.0], 32: [40.0]}, {64: [74.0], 32: [42.0], 4: [10.0]}]
    lora = {32: [45.0, 47.0, 46.0], 64: [80.0], 2: [99.0]}  # 2 rows: below the compared sizes
    assert lora_step_cost(lora, base) == (3 * (46.0 - 41.0) + 1 * (80.0 - 72.0)) / 4
    assert lora_step_cost({16: [5.0]}, base) != lora_step_cost({16: [5.0]}, base)  # nothing comparable: nan
    assert mean_batch(lora) == (3 * 32 + 64 + 2) / 5
