"""The Triton SGMV LoRA kernels (engine/lora/triton_ops.py) equal the torch path, on CPU under the
Triton interpreter; they compile for sm_90 without a GPU; and CPU-only code never imports triton
for LoRA. The checks run in subprocesses (tests/lora_triton_checks.py) because TRITON_INTERPRET must
be set before triton is imported."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.triton_subprocess import ROOT, assert_all_ok, run_checks

CHECKS = ROOT / "tests" / "lora_triton_checks.py"


def test_kernels_match_torch_path_interpreter():
    """Gathered and ungathered rows, a 17-row segment (two row blocks), padded ranks, q|k|v parts
    of different sizes, adapters that skip projections; fp32, fp16, bf16; base rows untouched."""
    rc, out = run_checks([str(CHECKS)], interpret=True)
    assert_all_ok(rc, out)
    assert sum(line.startswith("ok   kernels") for line in out.splitlines()) == 24, out


def test_kernels_compile_for_sm90_without_gpu():
    rc, out = run_checks([str(CHECKS), "--group", "compile"], interpret=False)
    if rc != 0 and "No module named 'triton.backends.nvidia'" in out:
        pytest.skip("this triton build has no NVIDIA backend")
    assert_all_ok(rc, out)
    assert out.count("ok   compile") == 4, out


def test_cpu_path_never_imports_triton():
    code = textwrap.dedent(
        """
        import sys, torch
        from engine.lora import LoRABatchInfo, LoRAPool, apply_lora
        from tests.lora_random import random_adapter, tiny_config
        cfg = tiny_config(num_layers=1)
        for kernel in (None, "torch"):  # the default on a CPU (the C++ kernel), then torch ops
            pool = LoRAPool(cfg, max_loras_per_batch=1, max_lora_rank=4, kernel=kernel)
            pool.load("a", random_adapter(cfg, 2))
            apply_lora(torch.randn(3, 24), torch.zeros(3, 48), 0, "qkv_proj", LoRABatchInfo.build(pool, [0], [3]))
            assert pool.kernel == (kernel or "cpu"), pool.kernel
        assert "triton" not in sys.modules and "engine.lora.triton_ops" not in sys.modules, "triton was imported"
        print("OK")
        """
    )
    rc, out = run_checks(["-c", code], interpret=False)
    assert rc == 0 and "OK" in out, out


@pytest.mark.gpu
def test_kernels_on_gpu():
    """The same checks compiled for a real GPU (skipped without CUDA)."""
    assert torch.cuda.is_available()
    assert_all_ok(*run_checks([str(CHECKS), "--device", "cuda"], interpret=False))
