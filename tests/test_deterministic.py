"""Deterministic inference (`--enable-deterministic-inference`, issue 35): batch invariance.

The default model in bf16 (the path whose kernels change with the batch: oneDNN GEMMs, the 4-bit
kernel, cascade attention), and in fp32 with chunked prefill beside other requests. One target
request's logits rows (those its tokens were sampled from) must be bit-identical alone, inside
batches of 4, 16 and 64 mixed requests (joining at start and mid-run), with its prompt prefilled
in 16-token chunks (alone and in a batch), and with its prefix served by the radix cache. Seeded
sampling gives the same tokens in a batch as alone. The fixed row tiles themselves: a row's result
is the same bits at any batch size and position. Decode steps take the fused C++ layer loop on the
same tiles: the same bits as the Python layers.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import SyncScheduler
from engine.errors import InvalidServerArgsError
from engine.kernels import cpu_extension, cpu_quant, cpu_vnni
from engine.layers.linear import (
    BatchInvariantLinear,
    DenseLinear,
    RowTiles,
    VnniLinear,
    finalize_linear,
    onednn_bf16_available,
)
from engine.model_executor.model_runner import ModelRunner
from engine.models import llama
from engine.sampling import SamplingParams
from engine.server_args import ServerArgs, cpu_has_native_bf16
from tests.quant_blocks import random_q4, random_q8

TARGET = "target"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


class LogitsTap(SyncScheduler):
    """Keeps the target request's logits row of every step that sampled one of its tokens."""

    def __init__(self, runner: ModelRunner, args: ServerArgs) -> None:
        super().__init__(runner, args)
        self.rows: list[torch.Tensor] = []
        self.target = None
        self._last: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None
        real = runner.model.compute_logits

        def tap(hidden: torch.Tensor) -> torch.Tensor | None:
            self._last = real(hidden)
            return self._last

        runner.model.compute_logits = tap

    def run(self, lb):
        self._last = None
        result = super().run(lb)
        rows = [i for i, r in enumerate(lb.reqs) if r.rid == TARGET]
        logits = self._last
        self._pending = logits[rows[0]].clone() if rows and logits is not None else None
        return result

    def process(self, lb, result):
        before = len(self.target.output_ids) if self.target is not None else 0
        msg = super().process(lb, result)
        if self.target is not None and len(self.target.output_ids) > before and self._pending is not None:
            self.rows.append(self._pending)
        return msg


def _runner(default_source, deterministic: bool, chunk: int | None, dtype: str = "bfloat16") -> ModelRunner:
    args = ServerArgs(
        dtype=dtype,
        device="cpu",
        max_total_tokens=16384,
        max_running_requests=64,
        chunked_prefill_size=chunk,
        enable_deterministic_inference=deterministic,
    )
    return ModelRunner(args, default_source)


def _others(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 160))],
            SamplingParams(temperature=0.0, max_new_tokens=rng.randrange(1, 30), ignore_eos=True),
        )
        for _ in range(n)
    ]


PROMPT = [(17 * i + 5) % 30000 + 100 for i in range(70)]


def _target_rows(
    runner: ModelRunner, others: int = 0, join_at: int = 0, warm_prefix: bool = False, params=GREEDY
) -> tuple[list[int], list[torch.Tensor], int]:
    """(target's tokens, its logits rows, its cached prompt tokens) in one scenario."""
    sched = LogitsTap(runner, runner.args)
    assert sched.scheduler.flush_cache()
    if warm_prefix:  # another request with the target's first 48 tokens, finished first
        sched.add_request(PROMPT[:48] + [101, 102, 103], SamplingParams(max_new_tokens=2, temperature=0.0))
        sched.run_until_idle()
    for prompt, p in _others(others, seed=others + join_at):
        sched.add_request(prompt, p)

    def join(step: int) -> None:
        if step == join_at and sched.target is None:
            sched.target = sched.add_request(PROMPT, params, rid=TARGET)

    if join_at == 0:
        join(0)
    sched.run_until_idle(on_step=join)
    target = sched.target
    assert target is not None and len(sched.rows) == len(target.output_ids) == params.max_new_tokens
    return target.output_ids, sched.rows, target.cached_tokens


SCENARIOS = [
    dict(others=4),
    dict(others=16, join_at=3),
    dict(others=63),
    dict(warm_prefix=True),
]


@pytest.fixture(scope="module")
def deterministic(default_source) -> ModelRunner:
    return _runner(default_source, True, None)


