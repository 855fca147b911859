"""A MoE layer's experts in a GGUF's 4-bit blocks (issue 31; engine/layers/moe_q4.py, fp32 models).

- The kernel (`moe_experts_q4`) against the fp32 experts kernel on the blocks' dequantized values:
  equal within fp32 summation-order noise; expert sets (expert parallelism) skip the others' pairs
  and sum to the whole; Q4_0- and Q4_1-shaped blocks.
- A Qwen3-MoE GGUF with Q4_0 / Q4_1 experts, served in fp32: every MoE layer keeps its 4-bit
  experts, decode steps run them, and greedy tokens and prompt log-probs equal transformers' on
  the GGUF's (dequantized) weights through the real scheduler.
- A weight update drops the 4-bit experts (the new values run dense); `--torchao-config int4wo-*`
  quantizes a Hugging Face checkpoint's experts into the same form; the quantized path off
  (`--q4-max-tokens 0`) keeps none.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from engine import SyncScheduler
from engine.distributed.parallel_state import TPGroup
from engine.layers.int4 import Q4Blocks
from engine.layers.moe import FusedMoE
from engine.layers.moe_q4 import EXPERT_PROJS, Q4Experts
from engine.model_executor.model_runner import ModelRunner
from engine.models.loader import resolve_model
from engine.sampling import SamplingParams
from tests.test_gguf_families import CONFIG, per_expert, tiny_qwen3moe, write_qwen3moe_gguf
from tests.test_model_families import assert_scheduler_matches_transformers, family_args, save_random_model
from tests.test_model_moe import INIT, assert_greedy_tokens

pytestmark = pytest.mark.skipif(not Q4Experts.available(), reason="the fp32 4-bit CPU loops did not build here")

SHAPE = dict(CONFIG, moe_intermediate_size=64)  # K of every expert product a multiple of 64


def random_blocks(rows: int, cols: int, g: torch.Generator, q4_1: bool) -> Q4Blocks:
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = (torch.rand(rows, cols // 32, generator=g) * 0.05 + 0.01).half().float()
    offset = (torch.randn(rows, cols // 32, generator=g) * 0.1).half().float() if q4_1 else -8 * scale
    return Q4Blocks(q, scale, offset, 32)


def layer_with_blocks(experts: int, hidden: int, inter: int, q4_1: bool, start: int = 0, count: int | None = None):
    """A FusedMoE whose experts are random 4-bit blocks (dense weights = their exact values)."""
    count = experts if count is None else count
    moe = FusedMoE(hidden, experts, 2, inter, "silu", True, False, TPGroup.single(), torch.device("cpu"),
                   torch.float32, start, count)  # fmt: skip
    moe.gate.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(5))
    for e in range(start, start + count):
        g = torch.Generator().manual_seed(100 + e)  # an expert's blocks whatever the rank holds
        for proj in EXPERT_PROJS:
            target = moe.expert_weight(e, proj)
            blocks = random_blocks(*target.shape, g, q4_1)
            target.copy_(blocks.dequantize())
            moe.keep_blocks(e, proj, blocks, target)
    moe.finish_loading(quantized=True)
    return moe


@pytest.mark.parametrize("q4_1", [False, True])
def test_kernel_equals_the_fp32_experts_on_the_same_values(q4_1):
    moe = layer_with_blocks(8, 128, 64, q4_1)
    assert moe.q4 is not None and moe.q4.w13[0].shape[:2] == (8, 128 // 16)
    x = torch.randn(13, 128, generator=torch.Generator().manual_seed(1))
    weights, ids = moe.route(x)
    got = moe.q4.run(moe.kernel, x, ids, weights.float())
    dense = moe.kernel.moe_experts(x, moe.w13, moe.w2, ids, weights.float())
    grouped = moe.experts(x, weights, ids)
    scale = float(grouped.abs().max())
    assert float((got - grouped).abs().max()) <= 1e-5 * scale
    assert float((dense - grouped).abs().max()) <= 1e-5 * scale
    none = moe.q4.run(moe.kernel, x, ids + 8, weights.float())  # another rank's experts only
    assert not none.any()


def test_expert_sets_sum_to_the_whole_layer():
    whole = layer_with_blocks(8, 64, 64, q4_1=True)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    weights, ids = whole.route(x)
    want = whole.q4.run(whole.kernel, x, ids, weights.float())
    total = torch.zeros_like(x)
    for start in (0, 4):
        part = layer_with_blocks(8, 64, 64, q4_1=True, start=start, count=4)
        total += part.q4.run(part.kernel, x, ids - start, weights.float())
    torch.testing.assert_close(total, want, atol=1e-5 * float(want.abs().max()), rtol=0.0)


def test_a_missing_or_unpackable_block_leaves_the_layer_dense():
    moe = FusedMoE(64, 4, 2, 64, "silu", True, False, TPGroup.single(), torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(3)
    for e in range(4):
        for proj in EXPERT_PROJS:
            target = moe.expert_weight(e, proj)
            blocks = None if (e, proj) == (2, "up_proj") else random_blocks(*target.shape, g, False)
            moe.keep_blocks(e, proj, blocks, target)
    moe.finish_loading(quantized=True)
    assert moe.q4 is None
    narrow = FusedMoE(64, 2, 2, 32, "silu", True, False, TPGroup.single(), torch.device("cpu"), torch.float32)
    for e in range(2):  # down_proj's K (32) is not a multiple of 64: no kernel form
        for proj in EXPERT_PROJS:
            target = narrow.expert_weight(e, proj)
            narrow.keep_blocks(e, proj, random_blocks(*target.shape, g, False), target)
    narrow.finish_loading(quantized=True)
    assert narrow.q4 is None


class _Counting:
    def __init__(self, module, calls: dict[str, int]) -> None:
        self.module, self.calls = module, calls

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)

        return counted


def q4_gguf(tmp_path, qtype: GGMLQuantizationType, seed: int = 0):
    """A tiny Qwen3-MoE GGUF with `qtype` experts, and transformers' model of its values."""
    model = tiny_qwen3moe(seed, **SHAPE)
    path = tmp_path / f"moe-{qtype.name}.gguf"
    write_qwen3moe_gguf(path, model, qtype)
    src = resolve_model(str(path))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=src.hf_config,
                                               dtype=torch.float32).eval()  # fmt: skip
    return path, ref


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_q4_experts_from_a_gguf_serve_transformers_tokens(qtype, tmp_path):
    path, ref = q4_gguf(tmp_path, qtype)
    runner = ModelRunner(family_args(str(path)))
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.q4 is not None for m in moe)
    for m in moe:  # the dense experts hold the blocks' exact values
        for e in (0, 5):
            gate = m.expert_weight(e, "gate_proj")
            name = f"model.layers.{moe.index(m)}.mlp.experts.{e}.gate_proj.weight"
            assert torch.equal(gate, per_expert(ref)[name])
    calls: dict[str, int] = {}
    for m in moe:
        m.kernel = _Counting(m.kernel, calls)
        if qtype == GGMLQuantizationType.Q4_1:  # forwards of up to 2 tokens only: prefills run dense
            m.q4_max_pairs = 2 * m.top_k
    assert_scheduler_matches_transformers(runner, ref, f"qwen3moe-{qtype.name}")
    assert calls.get("moe_experts_q4", 0) >= 5 * len(moe)  # decode steps
    if qtype == GGMLQuantizationType.Q4_1:
        assert calls.get("moe_experts", 0) > 0  # prefill chunks: more pairs than the 4-bit bound


