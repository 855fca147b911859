"""The GPU path's logic on CPU: attention backend selection, decode graph buffers and padding,
host<->device copy helpers, CLI flags; plus the Triton backend and the static-buffer decode path
end to end under the Triton interpreter (subprocess), and real-GPU checks marked `gpu`.

Real CUDA graph capture and the pinned-memory copies only run on a GPU:
`python -m pytest -m gpu tests/test_gpu_path.py` (or `python tests/gpu_path_checks.py --device cuda`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine.layers.attention_backend as ab
import tests.gpu_path_checks as checks
from engine.cache.memory_pool import KVCache, ReqToTokenPool
from engine.errors import InvalidRequestError
from engine.model_executor.cuda_graph_runner import (
    PAD_REQ_ROW,
    PAD_SLOT,
    StaticDecodeInputs,
    capture_batch_sizes,
    cuda_graphs_apply,
    graph_memory_estimate,
    padded_batch_size,
    resolve_cuda_graph_max_bs,
)
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
from engine.model_executor.host_transfer import DeviceToHost, host_to_device
from engine.model_executor.model_runner import ModelRunner
from engine.server_args import ServerArgs
from server.cli import parse_args
from tests.sched_harness import make_runner, make_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "gpu_path_checks.py"
CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


# ---- batch sizes ------------------------------------------------------------------------------


def test_capture_batch_sizes_follow_sglang_shape():
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # the max itself is always captured
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(1) == [1]
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


def test_padded_batch_size_is_smallest_captured_size_at_least_n():
    sizes = capture_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 63, 64)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        24,
        64,
        64,
    ]
    assert padded_batch_size(65, sizes) is None and padded_batch_size(0, sizes) is None


def test_graph_max_bs_default_and_cap():
    assert resolve_cuda_graph_max_bs(None, 128) == 64
    assert resolve_cuda_graph_max_bs(None, 16) == 16  # never above max_running_requests
    assert resolve_cuda_graph_max_bs(256, 512) == 256
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidRequestError) as e:
            resolve_cuda_graph_max_bs(bad, 128)
        assert e.value.param == "cuda_graph_max_bs"


def test_graphs_only_on_cuda_with_triton_and_not_disabled():
    assert cuda_graphs_apply(CUDA, "triton", False)
    assert not cuda_graphs_apply(CUDA, "triton", True)
    assert not cuda_graphs_apply(CUDA, "torch", False)
    assert not cuda_graphs_apply(CPU, "triton", False)


def test_graph_memory_estimate_grows_with_batch_and_vocab():
    kw = dict(hidden=896, intermediate=4864, q_size=896, kv_size=128, dtype_bytes=2)
    small = graph_memory_estimate(8, 4, vocab=151936, **kw)
    large = graph_memory_estimate(64, 11, vocab=151936, **kw)
    assert 256 << 20 < small < large
    assert graph_memory_estimate(64, 11, vocab=49152, **kw) < large
    assert large >= 64 * 151936 * 4  # at least the static fp32 logits buffer


# ---- static buffers ---------------------------------------------------------------------------


def _decode_fb(rows: list[int], lens: list[int], locs: list[int], ids: list[int] | None, last: torch.Tensor):
    """A decode ForwardBatch built as the runner builds it (`ForwardBatch.init_new`)."""
    t = torch.tensor
    ids_t = None if ids is None else t(ids)
    batch = ModelWorkerBatch(
        ForwardMode.DECODE, ids_t, t(rows), seq_lens=t(lens), out_cache_loc=t(locs), seq_lens_cpu=lens
    )
    return ForwardBatch.init_new(batch, ReqToTokenPool(16, 32), KVCache(64, 1, 1, 64, torch.float32), None, last)


def test_static_inputs_copy_real_rows_and_pad_the_rest():
    s = StaticDecodeInputs(8, CPU)
    last = torch.arange(100, 116)
    big = _decode_fb([9, 8, 7, 6, 5], [10, 11, 12, 13, 14], [50, 51, 52, 53, 54], [1, 2, 3, 4, 5], last)
    s.load(big, 8)
    assert s.input_ids[:5].tolist() == [1, 2, 3, 4, 5] and s.positions[:5].tolist() == [9, 10, 11, 12, 13]
    # a smaller batch after it: its padding must overwrite the previous batch's real rows
    s.load(_decode_fb([2, 0, 5], [4, 1, 7], [20, 21, 22], None, last), 4)
    assert s.input_ids[:4].tolist() == [102, 100, 105, 0]  # gathered from last_token_ids by row
    assert s.positions[:4].tolist() == [3, 0, 6, 0]
    assert s.req_pool_indices[:4].tolist() == [2, 0, 5, PAD_REQ_ROW]
    assert s.seq_lens[:4].tolist() == [4, 1, 7, 1]
    assert s.out_cache_loc[:4].tolist() == [20, 21, 22, PAD_SLOT]
    with pytest.raises(ValueError):
        s.load(big, 4)


def test_static_buffer_path_matches_eager_torch_backend(tiny_folder):
    """The graph runner's static-buffer forward, replayed eagerly (torch backend, in process):
    same logits as the eager path for 3 requests padded to 4 and 5 padded to 8."""
    checks.FAILURES.clear()
    checks.check_static(tiny_folder, "cpu", backend="torch")
    assert not checks.FAILURES, checks.FAILURES


def test_frozen_host_arguments_break_the_torch_backend(tiny_folder, monkeypatch):
    """Why graphs need the Triton backend: replayed with the host arguments a capture freezes
    (lengths all 1), the torch backend's decode reads the wrong width. (The Triton backend passes
    the same replay in the interpreter test below.)"""

    def frozen(r):
        return checks.FrozenHostArgs(
            r.model, r.attn_backend, r.req_to_token_pool, r.kv_cache, r.model_config.vocab_size, checks.MAX_BS, r.device
        )

    monkeypatch.setattr(checks, "eager_graph_runner", frozen)
    checks.FAILURES.clear()
    checks.check_static(tiny_folder, "cpu", backend="torch")
    assert any("logits" in f for f in checks.FAILURES), checks.FAILURES
    checks.FAILURES.clear()


# ---- backend selection ------------------------------------------------------------------------


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delitem(sys.modules, "engine.kernels.triton_attention", raising=False)


F32, BF16 = torch.float32, torch.bfloat16


def test_backend_resolution(no_interpreter, monkeypatch):
    # CPU: the C++ kernels for the dtypes and head sizes they take (they build here), else torch.
    assert ab.resolve_attention_backend("auto", CPU, F32, 24) == "torch"
    assert ab.resolve_attention_backend("auto", CPU, torch.float16, 64) == "torch"
    assert ab.resolve_attention_backend("auto", CPU, F32, 64) == "cpu"
    assert ab.resolve_attention_backend("auto", CPU, BF16, 128) == "cpu"
    assert ab.resolve_attention_backend("torch", CPU, BF16, 64) == "torch"
    assert ab.resolve_attention_backend("cpu", CPU, BF16, 64) == "cpu"
    with pytest.raises(InvalidRequestError, match="'cpu' needs"):
        ab.resolve_attention_backend("cpu", CPU, F32, 24)
    with pytest.raises(InvalidRequestError, match="runs on CPUs"):
        ab.resolve_attention_backend("cpu", CUDA, BF16, 64)
    monkeypatch.setenv("ASYNCLLM_CPU_KERNELS", "0")
    assert ab.resolve_attention_backend("auto", CPU, F32, 64) == "torch"
    monkeypatch.delenv("ASYNCLLM_CPU_KERNELS")
    # CUDA: triton when it imports.
    assert ab.resolve_attention_backend("torch", CUDA, BF16, 64) == "torch"
    assert ab.resolve_attention_backend("auto", CUDA, BF16, 64) == "triton"  # triton is installed here
    assert ab.resolve_attention_backend("triton", CUDA, BF16, 64) == "triton"
    monkeypatch.setattr(ab, "triton_problem", lambda: "the triton package does not import (ImportError: x)")
    assert ab.resolve_attention_backend("auto", CUDA, BF16, 64) == "torch"
    with pytest.raises(InvalidRequestError, match="needs triton"):
        ab.resolve_attention_backend("triton", CUDA, BF16, 64)


def test_triton_on_cpu_without_interpreter_is_a_typed_error(no_interpreter):
    with pytest.raises(InvalidRequestError) as e:
        ab.resolve_attention_backend("triton", CPU, F32, 64)
    assert e.value.param == "attention_backend" and "TRITON_INTERPRET" in str(e.value) and "torch" in str(e.value)
    with pytest.raises(InvalidRequestError, match="unknown attention backend"):
        ab.resolve_attention_backend("flash", CPU, F32, 64)


def test_runner_rejects_triton_on_cpu_at_construction(no_interpreter):
    """Before any weight is loaded (the model path does not even exist)."""
    with pytest.raises(InvalidRequestError) as e:
        ModelRunner(ServerArgs(model_path="/nonexistent", device="cpu", attention_backend="triton"))
    assert e.value.param == "attention_backend"


def test_cpu_runner_is_unchanged(tiny_folder):
    runner, _ = make_runner(tiny_folder)  # head size 16: no C++ kernel takes it
    assert runner.attn_backend_name == "torch" and runner.graph_runner is None and not runner.use_cuda_graph


def test_cli_gpu_flags():
    engine, _ = parse_args(["--attention-backend", "triton", "--disable-cuda-graph", "--cuda-graph-max-bs", "16"])
    assert engine == {"attention_backend": "triton", "disable_cuda_graph": True, "cuda_graph_max_bs": 16}
    assert parse_args([])[0] == {}
    ServerArgs(**engine)  # every key is a ServerArgs field
    for bad in (["--attention-backend", "flash"], ["--cuda-graph-max-bs", "0"]):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2


# ---- host <-> device helpers ------------------------------------------------------------------


def test_host_transfer_is_a_no_op_on_cpu():
    a, b = torch.arange(3), torch.ones(2, dtype=torch.int32)
    out = host_to_device([a, None, b], CPU)
    assert out[0] is a and out[1] is None and out[2] is b
    assert DeviceToHost.start(a).result() is a


# ---- the Triton backend end to end, under the interpreter ---------------------------------------


def test_triton_backend_and_static_path_interpreter():
    """Greedy tokens: triton == torch (eager, and through the static-buffer decode path);
    static-path logits == eager for 3 -> 4 and 5 -> 8; see tests/gpu_path_checks.py."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(CHECKS)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ALL OK"), out
    assert proc.stdout.count("\nok   greedy") >= 1 and proc.stdout.count("logits") == 2, out