def test_every_projection_runs_in_fixed_row_tiles(deterministic):
    model = deterministic.model
    inner = {id(m.inner) for m in model.modules() if isinstance(m, BatchInvariantLinear)}
    projections = [m for m in model.modules() if hasattr(m, "output_sizes") and id(m) not in inner]
    assert projections and all(isinstance(m, BatchInvariantLinear) for m in projections if m is not model.lm_head)
    assert isinstance(model.lm_head, BatchInvariantLinear)
    assert deterministic.q4_max_tokens == 0
    # tiles for this CPU: small where bf16 is emulated (a GEMM costs the same per row there)
    tiles = model.row_tiles
    want = (64, 256) if onednn_bf16_available() else RowTiles.EMULATED_BF16
    assert (tiles.decode, tiles.extend) == want
    assert (RowTiles.for_weights(torch.float32, torch.device("cpu")).decode, RowTiles.DECODE) == (64, 64)
    if cpu_quant.vectorized():  # the fused decode loop is built (AVX512-BF16) and runs on the tiles too
        # (VNNI pairs need no tiles: without blocks, the loop takes every forward)
        vnni = all(isinstance(m.inner, VnniLinear) for m in projections)
        assert model.fused_decode is not None and model.fused_decode.tiled == (tiles.decode_blocks or not vnni)
        # decode-like forwards run the GGUF's blocks (Q4_1 layers, Q8_0 head) at every row count
        # where they beat the padded tiles here (measured at load: AMX runs the tiles fast)
        assert all((m.blocks is not None) == tiles.decode_blocks for m in projections)
    assert deterministic.step_threads is not None and deterministic.step_threads.pin_extend


@pytest.mark.skipif(not cpu_quant.vectorized(), reason="no AVX512-BF16 build: no fused decode layers")
def test_fused_decode_loop_gives_the_python_layers_bits(deterministic):
    """Decode steps run the C++ layer loop on the same row tiles as the Python layers: the target's
    logits are the same bits either way, alone and in a batch."""
    model = deterministic.model
    fused, calls = model.fused_decode, {"n": 0}
    real = fused.forward

    def counting(*args, **kw):
        calls["n"] += 1
        return real(*args, **kw)

    fused.forward = counting
    try:
        ids, rows, _ = _target_rows(deterministic, others=5)
        assert calls["n"] >= GREEDY.max_new_tokens - 1  # every decode step took the loop
        model.fused_decode = None
        ids_py, rows_py, _ = _target_rows(deterministic, others=5)
    finally:
        model.fused_decode = fused
        fused.forward = real
    assert ids == ids_py and all(torch.equal(a, b) for a, b in zip(rows, rows_py))


# Without native bf16 (an AVX2-only CPU) bf16 matmuls run ~5x slower than fp32 ones: ~11 min here.
@pytest.mark.timeout(300 if cpu_has_native_bf16() else 1800)
def test_logits_are_bit_identical_in_any_batch_chunking_and_radix_state(deterministic, default_source):
    base_ids, base_rows, _ = _target_rows(deterministic)
    for scenario in SCENARIOS:
        ids, rows, cached = _target_rows(deterministic, **scenario)
        assert ids == base_ids, scenario
        assert all(torch.equal(a, b) for a, b in zip(rows, base_rows)), scenario
        if scenario.get("warm_prefix"):
            assert cached >= 48  # the radix cache served the prefix
    chunked = _runner(default_source, True, 16)
    for scenario in (dict(), dict(others=8, join_at=2)):
        ids, rows, _ = _target_rows(chunked, **scenario)
        assert ids == base_ids and all(torch.equal(a, b) for a, b in zip(rows, base_rows)), ("chunked", scenario)


def test_float32_chunked_prefill_in_a_batch_gives_the_same_bits(default_source):
    """float32 (what `dtype auto` gives on CPUs without native bf16): the target's prompt in
    16-token chunks beside 8 others that shift its chunk boundaries, against it alone, unchunked.
    bf16 rounding can hide an ulp that fp32 shows (the attention kernel's fused multiply-adds did)."""
    alone = _runner(default_source, True, None, dtype="float32")
    base_ids, base_rows, _ = _target_rows(alone)
    del alone
    chunked = _runner(default_source, True, 16, dtype="float32")
    ids, rows, _ = _target_rows(chunked, others=8, join_at=2)
    assert ids == base_ids
    assert [i for i, (a, b) in enumerate(zip(rows, base_rows)) if not torch.equal(a, b)] == []


def test_seeded_sampling_gives_the_same_tokens_in_a_batch(deterministic):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=12, seed=7, ignore_eos=True)
    alone, _, _ = _target_rows(deterministic, params=params)
    batched, _, _ = _target_rows(deterministic, others=16, join_at=2, params=params)
    assert alone == batched


