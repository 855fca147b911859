"""A MoE layer's experts in a GGUF's own blocks (issue 31; engine/layers/moe_quant.py,
csrc/cpu_moe_quant.cpp), bf16 and fp32 models.

- The C++ experts against the torch path on the blocks' dequantized values, every block kind the
  dense projections take (Q4_0, Q4_1, Q8_0 from gguf's quantizer; Q4_K, Q6_K, Q5_K as llama.cpp's
  bytes; a gate|up of two kinds side by side), one token to a prefill's worth (the tiles): equal
  within fp32 summation-order noise; bf16 within a few bf16 steps. Expert sets (expert
  parallelism) skip the others' pairs and sum to the whole.
- Loading keeps no dense copy of experts held in blocks, and a layer that turns dense part way
  (a projection without blocks, or blocks no kernel takes) holds every expert's exact values.
- A Qwen3-MoE GGUF with Q4_0 / Q4_1 experts, and one shaped like llama.cpp's Q4_K_M (Q4_K gate
  and up, Q6_K down), served in fp32: every MoE layer runs its experts in blocks, decode steps and
  prefill chunks alike, and greedy tokens and prompt log-probs equal transformers' on the GGUF's
  weights through the real scheduler; in bf16 the Q4_K_M file passes the bf16 bar.
- The fused C++ decode loop takes such a model (bf16 and fp32), bit-identical to the Python
  layers on every forward; dense experts too, within their one-call kernel's bound.
- A weight update goes back to dense experts (the new values run dense); `--torchao-config
  int4wo-*` and `int8wo` quantize a Hugging Face checkpoint's experts into the same forms; the
  quantized path off (`--q4-max-tokens 0`) keeps none.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from engine import SyncScheduler
from engine.distributed.parallel_state import TPGroup
from engine.layers.int4 import Q4Blocks
from engine.layers.moe import FusedMoE
from engine.layers.moe_quant import EXPERT_PROJS, QuantExperts
from engine.layers.q8 import Q8Blocks
from engine.model_executor.model_runner import ModelRunner
from engine.models.gguf_blocks import q4k_blocks, q5k_blocks, q6k_blocks
from engine.models.loader import resolve_model
from engine.sampling import SamplingParams
from tests.fused_checks import check_every_fused_forward
from tests.test_gguf_families import CONFIG, per_expert, tiny_qwen3moe, write_qwen3moe_gguf
from tests.test_gguf_kquants import kquant_bytes
from tests.test_model_families import (
    assert_bf16_bar,
    assert_scheduler_matches_transformers,
    family_args,
    save_random_model,
)
from tests.test_model_moe import INIT, assert_greedy_tokens

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = (GGMLQuantizationType[t] for t in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
F32 = pytest.mark.skipif(not QuantExperts.available(torch.float32), reason="no fp32 block loops on this CPU")
BF16 = pytest.mark.skipif(not QuantExperts.available(torch.bfloat16), reason="no bf16 block loops on this CPU")

SHAPE = dict(CONFIG, moe_intermediate_size=64)  # K of every expert product a multiple of 64
K_SHAPE = dict(CONFIG, hidden_size=256, head_dim=64, moe_intermediate_size=256)  # the K-quants' 256-wide blocks
K_READERS = {Q4_K: q4k_blocks, Q5_K: q5k_blocks, Q6_K: q6k_blocks}


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> Q4Blocks | Q8Blocks:
    """An [rows, cols] matrix's blocks of `kind`, small random values (~0.1)."""
    if kind in K_READERS:
        return K_READERS[kind](kquant_bytes(kind, rows, cols, np.random.default_rng(seed)), (rows, cols))
    g = torch.Generator().manual_seed(seed)
    if kind == Q8_0:
        q = torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8)
        return Q8Blocks(q, (torch.rand(rows, cols // 32, generator=g) * 1e-3 + 2e-4).half().float(), 32)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = (torch.rand(rows, cols // 32, generator=g) * 0.02 + 0.005).half().float()
    offset = (torch.randn(rows, cols // 32, generator=g) * 0.05).half().float() if kind == Q4_1 else -8 * scale
    return Q4Blocks(q, scale, offset, 32)


def layer_with_blocks(
    kinds: dict[str, GGMLQuantizationType], dtype: torch.dtype, start: int = 0, count: int | None = None
) -> tuple[FusedMoE, torch.Tensor, torch.Tensor]:
    """A FusedMoE whose experts are random blocks of `kinds` (by projection), built as the loader
    does, and the dense stacks of their exact values (fp32) for the torch path."""
    experts, hidden, inter = 8, 256, 256
    count = experts if count is None else count
    moe = FusedMoE(hidden, experts, 2, inter, "silu", True, False, TPGroup.single(), torch.device("cpu"), dtype,
                   start, count)  # fmt: skip
    moe.gate.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(5))
    w13, w2 = torch.zeros(count, 2 * inter, hidden), torch.zeros(count, hidden, inter)
    for e in range(start, start + count):  # an expert's blocks whatever the rank holds
        for i, proj in enumerate(EXPERT_PROJS):
            shape = moe.expert_shape(proj)
            blocks = random_blocks(kinds[proj], *shape, seed=100 * e + i)
            values = blocks.dequantize()
            target = w2[e - start] if proj == "down_proj" else w13[e - start, i * inter : (i + 1) * inter]
            target.copy_(values)
            assert moe.keep_blocks(e, proj, blocks, values)
    moe.finish_loading(quantized=True)
    return moe, w13, w2


def torch_experts(moe: FusedMoE, w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The torch path (FusedMoE.experts) in fp32 on the dense values."""
    shape = (moe.gate.shape[1], moe.num_experts, moe.top_k, moe.intermediate_size)
    sets = (moe.expert_start, moe.num_local_experts)
    dense = FusedMoE(*shape, "silu", True, False, TPGroup.single(), torch.device("cpu"), torch.float32, *sets)
    dense.gate.data.copy_(moe.gate.float())
    dense.w13.data.copy_(w13)
    dense.w2.data.copy_(w2)
    weights, ids = dense.route(x.float())
    return dense.experts(x.float(), weights, ids)


KINDS = {
    "q4_0": dict.fromkeys(EXPERT_PROJS, Q4_0),
    "q4_1": dict.fromkeys(EXPERT_PROJS, Q4_1),
    "q8_0": dict.fromkeys(EXPERT_PROJS, Q8_0),
    "q4_k_m": dict(gate_proj=Q4_K, up_proj=Q4_K, down_proj=Q6_K),  # llama.cpp's Q4_K_M experts
    "q5_k": dict.fromkeys(EXPERT_PROJS, Q5_K),
    "gate_up_of_two_kinds": dict(gate_proj=Q4_K, up_proj=Q6_K, down_proj=Q4_0),  # side by side
}


@pytest.mark.parametrize("rows", [1, 3, 40])  # decode, a small batch, tiles (more rows than the bound)
@pytest.mark.parametrize("kinds", sorted(KINDS))
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=F32), pytest.param(torch.bfloat16, marks=BF16)])
def test_experts_in_blocks_equal_the_torch_path_on_their_values(kinds, dtype, rows):
    moe, w13, w2 = layer_with_blocks(KINDS[kinds], dtype)
    assert moe.quant is not None and moe.w13.numel() == moe.w2.numel() == 0  # no dense copy
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = moe(x)
    assert got.dtype == dtype and got.shape == x.shape
    want = torch_experts(moe, w13, w2, x)
    scale = float(want.abs().max())
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # summation order; bf16: its roundings of each step
    assert float((got.float() - want).abs().max()) <= tolerance * scale


@F32
def test_expert_sets_sum_to_the_whole_layer():
    kinds = KINDS["q4_k_m"]
    whole, _, _ = layer_with_blocks(kinds, torch.float32)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2))
    weights, ids = whole.route(x)
    want = whole.quant.run(x, ids, weights.float())
    total = torch.zeros_like(x)
    for start in (0, 4):
        part, _, _ = layer_with_blocks(kinds, torch.float32, start=start, count=4)
        got = part.quant.run(x, ids - start, weights.float())
        local = ids - start
        routed_here = (local.ge(0) & local.lt(4)).any(1)
        assert not got[~routed_here].any()  # tokens with none of this set's experts get nothing
        total += got
    torch.testing.assert_close(total, want, atol=1e-5 * float(want.abs().max()), rtol=0.0)


@F32
@pytest.mark.parametrize("why", ["a projection without blocks", "blocks no kernel takes", "the quantized path off"])
def test_a_layer_that_turns_dense_holds_every_experts_values(why):
    """Kept projections are never copied in dense while loading; when the layer cannot run its
    experts in blocks after all, the stacks get every expert's exact values."""
    inter = 32 if why == "blocks no kernel takes" else 64  # down's K = 32: no kernel form
    moe = FusedMoE(64, 4, 2, inter, "silu", True, False, TPGroup.single(), torch.device("cpu"), torch.float32)
    moe.w13.data.fill_(float("nan"))  # what an untouched allocation may hold
    moe.w2.data.fill_(float("nan"))
    want: dict[tuple[int, str], torch.Tensor] = {}
    for e in range(4):
        for i, proj in enumerate(EXPERT_PROJS):
            blocks = random_blocks(Q4_1, *moe.expert_shape(proj), seed=10 * e + i)
            values = blocks.dequantize()
            want[(e, proj)] = values
            dense_only = why == "a projection without blocks" and (e, proj) == (2, "up_proj")
            if not moe.keep_blocks(e, proj, None if dense_only else blocks, values):
                moe.expert_weight(e, proj).copy_(values)  # as the loader does
    moe.finish_loading(quantized=why != "the quantized path off")
    assert moe.quant is None
    for (e, proj), values in want.items():
        assert torch.equal(moe.expert_weight(e, proj), values), (e, proj)


class _Counting:
    def __init__(self, native, calls: list[int]) -> None:
        self.native, self.calls = native, calls

    def forward(self, x, ids, weights):
        self.calls.append(x.shape[0])
        return self.native.forward(x, ids, weights)


def moe_gguf(tmp_path, qtype: GGMLQuantizationType | None, seed: int = 0, **shape):
    """A tiny Qwen3-MoE GGUF with `qtype` experts (None: Q4_K_M-like K-quant bytes), and
    transformers' model of its values."""
    model = tiny_qwen3moe(seed, **(shape or SHAPE))
    path = tmp_path / f"moe-{qtype.name if qtype else 'q4_k_m'}.gguf"
    rng = np.random.default_rng(seed)

    def k_m(proj: str, shape: tuple[int, int, int]):
        kind = Q6_K if proj == "down" else Q4_K
        e, n, k = shape
        return kind, kquant_bytes(kind, e * n, k, rng).reshape(e, n, -1)

    write_qwen3moe_gguf(path, model, qtype or Q4_K, expert_bytes=None if qtype else k_m)
    src = resolve_model(str(path))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=src.hf_config,
                                               dtype=torch.float32).eval()  # fmt: skip
    return path, ref


def count_calls(runner: ModelRunner) -> tuple[list[FusedMoE], list[int]]:
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    calls: list[int] = []
    for m in moe:
        m.quant.native = _Counting(m.quant.native, calls)
    return moe, calls


@F32
@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, None])
def test_experts_in_blocks_from_a_gguf_serve_transformers_tokens(qtype, tmp_path):
    path, ref = moe_gguf(tmp_path, qtype, **({} if qtype else K_SHAPE))
    runner = ModelRunner(family_args(str(path), disable_fused_decode=True))  # the Python layers: calls counted
    moe, calls = count_calls(runner)
    assert moe and all(m.quant is not None and m.w13.numel() == 0 for m in moe)
    if qtype is None:
        kinds = {type(f).__name__ for m in moe for pair in m.quant.forms for f in pair}
        assert kinds == {"TiledQ4Weight", "Q8Weight"}  # Q4_K tiles and Q6_K blocks
    assert_scheduler_matches_transformers(runner, ref, f"qwen3moe-{qtype.name if qtype else 'q4_k_m'}")
    assert sum(1 for t in calls if t == 1) >= 5 * len(moe)  # decode steps of one request
    assert max(calls) > 8  # prefill chunks too: the experts' only form


@BF16
def test_a_bf16_q4_k_m_moe_file_passes_the_bf16_bar(tmp_path):
    path, ref = moe_gguf(tmp_path, None, **K_SHAPE)
    runner = ModelRunner(family_args(str(path), dtype="bfloat16", disable_fused_decode=True))
    moe, calls = count_calls(runner)
    assert all(m.quant is not None for m in moe)
    assert_bf16_bar(runner, ref, "qwen3moe-q4_k_m-bf16", vocab=160, lengths=(4, 37, 12), new_tokens=12)
    assert 1 in calls or 3 in calls  # decode steps ran the blocks


@F32
def test_a_weight_update_goes_back_to_dense_experts(tmp_path):
    path, _ = moe_gguf(tmp_path, Q4_0)
    (tmp_path / "other").mkdir()
    _, other = moe_gguf(tmp_path / "other", Q4_1, seed=1)
    runner = ModelRunner(family_args(str(path)))
    named = list(per_expert(other).items())
    assert runner.update_weights_from_tensor(named) == len(named)
    assert all(m.quant is None and m.w13.numel() > 0 for m in runner.model.modules() if isinstance(m, FusedMoE))
    assert_greedy_tokens(runner, other)


@F32
@pytest.mark.parametrize("config", ["int4wo-32", "int8wo"])
def test_torchao_configs_quantize_a_checkpoints_experts_into_the_same_forms(config, tmp_path):
    save_random_model(Qwen3MoeConfig(**SHAPE, norm_topk_prob=True), INIT, tmp_path)
    runner = ModelRunner(family_args(str(tmp_path), torchao_config=config))
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.quant is not None for m in moe)
    prompts = [[(7 * j + 3 * i) % 160 for j in range(12 + 5 * i)] for i in range(3)]

    def greedy() -> list[list[int]]:
        sched = SyncScheduler(runner, runner.args)
        reqs = [sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=12)) for p in prompts]
        sched.run_until_idle()
        return [r.output_ids for r in reqs]

    blocks = greedy()
    for m in moe:  # the same values, dense
        m.drop_quantized()
    assert greedy() == blocks
    off = ModelRunner(family_args(str(tmp_path), torchao_config=config, q4_max_tokens=0))
    assert all(m.quant is None for m in off.model.modules() if isinstance(m, FusedMoE))