# ---- real GPU (skipped without CUDA) ------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graphs_on_gpu():
    """Captures decode graphs and replays them: same logits as eager (3 -> 4, 5 -> 8), same greedy
    tokens as the torch backend and as eager Triton."""
    proc = subprocess.run(
        [sys.executable, str(CHECKS), "--device", "cuda"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ALL OK"), out
    assert "ok   static graphs captured" in proc.stdout and "greedy triton cuda-graphs" in proc.stdout, out


@pytest.mark.gpu
def test_pinned_copies_on_gpu():
    a, b, c = torch.arange(5), torch.tensor([7, 8]), torch.tensor([1.5, 2.5])
    on_dev = torch.arange(3, device="cuda")
    out = host_to_device([a, None, b, c, on_dev], CUDA)
    assert out[1] is None and torch.equal(out[4], on_dev)
    assert [t.device.type for t in (out[0], out[2], out[3])] == ["cuda"] * 3
    assert out[0].tolist() == a.tolist() and out[2].tolist() == [7, 8] and out[3].tolist() == [1.5, 2.5]
    torch.cuda._sleep(50_000_000)  # keep the device busy: the copy below queues behind this
    back = DeviceToHost.start(out[0] * 2)
    assert back.result().tolist() == [0, 2, 4, 6, 8] and back.result().is_pinned()
