"""Issue 17, item 0: what `Engine()` and the server pick for torch threads by default is what the
benchmarks measure: the forward thread gets the physical cores this process may use (affinity,
SMT siblings once, cgroup quota), the event-loop thread gets one (restored when the engine stops)."""

from __future__ import annotations

import pytest
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
    """StepThreads (engine/device/step_threads.py): on the forward thread, a forward of a few
    tokens runs with one thread fewer than the thread's own count (unless measured otherwise up to
    some tokens), larger ones with all."""
    import torch

    from engine.device.step_threads import SMALL_STEP_TOKENS, StepThreads

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
        torch.set_num_threads(2)
        lone = StepThreads(every_core_tokens=2)  # measured: steps of 1-2 streams gain from every core
        lone.before(1)
        assert torch.get_num_threads() == 2
        lone.before(3)
        assert torch.get_num_threads() == 1
        lone.before(2)
        assert torch.get_num_threads() == 2
        assert [lone.threads_for(n, 4) for n in (1, 2, 3, SMALL_STEP_TOKENS, SMALL_STEP_TOKENS + 1)] == [4, 4, 3, 3, 4]
        pinned = StepThreads(pin_extend=True)
        assert pinned.threads_for(1, 2, extend=True) == 2 and pinned.threads_for(1, 2) == 1
    finally:
        torch.set_num_threads(before)


class FakeClock:
    """perf_counter for step_threads: a one-row pass advances it by its cost at the current count."""

    def __init__(self, cost_s: dict[int, float]) -> None:
        self.now, self.cost_s, self.calls = 0.0, cost_s, []

    def perf_counter(self) -> float:
        return self.now

    def one_row_pass(self) -> None:
        self.calls.append(torch.get_num_threads())
        self.now += self.cost_s[torch.get_num_threads()]


