"""llama.cpp's K-quants (Q4_K, Q6_K: what a Q4_K_M file holds) read by our fp32 kernels in their own
factors (engine/models/gguf_blocks.py, engine/layers/kquant.py), for fp32 models and, on bf16
activations widened to fp32, for bf16 ones.

- the block forms hold exactly the values gguf's dequantization gives;
- the kernels' vector loops equal their plain loops to the bit and the float64 product to fp32
  rounding, at row counts around the loops' groups and a row count that leaves a partial tile;
- a tiny Llama and Qwen2 written as Q4_K_M-like files (Q4_K layers, Q6_K head and some v/down
  projections) run those forms in the model and in the fused decode loop (a q|k|v of Q4_K q|k
  and a Q6_K v side by side), with fp32 greedy tokens and prompt log-probs equal to transformers' on
  the file's values.

The files' blocks are random bytes with bounded fp16 factors (gguf-py cannot quantize to K-quants;
any bytes are valid blocks, and the reference reads the same bytes).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from engine import SyncScheduler
from engine.kernels import cpu_extension, cpu_quant
from engine.layers.fused_decode import FusedDecodeLayers
from engine.layers.int4 import TiledQ4Weight
from engine.layers.linear import BatchInvariantLinear, QuantLinear, QuantParts
from engine.layers.q8 import Q8Weight
from engine.model_executor.model_runner import ModelRunner
from engine.models.gguf_blocks import q4k_blocks, q5_0_blocks, q5k_blocks, q6k_blocks
from engine.models.loader import resolve_model
from engine.sampling import SamplingParams
from tests.fused_checks import check_every_fused_forward
from tests.test_loader import gguf_name
from tests.test_model_families import (
    NO_SPECIAL,
    VOCAB,
    assert_bf16_bar,
    assert_scheduler_matches_transformers,
    family_args,
)

Q4_K, Q5_K, Q6_K, Q5_0 = (GGMLQuantizationType[t] for t in ("Q4_K", "Q5_K", "Q6_K", "Q5_0"))
VECTOR = pytest.mark.skipif(not cpu_quant.vectorized(torch.float32), reason="no fp32 block loops on this CPU")


def _halves(rng: np.random.Generator, lo: float, hi: float, shape: tuple[int, int]) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def kquant_bytes(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of an [n, k] matrix, bytes [n, k / 256 * type size]: random codes and small
    factors, fp16 super-factors in a range that keeps the weights ~0.1 (Q4_K: dmin near 7.5 d, so
    the weights centre near zero)."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    if qtype in (Q4_K, Q5_K):  # Q5_K's codes are twice Q4_K's: half the factors
        scale = 1.0 if qtype == Q4_K else 0.5
        b[..., 0:2] = _halves(rng, 1e-4 * scale, 4e-4 * scale, (n, k // block))
        b[..., 2:4] = _halves(rng, 1e-3 * scale, 2e-3 * scale, (n, k // block))
    elif qtype == Q6_K:
        b[..., 208:210] = _halves(rng, 5e-5, 1.5e-4, (n, k // block))
    else:  # Q5_0, one fp16 d per 32
        b[..., 0:2] = _halves(rng, 2e-3, 6e-3, (n, k // block))
    return b.reshape(n, -1)


READERS = {Q4_K: q4k_blocks, Q5_K: q5k_blocks, Q6_K: q6k_blocks, Q5_0: q5_0_blocks}


@pytest.mark.parametrize("qtype", list(READERS))
def test_blocks_hold_ggufs_values(qtype):
    n, k = 24, 512
    raw = kquant_bytes(qtype, n, k, np.random.default_rng(0))
    blocks = READERS[qtype](raw, (n, k))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k))
    assert torch.equal(blocks.dequantize(), expected)
    f = blocks.k
    if qtype == Q5_0:  # Q8_0's form: codes q - 16, one scale per 32
        assert f is None and blocks.group_size == 32 and int(blocks.q.min()) >= -16 and int(blocks.q.max()) <= 15
    elif qtype in (Q4_K, Q5_K):  # the factors multiply out to the exact scales and offsets
        assert f is not None and f.d.shape == (n, k // 256)
        per = torch.arange(k // 32) // 8
        assert torch.equal(f.d[:, per] * f.sc.float(), blocks.scale)
        assert torch.equal(-(f.dmin[:, per] * f.m.float()), blocks.offset)
        assert int(f.sc.max()) <= 63 and int(f.m.max()) <= 63
        assert int(blocks.q.max()) <= (15 if qtype == Q4_K else 31)
    else:
        assert f is not None and f.d.shape == (n, k // 256)
        assert torch.equal(f.d[:, torch.arange(k // 16) // 16] * f.sc.float(), blocks.scale)
        assert int(blocks.q.min()) >= -32 and int(blocks.q.max()) <= 31
    # row permutations and fusions carry the factors along
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    moved = blocks.map_rows(lambda t: t[perm])
    assert torch.equal(moved.dequantize(), expected[perm])
    fused = type(blocks).cat([blocks, moved])
    assert (fused.k is None) == (f is None) and torch.equal(fused.dequantize(), torch.cat([expected, expected[perm]]))


@VECTOR
@pytest.mark.parametrize("qtype", list(READERS))
def test_kernels_compute_the_files_values(qtype):
    """Vector loops equal the plain loops to the bit; both equal the float64 product of the
    dequantized weight to fp32 rounding; the K forms read fewer bytes than a Q8_0 / fp16-scale one."""
    n, k = 40, 768  # 40 rows: two tiles and a partial one
    raw = kquant_bytes(qtype, n, k, np.random.default_rng(1))
    blocks = READERS[qtype](raw, (n, k))
    form = blocks.pack(torch.float32)
    w = blocks.dequantize().double()
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=g)
        y = form.matmul(x)
        if qtype == Q4_K:
            assert isinstance(form, TiledQ4Weight) and form.tiles.k_form
            plain = cpu_quant.q4_gemv(x, form.tiles, vector=False)
        else:
            assert isinstance(form, Q8Weight) and (form.supers is None) == (qtype == Q5_0)
            plain = cpu_quant.q8_gemv(x, form.codes, form.scales, form.supers, vector=False)
        assert torch.equal(y, plain), rows
        exact = x.double() @ w.T
        assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-5, rows
    held = -(-n // cpu_quant.TILE) * cpu_quant.TILE if qtype == Q4_K else n  # 4-bit tiles pad to 16 rows
    bits = 8 * form.nbytes / (held * k)
    assert bits < {Q4_K: 4.7, Q5_K: 8.8, Q6_K: 8.7, Q5_0: 8.6}[qtype], bits  # files: 4.5, 5.5, 6.6, 5.5


@VECTOR
def test_kernels_refuse_what_they_cannot_take():
    raw = kquant_bytes(Q6_K, 16, 256, np.random.default_rng(2))
    form = q6k_blocks(raw, (16, 256)).pack(torch.float32)
    with pytest.raises(RuntimeError, match="K must be a multiple of 256"):
        cpu_quant.q8_gemv(
            torch.randn(1, 64), form.codes[:, :64].contiguous(), form.scales[:, :4].contiguous(), form.supers
        )
    with pytest.raises(RuntimeError, match="fp32 d"):
        cpu_quant.q8_gemv(torch.randn(1, 256), form.codes, form.scales, form.supers.half())
    raw5 = kquant_bytes(Q5_K, 16, 256, np.random.default_rng(3))
    form5 = q5k_blocks(raw5, (16, 256)).pack(torch.float32)
    with pytest.raises(RuntimeError, match="fp32 d and dmin"):
        cpu_quant.q8_gemv(torch.randn(1, 256), form5.codes, form5.scales, form5.supers.half())
    # K forms run fp32 loops: other activation dtypes have no form
    assert q6k_blocks(raw, (16, 256)).pack(torch.float16) is None


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
def test_bf16_models_run_the_k_forms(qtype):
    """A bf16 model keeps the K forms (before, Q4_K took torch's int4pack with its scales rounded
    to bf16, and Q5_K and Q6_K stayed dense), the same bytes as an fp32 model's or, Q5_K and Q6_K in
    lane order, the file's 5 and 6 bits a weight. Q4_K runs the
    bf16 4-bit loops with the factors multiplied where they are read; Q5_K and Q6_K, on CPUs with
    AVX512-BF16, the bf16 dot-product loops over their codes in lane order: the plain loop and the
    vector one each equal the float64 product to the output's bf16 rounding, and each other to a
    bf16 step. Without AVX512-BF16, Q5_K and Q6_K run the fp32 loops on x widened: the fp32 result
    rounded once."""
    if qtype == Q4_K and not cpu_quant.vectorized(torch.bfloat16):
        pytest.skip("no AVX512-BF16 build: a bf16 model runs Q4_K through torch's int4pack")
    if qtype != Q4_K and not cpu_quant.vectorized(torch.float32):
        pytest.skip("no fp32 block loops on this CPU")
    n, k = 40, 512
    blocks = READERS[qtype](kquant_bytes(qtype, n, k, np.random.default_rng(4)), (n, k))
    form, form32 = blocks.pack(torch.bfloat16), blocks.pack(torch.float32)
    lanes = qtype != Q4_K and cpu_quant.vectorized(torch.bfloat16)
    assert type(form) is type(form32) and form.in_features == k
    if lanes:  # the file's bits: 6 or 5 a weight, where the fp32 loops hold 8
        assert form.nbytes == form32.nbytes - n * k * (2 if qtype == Q6_K else 3) // 8
    else:
        assert form.nbytes == form32.nbytes
    if qtype != Q4_K:
        assert form.codes.dtype == (torch.uint8 if lanes else torch.int8)
    w = blocks.dequantize().double()
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3, 9):
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = form.matmul(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        if qtype != Q4_K and not lanes:
            assert torch.equal(y, form32.matmul(x.float()).bfloat16()), rows
            continue
        if qtype == Q4_K:
            assert form.tiles.k_form
            plain = cpu_quant.q4_gemv(x, form.tiles, vector=False)
        else:
            plain = cpu_quant.q8_gemv(x, form.codes, form.scales, form.supers, vector=False)
        exact = x.double() @ w.T
        for out in (y, plain):
            assert float((out.double() - exact).abs().max() / exact.abs().max()) < 5e-3, rows
        assert torch.allclose(y.float(), plain.float(), rtol=1 / 128, atol=1e-3 * plain.float().abs().max().item())


@pytest.mark.skipif(cpu_extension.load() is None, reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("qtype", [Q5_K, Q6_K])
def test_lane_order_is_the_files_values(qtype):
    """The lane-order form (the bf16 loops', csrc/cpu_quant_lanes.cpp) holds the file's values at
    its bits a weight: its
    plain loop, which runs on any CPU, equals the float64 product of the dequantized weight to the
    output's bf16 rounding at every row count; the vector loop, where built, gives each row the
    same bits in any batch (deterministic inference relies on it); codes out of the kind's range
    are refused."""
    n, k = 24, 768
    blocks = READERS[qtype](kquant_bytes(qtype, n, k, np.random.default_rng(5)), (n, k))
    kind = cpu_quant.Q6_K if qtype == Q6_K else cpu_quant.Q5_K
    codes = cpu_quant.q8_lanes_pack(blocks.q, kind)
    assert codes.dtype == torch.uint8 and codes.shape == (n, k // 256 * (192 if qtype == Q6_K else 160))  # 6, 5 bits
    f = blocks.k
    if qtype == Q6_K:
        scales, supers = f.sc.to(torch.int8).contiguous(), f.d.float().contiguous()
    else:
        scales = torch.stack([f.sc, f.m], dim=1).to(torch.uint8).contiguous()
        supers = torch.stack([f.d, f.dmin], dim=1).float().contiguous()
    w = blocks.dequantize().double()
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    exact = x.double() @ w.T
    for rows in (1, 2, 5, 8, 11):
        plain = cpu_quant.q8_gemv(x[:rows], codes, scales, supers, vector=False)
        assert float((plain.double() - exact[:rows]).abs().max() / exact[:rows].abs().max()) < 5e-3, rows
    if cpu_quant.vectorized(torch.bfloat16):
        batch = cpu_quant.q8_gemv(x, codes, scales, supers)
        alone = torch.cat([cpu_quant.q8_gemv(x[i : i + 1], codes, scales, supers) for i in range(len(x))])
        assert torch.equal(batch, alone)
        assert float((batch.double() - exact).abs().max() / exact.abs().max()) < 5e-3
    with pytest.raises(RuntimeError, match="out of the kind's range"):
        cpu_quant.q8_lanes_pack(torch.full((2, 256), 40, dtype=torch.int8), kind)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        cpu_quant.q8_lanes_pack(blocks.q[:, :128].contiguous(), kind)


# --- a Q4_K_M-like tiny Llama ------------------------------------------------------------------

SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    **NO_SPECIAL,
)
PROJECTIONS = tuple(f"self_attn.{p}_proj" for p in "qkvo") + tuple(f"mlp.{p}_proj" for p in ("gate", "up", "down"))


def layer_type(layer: int, proj: str, base: GGMLQuantizationType) -> GGMLQuantizationType:
    """llama.cpp's Q4_K_M (base Q4_K) and Q5_K_M (base Q5_K): Q6_K for v and down in some layers
    (here layer 0)."""
    return Q6_K if layer == 0 and proj in ("self_attn.v_proj", "mlp.down_proj") else base


def write_kquant_gguf(
    path, arch: str, cfg: LlamaConfig | Qwen2Config, base: GGMLQuantizationType = Q4_K, seed: int = 0
) -> None:
    """A Llama or Qwen2 GGUF as llama.cpp lays it out (Qwen2 with its q/k/v biases), its matrices
    random K-quant blocks (Llama's q/k rows stand as permuted by llama.cpp: both readers undo it)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
    w.add_tensor("token_embd.weight", rng.normal(0, 1.0, (cfg.vocab_size, cfg.hidden_size)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(cfg.hidden_size, np.float32))
    w.add_tensor("output.weight", kquant_bytes(Q6_K, cfg.vocab_size, cfg.hidden_size, rng), raw_dtype=Q6_K)
    for i in range(cfg.num_hidden_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.uniform(0.5, 1.5, cfg.hidden_size).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", rng.uniform(0.5, 1.5, cfg.hidden_size).astype(np.float32))
        for proj in PROJECTIONS:
            module = f"model.layers.{i}.{proj}"
            n, k = sd[f"{module}.weight"].shape
            qtype = layer_type(i, proj, base)
            w.add_tensor(gguf_name(f"{module}.weight"), kquant_bytes(qtype, n, k, rng), raw_dtype=qtype)
            if f"{module}.bias" in sd:
                w.add_tensor(gguf_name(f"{module}.bias"), rng.normal(0, 0.5, n).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    ("arch", "base", "deterministic"),
    [("llama", Q4_K, False), ("qwen2", Q4_K, False), ("llama", Q4_K, True), ("qwen2", Q5_K, False)],
)
def test_a_k_m_model_runs_its_blocks_as_transformers_reads_them(arch, base, deterministic, tmp_path):
    """Q4_K_M's layout (Q5_K_M's with Q5_K for Q4_K): layer 0's q|k|v runs as the base's q|k beside
    a Q6_K v (`QuantParts`, Qwen2's biases added after them), its down as Q6_K; layer 1 all base;
    the head Q6_K. Deterministic inference runs the same blocks at every decode row count
    (`BatchInvariantLinear.blocks`)."""
    name = f"{arch}-{base.name.lower()}_m"
    path = tmp_path / f"tiny-{name}.gguf"
    config = LlamaConfig(**SHAPE) if arch == "llama" else Qwen2Config(**SHAPE)
    write_kquant_gguf(path, arch, config, base)
    src = resolve_model(str(path))
    assert src.architecture == type(config).__name__.replace("Config", "ForCausalLM")
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, config=src.hf_config, dtype=torch.float32
    )
    # every row count up to 16 on the blocks (a measured crossover may keep this tiny model dense)
    args = family_args(str(path), q4_max_tokens=16, enable_deterministic_inference=deterministic)
    runner = ModelRunner(args)
    model = runner.model

    def is_base(form) -> bool:
        if base == Q4_K:
            return isinstance(form, TiledQ4Weight) and form.tiles.k_form
        return isinstance(form, Q8Weight) and form.scales.dtype == torch.uint8  # Q5_K's sc and m

    if deterministic and cpu_quant.vectorized(torch.float32):
        qkv0 = model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv0, BatchInvariantLinear) and isinstance(qkv0.blocks, QuantParts)
        assert isinstance(model.fused_decode, FusedDecodeLayers)
    elif cpu_quant.vectorized(torch.float32):
        layers = model.layers
        qkv0 = layers[0].self_attn.qkv_proj
        assert isinstance(qkv0, QuantLinear) and isinstance(qkv0.packed, QuantParts)
        q_k, v = qkv0.packed.forms
        assert is_base(q_k) and q_k.out_features == 256 + 128
        assert isinstance(v, Q8Weight) and v.scales.dtype == torch.int8 and v.out_features == 128  # Q6_K
        for m in (layers[1].self_attn.qkv_proj, layers[0].mlp.gate_up_proj, layers[1].mlp.down_proj):
            assert isinstance(m, QuantLinear) and is_base(m.packed)
        down = layers[0].mlp.down_proj
        assert isinstance(down, QuantLinear) and isinstance(down.packed, Q8Weight) and down.packed.supers is not None
        head = model.lm_head
        assert isinstance(head, QuantLinear) and head.packed.supers is not None
        assert isinstance(model.fused_decode, FusedDecodeLayers)  # the loop takes every one of these forms
    assert_scheduler_matches_transformers(runner, ref, name)


@VECTOR
@pytest.mark.parametrize(("arch", "base"), [("llama", Q4_K), ("qwen2", Q5_K)])
def test_a_bf16_k_m_model_runs_its_blocks(arch, base, tmp_path):
    """The same files in bf16 (dtype auto on CPUs with AVX512-BF16): every K-quant matrix keeps its
    blocks, in the model and in the fused loop, and greedy tokens are transformers' top choices on
    the file's values (the bf16 bar)."""
    if base == Q4_K and not cpu_quant.vectorized(torch.bfloat16):
        pytest.skip("no AVX512-BF16 build: a bf16 model runs Q4_K through torch's int4pack")
    name = f"{arch}-{base.name.lower()}_m"
    path = tmp_path / f"tiny-{name}.gguf"
    config = LlamaConfig(**SHAPE) if arch == "llama" else Qwen2Config(**SHAPE)
    # seed 0 as the fp32 test: tiny random models are near-tie-prone in bf16, so some seeds miss
    # the bar with the dense bf16 weights too (seeds 1 and 2 of the Qwen2 file: gaps 0.26 and 1.7)
    write_kquant_gguf(path, arch, config, base)
    src = resolve_model(str(path))
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, config=src.hf_config, dtype=torch.float32
    )
    runner = ModelRunner(family_args(str(path), dtype="bfloat16", q4_max_tokens=16, chunked_prefill_size=None))
    layers, head = runner.model.layers, runner.model.lm_head
    q_k, v = layers[0].self_attn.qkv_proj.packed.forms
    assert isinstance(v, Q8Weight) and v.supers is not None  # Q6_K beside the base's q|k
    gate_up = layers[1].mlp.gate_up_proj.packed
    if base == Q4_K:
        assert q_k.tiles.k_form and gate_up.tiles.k_form
    else:
        assert q_k.scales.dtype == gate_up.scales.dtype == torch.uint8  # Q5_K's sc and m
    assert isinstance(head, QuantLinear) and head.packed.supers is not None
    if cpu_quant.vectorized(torch.bfloat16):
        assert isinstance(runner.model.fused_decode, FusedDecodeLayers)
    assert_bf16_bar(runner, ref, name, vocab=VOCAB, lengths=(4, 37, 12, 60), new_tokens=16)


@VECTOR
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_k_m_model_with_bounds_measured_per_kind_runs_fused(dtype, tmp_path, monkeypatch):
    """With the crossover measured (`q4_max_tokens` unset), the 4-bit layers, the 8-bit ones (Q6_K,
    and a q|k|v of Q4_K beside Q6_K) and the head get their own row bounds (int4_crossover.py).
    The fused decode loop takes such a model with each projection's own bound, bit-identical to
    the Python layers at row counts on both sides of each bound."""
    if dtype == "bfloat16" and not cpu_quant.vectorized(torch.bfloat16):
        pytest.skip("no AVX512-BF16 build: a bf16 model runs Q4_K through torch's int4pack")
    import engine.models.llama as llama

    path = tmp_path / "tiny-llama-q4_k_m.gguf"
    write_kquant_gguf(path, "llama", LlamaConfig(**SHAPE), Q4_K)
    bounds = {True: 5, False: 2}  # 4-bit layers, 8-bit layers (the head: 8-bit too)
    monkeypatch.setattr(
        llama, "measure_int4_crossover", lambda mods, _dtype: bounds[isinstance(mods[0].packed, TiledQ4Weight)]
    )
    runner = ModelRunner(family_args(str(path), dtype=dtype, q4_max_tokens=None))
    model = runner.model
    layers = model.layers
    assert layers[1].self_attn.qkv_proj.max_rows == 5 and layers[0].self_attn.qkv_proj.max_rows == 2  # Q4_K | Q6_K
    assert layers[0].mlp.down_proj.max_rows == 2 and layers[0].mlp.gate_up_proj.max_rows == 5
    assert isinstance(model.fused_decode, FusedDecodeLayers)
    seen = check_every_fused_forward(monkeypatch, model)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 3, 26, 9, 12, 4)]
    lengths = [3, 14, 6, 10, 2, 8, 5]  # requests leave one by one: decodes of 7 rows down to 1
    sched = SyncScheduler(runner)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    reqs = [sched.add_request(p, sp) for p, sp in zip(prompts, params)]
    sched.run_until_idle(overlap=True)
    assert [len(r.output_ids) for r in reqs] == lengths
    decode_rows = {rows for mode, rows in seen if mode == "DECODE"}
    assert {1, 2, 3, 5, 6} <= decode_rows  # at and past each bound
    sched.scheduler.check_memory()