@pytest.mark.parametrize(
    "dtype", [pytest.param("float32", marks=F32), pytest.param("bfloat16", marks=BF16)]
)  # fmt: skip
def test_moe_layers_with_experts_in_blocks_run_in_the_fused_loop_bit_identically(dtype, tmp_path, monkeypatch):
    """The fused C++ decode loop takes a MoE model whose experts run in blocks: the router's ops
    and the experts' call from C++, every forward (decodes of 1..4 rows, prefills) bit-identical to
    the Python layers on the same input, and the same greedy tokens as with the loop off."""
    path, _ = moe_gguf(tmp_path, None, **K_SHAPE)
    args = dict(dtype=dtype, q4_max_tokens=2, chunked_prefill_size=None)
    runner = ModelRunner(family_args(str(path), **args))
    assert runner.model.fused_decode is not None
    seen = check_every_fused_forward(monkeypatch, runner.model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (7, 19, 3, 30)]

    def greedy(runner: ModelRunner) -> list[list[int]]:  # requests leave one by one: 4, 3, 2, 1 rows
        sched = SyncScheduler(runner)
        lengths = (10, 3, 6, 8)
        params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in lengths]
        reqs = [sched.add_request(p, sp) for p, sp in zip(prompts, params)]
        sched.run_until_idle()
        return [r.output_ids for r in reqs]

    fused_out = greedy(runner)
    decode_rows = {rows for mode, rows in seen if mode == "DECODE"}
    assert {1, 4} <= decode_rows and any(mode == "EXTEND" for mode, _ in seen)  # blocks at 1-2 rows, tiles above

    monkeypatch.undo()
    plain = ModelRunner(family_args(str(path), disable_fused_decode=True, **args))
    assert plain.model.fused_decode is None
    assert greedy(plain) == fused_out