@pytest.mark.parametrize(
    ("cost_s", "want"),
    [
        ({1: 0.009, 2: 0.0075}, 0),  # a small model: every core saves 1.5 ms, less than one stream's event loop
        ({1: 0.0116, 2: 0.0079}, 1),  # the default model in bf16 (AVX-512): every core for a lone stream
        ({1: 0.0103, 2: 0.0059}, 2),  # the default model in fp32 (AVX2): 4.4 ms, one or two streams
        ({1: 0.315, 2: 0.130}, 8),  # a 1B-class model: one core cannot stream its weights
    ],
)
def test_small_step_threads_are_measured_per_model(monkeypatch, cost_s, want):
    """measure_small_step_threads times the model's one-row pass with each count, alternately,
    and keeps every core for small forwards of up to as many tokens as the saving outweighs their
    event-loop work; the forward thread's count is restored; a model loaded again in the process
    is answered from its first measurement."""
    from engine.device import step_threads

    clock = FakeClock(cost_s)
    monkeypatch.setattr(step_threads, "perf_counter", clock.perf_counter)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert step_threads.measure_small_step_threads(clock.one_row_pass, 2) == want
        assert torch.get_num_threads() == 2
        assert clock.calls[:4] == [1, 2, 1, 2]  # warm-up with each, then alternating
        # one thread: nothing to leave free
        assert step_threads.measure_small_step_threads(clock.one_row_pass, 1) == step_threads.SMALL_STEP_TOKENS
        monkeypatch.setattr(step_threads, "_measured", {})
        assert step_threads.measure_small_step_threads(clock.one_row_pass, 2, key=("model",)) == want
        calls = len(clock.calls)
        clock.cost_s = {1: 0.2, 2: 0.1} if want < 8 else {1: 0.1, 2: 0.1}  # would now choose another
        assert step_threads.measure_small_step_threads(clock.one_row_pass, 2, key=("model",)) == want
        assert len(clock.calls) == calls  # the same model again in this process: not re-measured
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("cost_s", "want"),
    [
        ({1: 0.009, 2: 0.0068}, 8),  # 24% less: the event loop would wait on the GIL with either count
        ({1: 0.0106, 2: 0.0063}, 8),  # the default model's fp32 Q4_1 pass on a 2-core AVX2 CPU, in Python
        ({1: 0.0100, 2: 0.0095}, 0),  # 5% less: within noise, leave the core
    ],
)
def test_a_forward_in_python_keeps_every_core_that_shortens_it(monkeypatch, cost_s, want):
    """Without the GIL-free fused loop the event loop cannot use a free core while a forward runs
    Python between its ops, so only a relative gain (PYTHON_STEP_MARGIN) decides."""
    from engine.device import step_threads

    clock = FakeClock(cost_s)
    monkeypatch.setattr(step_threads, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(step_threads, "_measured", {})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert step_threads.measure_small_step_threads(clock.one_row_pass, 2, gil_free=False) == want
        assert torch.get_num_threads() == 2
        # the same projections measured for a GIL-free forward are another question, not a cache hit
        fused = step_threads.measure_small_step_threads(clock.one_row_pass, 2, key=("m",), gil_free=True)
        assert step_threads.measure_small_step_threads(clock.one_row_pass, 2, key=("m",), gil_free=False) == want
        assert fused == int((cost_s[1] - cost_s[2]) / step_threads.EVENT_LOOP_S_PER_TOKEN)
    finally:
        torch.set_num_threads(before)


def test_the_kernels_keep_a_thread_s_own_count_once_adopted():
    """The C++ kernels carry their own copy of ATen's once-per-thread init, which adopts torch's
    process-wide count (the last torch.set_num_threads of any thread) at the library's first
    parallel call on a thread; `adopt_thread_count` settles it to the thread's own count first."""
    import queue
    import threading

    from engine.kernels import cpu_extension

    module = cpu_extension.load()
    if module is None:
        pytest.skip("the CPU kernels are not built here")
    jobs, results = queue.Queue(), queue.Queue()

    def worker():
        torch.set_num_threads(2)
        cpu_extension.adopt_thread_count()
        while (job := jobs.get()) is not None:
            results.put(job())

    before = torch.get_num_threads()
    thread = threading.Thread(target=worker)
    thread.start()
    try:
        jobs.put(torch.get_num_threads)
        assert results.get(timeout=60) == 2
        torch.set_num_threads(1)  # another thread (the event loop) sets its own
        x = torch.randn(64, 1024).to(torch.bfloat16)
        jobs.put(lambda: module.argmax_rows(x))  # the kernels' first parallel call on the worker
        results.get(timeout=60)
        jobs.put(torch.get_num_threads)
        assert results.get(timeout=60) == 2
    finally:
        jobs.put(None)
        thread.join()
        torch.set_num_threads(before)


async def test_every_forward_runs_with_the_forward_threads(tiny_tok_folder, monkeypatch):
    """An engine whose forward thread has 2 threads keeps them for every forward, after the C++
    kernels' first call too (it used to drop to the event loop's 1 there)."""
    from engine.kernels import cpu_extension
    from engine.model_executor.model_runner import ModelRunner

    if cpu_extension.load() is None:
        pytest.skip("the CPU kernels are not built here")
    seen = []
    generate = ModelRunner.forward_batch_generation

    def recording(self, batch):
        out = generate(self, batch)
        seen.append(torch.get_num_threads())
        return out

    monkeypatch.setattr(ModelRunner, "forward_batch_generation", recording)
    before = torch.get_num_threads()
    try:
        async with tiny_engine(tiny_tok_folder, dtype="bfloat16", torch_threads=2) as engine:
            for _ in range(2):
                await engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=4))
    finally:
        torch.set_num_threads(before)
    assert len(seen) >= 8 and set(seen) == {2}, seen


async def test_a_new_forward_thread_keeps_its_count_through_the_loaded_kernels():
    """A CPU device stream started after the C++ kernels are loaded (a second engine in the
    process) settles their thread count at its start, before anything else runs on it."""
    from engine.device.cpu_stream import CpuDeviceStream
    from engine.kernels import cpu_extension

    module = cpu_extension.load()
    if module is None:
        pytest.skip("the CPU kernels are not built here")
    before = torch.get_num_threads()
    x = torch.randn(64, 1024).to(torch.bfloat16)
    try:
        stream = CpuDeviceStream(2)
        assert await stream.launch(torch.get_num_threads) == 2
        torch.set_num_threads(1)  # the event loop's own, as Engine.start sets it
        await stream.launch(module.argmax_rows, x)  # the kernels' first parallel call there
        assert await stream.launch(torch.get_num_threads) == 2
        await stream.aclose()
    finally:
        torch.set_num_threads(before)
