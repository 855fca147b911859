"""Mixture-of-experts models (issue 31): Qwen3-MoE and Mixtral against transformers.

- fp32, through the real scheduler (test_model_families.py's run: short and long prompts chunked
  16 tokens at a time, a request joining mid-run, a radix-cache hit): greedy tokens identical to
  transformers' `generate`, prompt log-probs within 1e-4, with the C++ experts and the grouped
  torch path each. Qwen3-MoE with and without
  `norm_topk_prob`, with dense layers (`mlp_only_layers`, `decoder_sparse_step`), tied and untied;
  Mixtral (its `block_sparse_moe.experts.<e>.w1/w2/w3` names) top-2 of 8 with a sliding window of
  12, and top-3 of 4, tied.
- TP=2: every rank holds its slice of every expert; the tokens stay transformers'.
- bf16: greedy tokens are transformers' top choices (teacher-forced, within bf16's resolution).
- The grouped experts (tokens sorted by expert, one GEMM pair per expert) and the C++ experts equal
  a per-token loop (fp32), and the C++ experts are as close to an fp32 reference as the grouped path
  (bf16 and fp32).
- bf16: the C++ router's loop (a few rows) is within one bf16 rounding of the fp64 product and
  batch-independent; more rows take the prepacked oneDNN product, exactly.
- A checkpoint missing an expert is a ModelLoadError naming it; LoRA on a MoE model is refused at
  start-up; `update_weights_from_tensor` takes expert tensors (per-expert checkpoint names).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

from bench.gpu_parity import teacher_forced
from engine import SyncScheduler
from engine.distributed.parallel_state import TPGroup
from engine.distributed.sharding import TPShard
from engine.errors import InvalidServerArgsError, ModelLoadError
from engine.kernels import cpu_extension
from engine.layers.moe import FusedMoE
from engine.model_config import QK_NORM_HEAD, ModelConfig
from engine.model_executor.model_runner import ModelRunner
from engine.models.llama import EXPERT_PROJS
from engine.sampling import SamplingParams
from tests.test_model_families import (
    BF16_SHAPE,
    COMMON,
    NEW_TOKENS,
    assert_scheduler_matches_transformers,
    assert_tp2_matches_transformers,
    family_args,
    hf_greedy,
    save_random_model,
)

INIT = (0.3, 0.5, 1.5, 0.3)  # (matrices' std, 1-D params' uniform range, embedding std)
BF16_INIT = (0.08, 0.1, 0.4, 2.0)  # spread logits: tiny bf16 models are near-tie-prone
QWEN = dict(COMMON, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
MIXTRAL = dict(COMMON, intermediate_size=32)

FAMILIES = {
    "qwen3moe-norm": lambda: Qwen3MoeConfig(**QWEN, norm_topk_prob=True),
    # layer 1 dense (`mlp_only_layers`), layers 0 and 2 sparse; raw top-k weights; tied head
    "qwen3moe-dense-layer-tied": lambda: Qwen3MoeConfig(
        **(QWEN | dict(num_hidden_layers=3)), norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=True
    ),
    # `decoder_sparse_step` 2: layers 1 and 3 sparse, 0 and 2 dense
    "qwen3moe-step2-top3": lambda: Qwen3MoeConfig(
        **(QWEN | dict(num_hidden_layers=4, num_experts_per_tok=3)), norm_topk_prob=True, decoder_sparse_step=2
    ),
    # Mistral's sliding window on every layer (the prompts and generations run past it)
    "mixtral-window12": lambda: MixtralConfig(**MIXTRAL, num_local_experts=8, num_experts_per_tok=2, sliding_window=12),
    "mixtral-top3-tied": lambda: MixtralConfig(
        **MIXTRAL, num_local_experts=4, num_experts_per_tok=3, tie_word_embeddings=True
    ),
}
ARCH = {"qwen3moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, str(folder), save_random_model(FAMILIES[request.param](), INIT, folder)


@pytest.mark.parametrize("experts", ["cpu-kernel", "grouped"])
def test_greedy_tokens_and_logprobs_equal_transformers(family, experts):
    """Both CPU forms of the experts: the one-call C++ kernel (every forward here is small enough
    for it) and the grouped torch path (the kernel taken away)."""
    name, folder, hf = family
    # the Python layers' two forms (the fused loop calls the kernel itself: tests/test_moe_quant.py)
    runner = ModelRunner(family_args(folder, disable_fused_decode=True))
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    calls = {"kernel": 0}
    kernel = moe[0].kernel
    for m in moe:
        m.kernel = _Counting(kernel, calls) if experts == "cpu-kernel" and kernel is not None else None
    assert_scheduler_matches_transformers(runner, hf, name)
    if experts == "cpu-kernel" and cpu_extension.load() is not None:  # the kernels built: fp32 takes them
        assert calls["kernel"] >= NEW_TOKENS * len(moe)


def test_config_switches():
    dense = ModelConfig.from_hf(FAMILIES["qwen3moe-dense-layer-tied"](), ARCH["qwen3moe"])
    assert dense.moe_layers == (0, 2) and not dense.norm_topk_prob and dense.qk_norm == QK_NORM_HEAD
    assert (dense.num_experts, dense.num_experts_per_tok, dense.moe_intermediate_size) == (8, 2, 32)
    step = ModelConfig.from_hf(FAMILIES["qwen3moe-step2-top3"](), ARCH["qwen3moe"])
    assert step.moe_layers == (1, 3) and step.norm_topk_prob and not step.moe_fp32_weights
    mixtral = ModelConfig.from_hf(FAMILIES["mixtral-top3-tied"](), ARCH["mixtral"])
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob and mixtral.moe_fp32_weights
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.qk_norm) == (4, 32, "")


@pytest.mark.parametrize(("renormalize", "fp32_weights"), [(True, False), (False, False), (True, True)])
def test_grouped_experts_equal_a_per_token_loop(renormalize, fp32_weights):
    torch.manual_seed(3)
    hidden, experts, top_k, inter = 24, 8, 3, 16
    moe = FusedMoE(
        hidden, experts, top_k, inter, "silu", renormalize, fp32_weights, TPGroup.single(), torch.device("cpu"),
        torch.float32,
    )  # fmt: skip
    for p in moe.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(37, hidden)
    out = moe(x)  # fp32 on a CPU: the C++ kernel, when it built (111 pairs, 8 experts)
    grouped = moe.experts(x, *moe.route(x))
    for t in range(x.shape[0]):  # the reference: each token through its top-k experts, one at a time
        probs = torch.softmax(x[t] @ moe.gate.T, -1)
        w, ids = torch.topk(probs, top_k)
        w = w / w.sum() if renormalize else w
        want = torch.zeros(hidden)
        for weight, e in zip(w, ids.tolist()):
            gate, up = (moe.w13[e] @ x[t]).chunk(2)
            want += weight * (moe.w2[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grouped[t], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp32_weights", [False, True])
@pytest.mark.parametrize("hidden, inter, tokens", [(67, 32, 11), (200, 48, 40)])
def test_cpu_kernel_matches_the_grouped_path(hidden, inter, tokens, fp32_weights, dtype):
    """bf16 and fp32 on a CPU: the one-call C++ experts (cpu_moe.cpp) are as close to an fp32
    reference as the grouped torch path; an expert set's ids (expert parallelism) skip the others'
    pairs. 67 and 200 columns: the dot products' unrolled parts, whole vectors and masked tails
    run; 48 and 200 outputs end in a part tile; 40 tokens give experts blocks of 1 to 8 rows."""
    moe = FusedMoE(hidden, 8, 3, inter, "silu", True, fp32_weights, TPGroup.single(), torch.device("cpu"), dtype)
    if moe.kernel is None:
        pytest.skip("the CPU kernels did not build here")
    torch.manual_seed(4)
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(tokens, hidden).to(dtype)
    weights, ids = moe.route(x)
    got = moe.kernel.moe_experts(x, moe.w13, moe.w2, ids, weights.float()).float()
    grouped = moe.experts(x, weights, ids).float()
    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for w, e in zip(weights[t].float(), ids[t].tolist()):
            gate, up = (moe.w13[e].float() @ x[t].float()).chunk(2)
            ref[t] += w * (moe.w2[e].float() @ (torch.nn.functional.silu(gate) * up))
    scale, slack = float(ref.abs().max()), 0.02 if dtype == torch.bfloat16 else 1e-6
    assert float((got - ref).abs().max()) <= max(2 * float((grouped - ref).abs().max()), slack * scale)
    low = moe.kernel.moe_experts(x, moe.w13[:4], moe.w2[:4], ids, weights.float()).float()  # experts 0-3
    high = moe.kernel.moe_experts(x, moe.w13[4:], moe.w2[4:], ids - 4, weights.float()).float()  # 4-7
    torch.testing.assert_close(low + high, got, atol=1.5 * slack * scale, rtol=0.0)
    none = moe.kernel.moe_experts(x, moe.w13[:4], moe.w2[:4], ids + 8, weights.float())
    assert not none.any()


@pytest.mark.parametrize("hidden", [1024, 256, 200])
def test_the_cpu_router_takes_a_few_bf16_rows_and_the_packed_form_above(hidden):
    """bf16 with oneDNN's prepacked router: FusedMoE.route's logits come from the C++ router
    (cpu_moe_router.cpp), the fused decode loop's too. Up to 4 rows (a hidden size in 64s) its own
    loop: within one bf16 rounding of the fp64 product, each row the same alone as in a batch;
    5 rows, or 200 columns, the prepacked oneDNN product, exactly; fp32, F.linear."""
    moe = FusedMoE(hidden, 128, 8, 64, "silu", True, False, TPGroup.single(), torch.device("cpu"), torch.bfloat16)
    module = cpu_extension.load()
    assert module is not None, "the CPU kernels did not build (see the log)"
    torch.manual_seed(7)
    moe.gate.data.normal_(0, 0.05)
    f32, gate32 = torch.randn(3, hidden), moe.gate.float()
    assert torch.equal(module.moe_router_logits(f32, gate32, None), torch.nn.functional.linear(f32, gate32))
    moe.pack_router()
    if moe.router_packed is None:
        pytest.skip("no oneDNN bf16 on this CPU (AVX2 only): the router stays F.linear")
    x = torch.randn(5, hidden).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(x, moe.router_packed, None, "none", [None], "")
    for rows in (1, 2, 4, 5):
        got = module.moe_router_logits(x[:rows], moe.gate, moe.router_packed)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 128)
        if rows == 5 or hidden % 64:
            assert torch.equal(got, onednn[:rows])
            continue
        ref = x[:rows].double() @ moe.gate.double().t()
        # fp32 sums rounded to bf16 once: half a bf16 step of the result, plus the sums' own error
        assert torch.all((got.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-6)
        assert torch.equal(got[:1], module.moe_router_logits(x[:1], moe.gate, moe.router_packed))
    weights, ids = moe.route(x[:3])
    probs = torch.softmax(module.moe_router_logits(x[:3], moe.gate, moe.router_packed), -1, dtype=torch.float32)
    top, want = torch.topk(probs, 8, -1)
    assert torch.equal(ids, want) and torch.equal(weights, (top / top.sum(-1, keepdim=True)).bfloat16())


def _copy_without(folder: str, dest, drop: str) -> None:
    shutil.copytree(folder, dest, dirs_exist_ok=True)
    tensors = load_file(f"{folder}/model.safetensors")
    del tensors[drop]
    save_file(tensors, f"{dest}/model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("name", "drop"),
    [
        ("qwen3moe-norm", "model.layers.1.mlp.experts.3.up_proj.weight"),
        ("mixtral-window12", "model.layers.0.block_sparse_moe.experts.5.w2.weight"),
    ],
)
def test_missing_expert_is_a_model_load_error(name, drop, tmp_path_factory):
    folder = tmp_path_factory.mktemp(name)
    save_random_model(FAMILIES[name](), INIT, folder)
    broken = tmp_path_factory.mktemp(name + "-broken")
    _copy_without(str(folder), broken, drop)
    layer, expert, proj = (1, 3, "up_proj") if name.startswith("qwen") else (0, 5, "down_proj")
    with pytest.raises(ModelLoadError, match=rf"layers\.{layer}\.mlp\.experts\.{proj}\[{expert}\]"):
        ModelRunner(family_args(str(broken)))


def test_lora_on_a_moe_model_is_refused_at_start_up(tmp_path):
    save_random_model(FAMILIES["mixtral-window12"](), INIT, tmp_path)
    with pytest.raises(InvalidServerArgsError, match="mixture-of-experts"):
        ModelRunner(family_args(str(tmp_path), enable_lora=True))


def test_deterministic_inference_on_a_moe_model_is_refused_at_start_up(tmp_path):
    save_random_model(FAMILIES["qwen3moe-norm"](), INIT, tmp_path)
    with pytest.raises(InvalidServerArgsError, match="enable_deterministic_inference"):
        ModelRunner(family_args(str(tmp_path), enable_deterministic_inference=True))


def test_update_weights_from_tensor_takes_expert_tensors(tmp_path):
    """A second checkpoint's tensors (per-expert names) sent to a running model: its tokens become
    the second model's; an expert tensor of the wrong shape is refused before anything changes."""
    cfg = FAMILIES["qwen3moe-dense-layer-tied"]
    save_random_model(cfg(), INIT, tmp_path / "a")
    other = save_random_model(cfg(), (0.35, 0.4, 1.2, 0.35), tmp_path / "b")
    runner = ModelRunner(family_args(str(tmp_path / "a")))
    named = list(load_file(str(tmp_path / "b" / "model.safetensors")).items())
    assert any(".mlp.experts.7.down_proj." in n for n, _ in named)
    with pytest.raises(ModelLoadError, match=r"shape \(3, 3\)"):
        runner.update_weights_from_tensor([("model.layers.2.mlp.experts.7.down_proj.weight", torch.zeros(3, 3))])
    assert runner.update_weights_from_tensor(named) == len(named)
    assert_greedy_tokens(runner, other)


