"""Issue 17, item 0: what `Engine()` and the server pick for torch threads by default is what the
benchmarks measure: the forward thread gets the physical cores this process may use (affinity,
SMT siblings once, cgroup quota), the event-loop thread gets one (restored when the engine stops)."""

from __future__ import annotations

import torch

from engine import SamplingParams, default_torch_threads
from engine.device.cpu_threads import allowed_cpus, cpu_quota, physical_cores
from tests.test_engine import tiny_engine, tiny_tok_folder  # noqa: F401  (the fixture)


def _cpu(root, cpu: int, package: int, core: int) -> None:
    topology = root / f"cpu{cpu}" / "topology"
    topology.mkdir(parents=True)
    (topology / "physical_package_id").write_text(f"{package}\n")
    (topology / "core_id").write_text(f"{core}\n")


def test_physical_cores_count_smt_siblings_once(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1), (1, 0)]):
        _cpu(tmp_path, cpu, package, core)
    assert physical_cores({0, 1, 2, 3, 4}, tmp_path) == 3
    assert physical_cores({0, 2}, tmp_path) == 1
    assert physical_cores({7, 8}, tmp_path) == 2  # no topology: logical CPUs


def test_cgroup_quota_v2_and_v1(tmp_path):
    assert cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cpu_quota(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert cpu_quota(tmp_path) is None


def test_default_threads_are_this_machines_usable_cores():
    n = default_torch_threads()
    assert 1 <= n <= len(allowed_cpus())


async def test_engine_defaults_keep_the_event_loop_off_the_forwards_cores(tiny_tok_folder):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # whatever the caller had
    try:
        async with tiny_engine(tiny_tok_folder, torch_threads=None) as engine:
            assert torch.get_num_threads() == 1
            threads = (await engine.get_internal_state())["torch_threads"]
            assert threads == {"event_loop": 1, "forward": default_torch_threads()}
        assert torch.get_num_threads() == 2  # given back
        async with tiny_engine(tiny_tok_folder, torch_threads=1) as engine:
            assert (await engine.get_internal_state())["torch_threads"]["forward"] == 1
    finally:
        torch.set_num_threads(before)


async def test_the_model_loads_on_the_forward_thread(tiny_tok_folder, monkeypatch):
    """On a CPU the model loads on the device stream's thread, the one that runs every forward:
    libgomp keeps an OpenMP worker pool per thread that runs parallel regions, and a second pool
    (loading in an executor thread made one) throttles every pool's spin-waits, which made the
    2-thread forwards ~1.35x slower (docs/PERFORMANCE.md)."""
    import threading

    from engine.model_executor.model_runner import ModelRunner

    loaded_on, ran_on = [], []
    init, generate = ModelRunner.__init__, ModelRunner.forward_batch_generation

    def recording_init(self, *args, **kwargs):
        loaded_on.append(threading.current_thread())
        init(self, *args, **kwargs)

    def recording_forward(self, batch):
        ran_on.append(threading.current_thread())
        return generate(self, batch)

    monkeypatch.setattr(ModelRunner, "__init__", recording_init)
    monkeypatch.setattr(ModelRunner, "forward_batch_generation", recording_forward)
    async with tiny_engine(tiny_tok_folder, torch_threads=None) as engine:
        await engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert len(loaded_on) == 1 and ran_on and set(ran_on) == set(loaded_on)
    assert loaded_on[0] is not threading.main_thread()


async def test_the_forward_thread_keeps_its_threads_whatever_the_caller_sets_next():
    """torch applies its process-wide setting to a thread lazily: a stream whose worker had not
    yet run when the caller changed its own threads used to inherit the caller's value."""
    from engine.device.cpu_stream import CpuDeviceStream

    before = torch.get_num_threads()
    try:
        stream = CpuDeviceStream(2)
        torch.set_num_threads(1)  # at once, before the worker thread has necessarily started
        assert await stream.launch(torch.get_num_threads) == 2
        await stream.aclose()
    finally:
        torch.set_num_threads(before)


def test_small_forwards_leave_a_core_to_the_event_loop():
    """StepThreads (engine/model_executor/model_runner.py): on the forward thread, a forward of a
    few tokens runs with one thread fewer than the thread's own count, larger ones with all."""
    import torch

    from engine.model_executor.model_runner import SMALL_STEP_TOKENS, StepThreads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        steps = StepThreads()
        steps.before(1)
        assert torch.get_num_threads() == 1
        steps.before(SMALL_STEP_TOKENS + 1)
        assert torch.get_num_threads() == 2
        steps.before(SMALL_STEP_TOKENS)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(1)
        one = StepThreads()  # a single-thread forward never drops to 0
        one.before(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