@pytest.mark.parametrize(
    "dtype,sizes",
    [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, RowTiles.EMULATED_BF16), (torch.float32, "model")],
    ids=["bf16", "fp32", "bf16-emulated-tiles", "fp32-model-tiles"],
)
@pytest.mark.parametrize("decode", [True, False])
def test_a_rows_result_depends_on_that_row_alone(dtype, sizes, decode):
    """`BatchInvariantLinear` over the LM head's shape (the widest GEMM): in either mode's tiles
    (the default ones, the small ones of a CPU without native bf16, and an fp32 model's, whose
    decode runs the fp32 loop in 8-row groups), a row's output is the same bits at batch sizes
    1..300 and at any position, beside random neighbours; a decode tile's also with one thread
    fewer (small decodes run so: StepThreads)."""
    torch.manual_seed(0)
    dense = DenseLinear(576, (49152 if decode else 1728,), False, torch.device("cpu"), dtype)
    dense.weight.data.normal_(0, 0.05)
    if sizes == "model":  # what an fp32 CPU model gets: decode-like forwards on the fp32 loop
        tiles = RowTiles.for_weights(dtype, torch.device("cpu"))
        assert tiles.decode_loop == (cpu_extension.load() is not None)
    else:
        tiles = RowTiles(*sizes) if sizes else RowTiles()
    tiles.select(decode)
    assert tiles.loop == (decode and tiles.decode_loop)
    linear = finalize_linear(dense, None, 0, tiles)
    assert isinstance(linear, BatchInvariantLinear)
    probe = torch.randn(576).to(dtype)
    alone = linear(probe[None])[0]
    threads = torch.get_num_threads()
    for m in (2, 15, 16, 17, 33, 70) if decode else (2, 255, 256, 300):
        x = torch.randn(m, 576).to(dtype)
        at = m // 2
        x[at] = probe
        assert torch.equal(linear(x)[at], alone), m
        if decode and threads > 1:
            try:
                torch.set_num_threads(threads - 1)
                assert torch.equal(linear(x)[at], alone), (m, "threads")
            finally:
                torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_block_forms_give_a_decode_row_the_same_bits_in_any_batch(kind, dtype):
    """A projection with a block form (a GGUF's Q4/Q8_0) runs it for decode-like forwards of any
    size, no row bound, in fp32 and (AVX512-BF16) bf16: a row's result is the same bits at batch
    sizes 1..70, at any position and with one thread fewer; extends keep the dense tiles."""
    if not cpu_quant.vectorized(dtype) or (dtype == torch.bfloat16 and not onednn_bf16_available()):
        pytest.skip(f"no {dtype} block loops on this CPU")
    cpu = torch.device("cpu")
    blocks = random_q4(1728, 576, 3) if kind == "q4" else random_q8(1728, 576, 3)
    dense = DenseLinear(576, (1728,), False, cpu, dtype)
    dense.weight.data.copy_(blocks.dequantize())
    tiles = RowTiles.for_weights(dtype, cpu)
    assert tiles.decode_blocks
    linear = finalize_linear(dense, blocks.pack(dtype), 0, tiles)
    assert isinstance(linear, BatchInvariantLinear) and linear.blocks is not None
    plain = BatchInvariantLinear(linear.inner, tiles)  # the dense form alone
    torch.manual_seed(0)
    probe = torch.randn(576).to(dtype)
    tiles.select(True)
    alone = linear(probe[None])[0]
    assert not torch.equal(alone, plain(probe[None])[0])  # the blocks ran, not the dense loop
    threads = torch.get_num_threads()
    for m in (2, 9, 16, 33, 70):
        x = torch.randn(m, 576).to(dtype)
        at = m // 2
        x[at] = probe
        assert torch.equal(linear(x)[at], alone), m
        if threads > 1:
            try:
                torch.set_num_threads(threads - 1)
                assert torch.equal(linear(x)[at], alone), (m, "threads")
            finally:
                torch.set_num_threads(threads)
    tiles.select(False)
    x = torch.randn(5, 576).to(dtype)
    assert torch.equal(linear(x), plain(x))


@pytest.mark.skipif(not cpu_quant.vectorized(), reason="no AVX512-BF16 build: no bf16 block loops")
def test_bf16_decode_takes_the_blocks_only_where_they_beat_the_tiles(default_source, monkeypatch):
    """The load-time measurement decides; where the dense form wins (padded tiles on an AMX CPU),
    no projection keeps its blocks and the fused loop runs the tiles, or (VNNI pairs, whose rows
    need no tiles) takes every forward."""
    tiles = RowTiles.for_weights(torch.bfloat16, torch.device("cpu"))
    assert tiles.decode_blocks == onednn_bf16_available()  # a candidate wherever the tiles are oneDNN's
    for wins in (False, True):
        monkeypatch.setattr(llama, "blocks_beat_padded_tiles", lambda linears, dtype, wins=wins: wins)
        model = _runner(default_source, True, None).model
        invariant = [m for m in model.modules() if isinstance(m, BatchInvariantLinear)]
        assert model.row_tiles.decode_blocks == wins
        assert invariant and all((m.blocks is not None) == wins for m in invariant)
        vnni = all(isinstance(m.inner, VnniLinear) for m in invariant)
        assert vnni == cpu_vnni.available()
        assert model.fused_decode is not None and model.fused_decode.tiled == (wins or not vnni)


def test_mixed_chunk_is_refused(default_source):
    args = ServerArgs(device="cpu", enable_deterministic_inference=True, enable_mixed_chunk=True)
    with pytest.raises(InvalidServerArgsError, match="enable_mixed_chunk"):
        args.verify()