def assert_greedy_tokens(runner: ModelRunner, hf) -> None:
    """One 20-token prompt, 10 greedy tokens: transformers' `generate`'s on `hf`."""
    sched = SyncScheduler(runner, runner.args)
    prompt = [(5 * j + 1) % 160 for j in range(20)]
    req = sched.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=10))
    sched.run_until_idle()
    assert req.output_ids == hf_greedy(hf, prompt)


def test_tp2_qwen3moe_greedy_tokens_equal_transformers(tmp_path):
    hf = save_random_model(FAMILIES["qwen3moe-dense-layer-tied"](), INIT, tmp_path)
    assert_tp2_matches_transformers(str(tmp_path), hf)


def test_ep2_mixtral_greedy_tokens_equal_transformers(tmp_path):
    """--ep-size 2 over two ranks: each holds two of the four experts whole (and reads no tensor of
    the other two); the all-reduce sums the two sets' outputs."""
    hf = save_random_model(FAMILIES["mixtral-top3-tied"](), INIT, tmp_path)
    runner = assert_tp2_matches_transformers(str(tmp_path), hf, ep_size=2)
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all((m.expert_start, m.num_local_experts, m.w13.shape[0]) == (0, 2, 2) for m in moe)
    assert all(m.intermediate_size == 32 for m in moe)  # whole experts: a set of one rank


