"""The Triton fused-MoE path (engine/layers/triton_moe.py) equals `FusedMoE`'s torch experts, on
CPU under the Triton interpreter; its kernel compiles for sm_90 without a GPU; a CPU model never
imports it. The checks run in subprocesses (tests/moe_triton_checks.py) because TRITON_INTERPRET
must be set before triton is imported."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.triton_subprocess import ROOT, assert_all_ok, run_checks

CHECKS = ROOT / "tests" / "moe_triton_checks.py"


def test_fused_experts_match_the_torch_experts_interpreter():
    rc, out = run_checks([str(CHECKS)], interpret=True)
    assert_all_ok(rc, out)
    assert sum(line.startswith("ok   experts") for line in out.splitlines()) == 10, out
    assert sum(line.startswith("ok   align") for line in out.splitlines()) == 2, out


def test_kernel_compiles_for_sm90_without_gpu():
    rc, out = run_checks([str(CHECKS), "--group", "compile"], interpret=False)
    if rc != 0 and "No module named 'triton.backends.nvidia'" in out:
        pytest.skip("this triton build has no NVIDIA backend")
    assert_all_ok(rc, out)
    assert out.count("ok   compile") == 4, out


def test_a_cpu_moe_layer_never_imports_triton():
    code = textwrap.dedent(
        """
        import sys, torch
        from engine.distributed.parallel_state import TPGroup
        from engine.layers.moe import FusedMoE
        moe = FusedMoE(8, 4, 2, 8, "silu", True, False, TPGroup.single(), torch.device("cpu"), torch.float32)
        for p in moe.parameters():
            p.data.normal_()
        moe(torch.randn(3, 8))
        assert "triton" not in sys.modules and "engine.layers.triton_moe" not in sys.modules, "triton was imported"
        print("OK")
        """
    )
    rc, out = run_checks(["-c", code], interpret=False)
    assert rc == 0 and "OK" in out, out


@pytest.mark.gpu
def test_fused_experts_on_gpu():
    """The same checks compiled for a real GPU (skipped without CUDA)."""
    assert torch.cuda.is_available()
    assert_all_ok(*run_checks([str(CHECKS), "--device", "cuda"], interpret=False))


@pytest.mark.gpu
def test_a_moe_model_on_cuda_equals_transformers(tmp_path):
    """End to end on a GPU: a tiny Qwen3-MoE served with its experts in the Triton kernel, fp32
    (exact products: `ieee`), greedy tokens and prompt log-probs equal transformers' on the CPU."""
    from engine.model_executor.model_runner import ModelRunner
    from tests.test_model_families import assert_scheduler_matches_transformers, family_args, save_random_model
    from tests.test_model_moe import FAMILIES, INIT

    assert torch.cuda.is_available()
    hf = save_random_model(FAMILIES["qwen3moe-norm"](), INIT, tmp_path)
    runner = ModelRunner(family_args(str(tmp_path), device="cuda", disable_cuda_graph=True))
    assert_scheduler_matches_transformers(runner, hf, "qwen3moe-cuda")
