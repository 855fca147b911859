"""Triton attention kernels and TritonAttnBackend.

The kernels run on CPU under the Triton interpreter, which must be enabled (TRITON_INTERPRET=1)
before triton is imported, so the checks (tests/triton_checks.py) run in subprocesses; the two check
groups run concurrently (one per core) and are started once per module. Since the interpreter never
compiles anything, the kernels are also compiled for sm_90 ahead of time (no GPU needed). The
inputs come from a fixed seed (the same numbers every run); other draws: `TRITON_INTERPRET=1
python tests/triton_checks.py --seed random` (the seed is printed to replay it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.child_process import die_with_parent

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "triton_checks.py"
TIMEOUT_S = 240


def _env(interpret: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _spawn(args: list[str], interpret: bool) -> subprocess.Popen:
    parent = os.getpid()
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=_env(interpret),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: die_with_parent(parent),
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -1, out + f"\n[timed out after {TIMEOUT_S}s]"
    return proc.returncode, out


@pytest.fixture(scope="module")
def interpreter_runs():
    """Both check groups, started together so they overlap on the two cores."""
    procs = {group: _spawn([str(CHECKS), "--group", group], interpret=True) for group in ("kernels", "backend")}
    results: dict[str, tuple[int, str]] = {}

    def get(group: str) -> tuple[int, str]:
        if group not in results:
            results[group] = _finish(procs[group])
        return results[group]

    yield get
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _assert_ok(rc: int, out: str) -> None:
    assert rc == 0 and out.rstrip().endswith("ALL OK"), f"exit code {rc}; output:\n{out}"


def test_kernels_match_torch_reference_interpreter(interpreter_runs):
    """store_kv, split-KV decode and extend vs torch SDPA: fp32/fp16/bf16, GQA, D=16/24,
    shuffled slots and page_size 4 layouts, cached prefixes, empty splits; sliding windows (the
    slots before each window poisoned with NaN: never read) and Gemma 2's soft-cap against an
    explicit fp32 reference."""
    rc, out = interpreter_runs("kernels")
    _assert_ok(rc, out)
    assert out.count("\nok   decode") >= 4 and out.count("\nok   extend") >= 3, out
    assert out.count(" window=") >= 4 and out.count(" softcap=") >= 4, out


def test_backend_matches_torch_backend_interpreter(interpreter_runs):
    """TritonAttnBackend vs TorchAttnBackend through ForwardBatch: prefill, decode, extend on a
    cached prefix, decode; several layers sharing one metadata; page sizes 1 and 4; a windowed
    model (a local layer beside a global one) and a soft-capped one as `create_attention_backend`
    builds them: windows and cap in the Triton kernels against the torch backend's window plans."""
    rc, out = interpreter_runs("backend")
    _assert_ok(rc, out)
    assert out.count("\nok   backend decode") >= 2 and out.count("\nok   backend extend") >= 2, out
    assert out.count(" windows=(4, 0)") >= 8 and out.count(" softcap=2.0") >= 8, out


def test_import_without_gpu_and_clear_error():
    """Without the interpreter: importing the backend works (the kernels load lazily); building
    metadata works; launching on CPU tensors raises a RuntimeError that says what to do."""
    code = textwrap.dedent(
        """
        import sys, torch
        import engine.layers.attention_triton as mod
        assert "engine.kernels.triton_attention" not in sys.modules, "the kernels were imported eagerly"
        from engine.layers.attention_ops import HeadLayout
        from engine.layers.attention_triton import TritonAttnBackend
        from engine.cache.memory_pool import KVCache, ReqToTokenPool
        from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch

        be = TritonAttnBackend(HeadLayout(4, 2, 16, 0.25))
        rtp = ReqToTokenPool(2, 8)
        rtp.write(0, 0, torch.tensor([1, 2]))
        cache = KVCache(8, 1, 2, 16, torch.float32)
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND, input_ids=torch.zeros(2, dtype=torch.long),
            req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([2]), out_cache_loc=torch.tensor([1, 2]),
            seq_lens_cpu=[2], extend_seq_lens=[2], extend_prefix_lens=[0],
        )
        fb = ForwardBatch.init_new(batch, rtp, cache, be)
        be.init_forward_metadata(fb)
        try:
            be.forward(torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16), 0, fb)
        except RuntimeError as e:
            assert "TRITON_INTERPRET" in str(e) and "CUDA" in str(e), e
            print("RAISED:", e)
        else:
            raise AssertionError("launch on CPU without the interpreter did not raise")
        """
    )
    rc, out = _finish(_spawn(["-c", code], interpret=False))
    assert rc == 0 and "RAISED:" in out, f"exit code {rc}; output:\n{out}"


def test_backend_module_imports_in_process():
    import engine.layers.attention_triton as mod
    from engine.layers.attention_ops import HeadLayout

    be = mod.TritonAttnBackend(HeadLayout(8, 2, 64, 0.125), num_kv_splits=4)
    layout = be.layout
    assert (layout.num_heads, layout.num_kv_heads, layout.head_dim, be.num_kv_splits) == (8, 2, 64, 4)
    with pytest.raises(ValueError):
        mod.TritonAttnBackend(HeadLayout(6, 4, 64, 0.125))


def test_kernels_compile_for_sm90_without_gpu():
    """The interpreter never compiles: build the kernels for sm_90 with Triton's own compiler and
    bundled ptxas (no GPU needed), so GPU-only compile errors show up on CPU machines too."""
    rc, out = _finish(_spawn([str(CHECKS), "--group", "compile"], interpret=False))
    if rc != 0 and "No module named 'triton.backends.nvidia'" in out:
        pytest.skip("this triton build has no NVIDIA backend")
    _assert_ok(rc, out)
    assert out.count("\nok   compile") == 6, out  # decode stage1 and extend also with window and cap


@pytest.mark.gpu
def test_kernels_on_gpu():
    """The same checks compiled for a real GPU (skipped without CUDA)."""
    assert torch.cuda.is_available()
    rc, out = _finish(_spawn([str(CHECKS), "--device", "cuda"], interpret=False))
    _assert_ok(rc, out)