def test_expert_sets_split_the_experts_and_sum_to_the_whole_layer():
    """SGLang's layout: tp 4, ep 2 is two sets of two ranks; set k holds experts [4k, 4k+4), each
    sliced over the set's two ranks. The partial outputs of all four ranks sum to the layer's."""
    cfg = ModelConfig.from_hf(FAMILIES["qwen3moe-norm"](), ARCH["qwen3moe"])
    shards = [TPShard.of(cfg, rank, 4, ep_size=2) for rank in range(4)]
    assert [(s.expert_start, s.num_local_experts, s.moe_tp_rank) for s in shards] == [
        (0, 4, 0), (0, 4, 1), (4, 4, 0), (4, 4, 1),
    ]  # fmt: skip
    gate5, down1 = "model.layers.0.mlp.experts.5.gate_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"
    assert [s.weight_slice(gate5) for s in shards] == [(0, 0, 0), (0, 0, 0), (0, 0, 16), (0, 16, 32)]
    assert [s.weight_slice(down1) for s in shards] == [(1, 0, 16), (1, 16, 32), (1, 0, 0), (1, 0, 0)]
    torch.manual_seed(4)
    hidden, experts, top_k, inter = 24, 8, 2, 16
    cpu, single = torch.device("cpu"), TPGroup.single()
    whole = FusedMoE(hidden, experts, top_k, inter, "silu", True, False, single, cpu, torch.float32)
    for p in whole.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(29, hidden)
    total = torch.zeros_like(x)
    for start in (0, 4):
        part = FusedMoE(hidden, experts, top_k, inter, "silu", True, False, single, cpu, torch.float32, start, 4)
        part.gate.data.copy_(whole.gate)
        for e in range(start, start + 4):
            for proj in EXPERT_PROJS:
                part.expert_weight(e, proj).copy_(whole.expert_weight(e, proj))
        total += part(x)
    torch.testing.assert_close(total, whole(x), atol=1e-5, rtol=1e-5)


