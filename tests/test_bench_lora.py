"""bench.lora end to end on a tiny workload: the engine's default dtype (nothing a user would not
get), requests spread over adapters written in PEFT's format, every request its full length."""

from __future__ import annotations

import random

from bench.lora import run
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
    tok_s, _, dtype = run("smollm2-135m", wl, names, [f"{n}={tmp_path / n}" for n in names])
    assert tok_s > 0
    assert dtype == str(ServerArgs(model_path="smollm2-135m").resolved_dtype()).removeprefix("torch.")