@pytest.mark.parametrize(
    "dtype", [pytest.param("float32", marks=F32), pytest.param("bfloat16", marks=BF16)]
)  # fmt: skip
def test_dense_experts_run_in_the_fused_loop_within_the_kernels_bound(dtype, tmp_path, monkeypatch):
    """A Hugging Face checkpoint's dense experts: the loop calls their one-call kernel (cpu_moe.cpp)
    for forwards of at most `kernel_max_pairs // top_k` tokens, as FusedMoE.forward does, bit-identical
    to the Python layers; a longer prefill keeps the Python layers (their grouped path)."""
    save_random_model(Qwen3MoeConfig(**dict(SHAPE, head_dim=64, hidden_size=128), norm_topk_prob=True), INIT, tmp_path)
    args = dict(dtype=dtype, chunked_prefill_size=None)
    runner = ModelRunner(family_args(str(tmp_path), **args))
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.quant is None and m.kernel is not None for m in moe)
    fused = runner.model.fused_decode
    assert fused is not None and fused.max_tokens == moe[0].kernel_max_pairs // moe[0].top_k
    seen = check_every_fused_forward(monkeypatch, runner.model)
    long = fused.max_tokens + 9
    prompts = [[(7 * j + 3 * i) % 160 for j in range(n)] for i, n in enumerate((5, long, 12))]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (6, 3, 9)]

    def greedy(r: ModelRunner) -> list[list[int]]:
        sched = SyncScheduler(r)
        reqs = [sched.add_request(p, sp) for p, sp in zip(prompts, params)]
        sched.run_until_idle()
        return [q.output_ids for q in reqs]

    out = greedy(runner)
    assert {"DECODE"} <= {mode for mode, _ in seen} and max(rows for _, rows in seen) <= fused.max_tokens
    monkeypatch.undo()
    assert greedy(ModelRunner(family_args(str(tmp_path), disable_fused_decode=True, **args))) == out


@BF16
def test_the_prepacked_router_follows_a_weight_update(tmp_path):
    """bf16: the router runs prepacked for oneDNN (the same bits as F.linear); a weight update
    repacks it from the new values."""
    path, _ = moe_gguf(tmp_path, Q4_0)
    (tmp_path / "other").mkdir()
    _, other = moe_gguf(tmp_path / "other", Q4_0, seed=1)
    runner = ModelRunner(family_args(str(path), dtype="bfloat16"))
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    x = torch.randn(5, moe[0].in_features, generator=torch.Generator().manual_seed(3)).bfloat16()

    def routed_as_f_linear() -> bool:
        for m in moe:
            assert m.router_packed is not None
            packed = m.route(x)
            m.router_packed, plain = None, m.route(x)
            m.pack_router()
            if not all(torch.equal(a, b) for a, b in zip(packed, plain)):
                return False
        return True

    assert routed_as_f_linear()
    named = [(n, t) for n, t in per_expert(other).items() if n.endswith("mlp.gate.weight")]
    assert runner.update_weights_from_tensor(named) == len(named)
    assert all(torch.equal(m.gate, other.get_parameter(n).bfloat16()) for m, (n, _) in zip(moe, named))
    assert routed_as_f_linear()