def test_ep_size_is_checked():
    dense = ModelConfig.from_hf(FAMILIES["qwen3moe-norm"](), ARCH["qwen3moe"])
    with pytest.raises(InvalidServerArgsError, match="does not divide the model's 8 experts"):
        TPShard.of(dense, 0, 3, ep_size=3)
    with pytest.raises(InvalidServerArgsError, match="a divisor of tp_size"):
        family_args("/nonexistent", tp_size=2, ep_size=4).verify()
    llama = ModelConfig.from_hf(LlamaConfig(**COMMON), "LlamaForCausalLM")
    with pytest.raises(InvalidServerArgsError, match="needs a mixture-of-experts model"):
        TPShard.of(llama, 0, 2, ep_size=2)


BF16_FAMILIES = {
    "qwen3moe": lambda: Qwen3MoeConfig(
        **BF16_SHAPE, head_dim=64, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    ),
    "mixtral": lambda: MixtralConfig(**BF16_SHAPE, num_local_experts=8, num_experts_per_tok=2),
}


@pytest.mark.parametrize("name", list(BF16_FAMILIES))
def test_bf16_greedy_tokens_are_transformers_top_choices(name, tmp_path):
    """bf16, the engine's default dtype on a CPU: the experts' stacked weights and the router in
    bf16, a batch of prompts decoded together (expert groups of several tokens); every greedy
    token is transformers' top choice on our own sequence, or within bf16's resolution of it."""
    hf = save_random_model(BF16_FAMILIES[name](), BF16_INIT, tmp_path)  # fp32 reference, same weights
    # the Python layers, whose kernel calls are counted (the fused loop runs the same bits: test_moe_quant.py)
    args = family_args(str(tmp_path), dtype="bfloat16", chunked_prefill_size=None, disable_fused_decode=True)
    runner = ModelRunner(args)
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moe) == BF16_SHAPE["num_hidden_layers"] and all(m.w13.dtype == torch.bfloat16 for m in moe)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, BF16_SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (4, 37, 12, 60, 20, 90)]
    calls = {"kernel": 0}
    kernel = moe[0].kernel
    if kernel is not None:  # decode steps (small expert groups) take the C++ experts, prefills oneDNN's GEMMs
        for m in moe:
            m.kernel = _Counting(kernel, calls)
    sched = SyncScheduler(runner)
    reqs = [sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=24)) for p in prompts]
    sched.run_until_idle()
    bar = teacher_forced(hf, prompts, [r.output_ids for r in reqs])
    assert bar["ok"], f"{name}: {bar}"
    assert kernel is None or calls["kernel"] >= 23 * len(moe)


class _Counting:
    def __init__(self, module, calls: dict[str, int]) -> None:
        self.module, self.calls = module, calls

    def moe_experts(self, *args):
        self.calls["kernel"] += 1
        return self.module.moe_experts(*args)