def test_a_weight_update_drops_the_q4_experts(tmp_path):
    path, _ = q4_gguf(tmp_path, GGMLQuantizationType.Q4_0)
    (tmp_path / "other").mkdir()
    _, other = q4_gguf(tmp_path / "other", GGMLQuantizationType.Q4_1, seed=1)
    runner = ModelRunner(family_args(str(path)))
    named = list(per_expert(other).items())
    assert runner.update_weights_from_tensor(named) == len(named)
    assert all(m.q4 is None for m in runner.model.modules() if isinstance(m, FusedMoE))
    assert_greedy_tokens(runner, other)


def test_int4wo_quantizes_a_checkpoints_experts_into_the_same_form(tmp_path):
    save_random_model(Qwen3MoeConfig(**SHAPE, norm_topk_prob=True), INIT, tmp_path)
    runner = ModelRunner(family_args(str(tmp_path), torchao_config="int4wo-32"))
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.q4 is not None for m in moe)
    prompts = [[(7 * j + 3 * i) % 160 for j in range(12 + 5 * i)] for i in range(3)]

    def greedy() -> list[list[int]]:
        sched = SyncScheduler(runner, runner.args)
        reqs = [sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=12)) for p in prompts]
        sched.run_until_idle()
        return [r.output_ids for r in reqs]

    four_bit = greedy()
    for m in moe:  # the same values, dense
        m.drop_quantized()
    assert greedy() == four_bit
    off = ModelRunner(family_args(str(tmp_path), torchao_config="int4wo-32", q4_max_tokens=0))
    assert all(m.q4 is None for m in off.model.modules() if isinstance(m, FusedMoE))
