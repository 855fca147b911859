"""Loading PEFT LoRA adapters (engine/lora/adapter.py) saved by real PEFT on tiny real models, and the
typed errors for what we cannot serve. The fused-projection deltas of loaded adapters are checked
against PEFT's own modules here for Phi-3 (fused checkpoint names) and in test_lora_ops.py for Llama."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.lora import AdapterConfig, LoRAError, LoRAPool, adapter_from_tensors, load_adapter
from engine.lora.adapter import pattern_key
from engine.lora.projections import PROJECTIONS
from tests.lora_fixtures import (
    LLAMA_ADAPTERS,
    PHI3_ADAPTERS,
    build_set,
    llama_base,
    mixed_batch,
    our_delta,
    peft_delta,
    phi3_base,
    projection_inputs,
)


@pytest.fixture(scope="module")
def llama_set(tmp_path_factory):
    return build_set(llama_base(), LLAMA_ADAPTERS, tmp_path_factory.mktemp("llama_lora"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def phi3_set(tmp_path_factory):
    return build_set(phi3_base(), PHI3_ADAPTERS, tmp_path_factory.mktemp("phi3_lora"), "Phi3ForCausalLM")


def _peft_module(model, layer: int, module: str):
    decoder = model.base_model.model.model.layers[layer]
    return getattr(decoder.self_attn if hasattr(decoder.self_attn, module) else decoder.mlp, module)


def test_loaded_tensors_and_scalings_are_peft_s(llama_set):
    """Every module PEFT adapted is loaded with PEFT's own A, B and scaling (rsLoRA, rank_pattern,
    alpha_pattern, a regex target_modules limited to one layer included), and nothing else is."""
    for name, path in llama_set.paths.items():
        adapter = load_adapter(path, llama_set.cfg)
        model = llama_set.peft[name]
        expected = set()
        for layer in range(llama_set.cfg.num_layers):
            for parts in PROJECTIONS.values():
                for module in parts:
                    peft_layer = _peft_module(model, layer, module)
                    if hasattr(peft_layer, "lora_A"):
                        expected.add((layer, module))
                        ours = adapter.modules[(layer, module)]
                        assert torch.equal(ours.a, peft_layer.lora_A["default"].weight), (name, layer, module)
                        assert torch.equal(ours.b, peft_layer.lora_B["default"].weight), (name, layer, module)
                        assert ours.scaling == peft_layer.scaling["default"], (name, layer, module)
        assert set(adapter.modules) == expected, name
    patterns = load_adapter(llama_set.paths["patterns"], llama_set.cfg)
    assert patterns.modules[(1, "k_proj")].rank == 6 and patterns.modules[(0, "k_proj")].rank == 2
    assert patterns.modules[(0, "up_proj")].rank == 3 and patterns.modules[(0, "o_proj")].scaling == 5.0
    assert load_adapter(llama_set.paths["rslora"], llama_set.cfg).modules[(0, "q_proj")].scaling == 16 / math.sqrt(8)
    regex = load_adapter(llama_set.paths["regex"], llama_set.cfg)
    assert set(regex.modules) == {(1, "q_proj"), (1, "gate_proj")}
    assert regex.projections == {"qkv_proj", "gate_up_proj"}


def test_pattern_key_matches_like_peft():
    from peft.utils.other import get_pattern_key

    patterns = {"q_proj": 1, "layers.1.self_attn.k_proj": 2, r"model\.layers\.[0-9]+\.mlp\.up_proj": 3}
    for key in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.11.self_attn.k_proj",
        "model.layers.3.mlp.up_proj",
        "model.layers.3.mlp.gate_up_proj",
    ):
        theirs = get_pattern_key(list(patterns), key)
        assert pattern_key(patterns, key) == (theirs if theirs in patterns else None), key


def test_bin_adapter_and_adapter_name_variants(llama_set, tmp_path):
    """`adapter_model.bin` loads like safetensors; tensor names with `.default.` map the same."""
    ref = load_adapter(llama_set.paths["all"], llama_set.cfg)
    folder = tmp_path / "bin"
    llama_set.peft["all"].save_pretrained(str(folder), safe_serialization=False)
    assert (folder / "adapter_model.bin").is_file() and not (folder / "adapter_model.safetensors").exists()
    binary = load_adapter(folder, llama_set.cfg)
    config = AdapterConfig.from_dict(json.loads((llama_set.paths["all"] / "adapter_config.json").read_text()))
    tensors = load_file(str(llama_set.paths["all"] / "adapter_model.safetensors"))
    named = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    variant = adapter_from_tensors(config, named, llama_set.cfg)
    for adapter in (binary, variant):
        assert set(adapter.modules) == set(ref.modules)
        for key, m in ref.modules.items():
            assert torch.equal(adapter.modules[key].a, m.a) and torch.equal(adapter.modules[key].b, m.b)


def test_phi3_fused_modules_match_peft(phi3_set):
    """Phi-3's qkv_proj / gate_up_proj adapters (one A, B over the parts) give PEFT's delta of the
    fused module, on a batch mixing both adapters and the base model."""
    cfg = phi3_set.cfg
    pool = LoRAPool(cfg, max_loras_per_batch=2, max_lora_rank=4)
    for name, path in phi3_set.paths.items():
        adapter = load_adapter(path, cfg)
        assert adapter.target_modules >= {"q_proj", "k_proj", "v_proj"}
        pool.load(name, adapter)
    names, rows = ["fused", None, "qkv_only", "fused", None], [2, 1, 3, 1, 2]
    info = mixed_batch(names, pool, rows)
    row_names = [n for n, r in zip(names, rows) for _ in range(r)]
    xs = projection_inputs(cfg, sum(rows), torch.Generator().manual_seed(3))
    for layer in range(cfg.num_layers):
        for projection in PROJECTIONS:
            ours = our_delta(pool, info, layer, projection, xs[projection])
            module = projection  # Phi-3's modules are named as our projections
            ref = torch.stack(
                [
                    torch.zeros(ours.shape[1]) if n is None else peft_delta(phi3_set.peft[n], layer, module, x[None])[0]
                    for n, x in zip(row_names, xs[projection])
                ]
            )
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, msg=f"layer {layer} {projection}")


# ---- errors ---------------------------------------------------------------------------------------


def _config(**overrides) -> dict:
    return {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none", **overrides}


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias"),
        ({"bias": "lora_only"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"lora_bias": True}, "lora_bias"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"target_modules": ["lm_head"]}, "lm_head"),
        ({"target_modules": ["embed_tokens", "q_proj"]}, "embed_tokens"),
        ({"r": 0}, "r=0"),
        ({"rank_pattern": {"q_proj": "x"}}, "rank_pattern"),
    ],
)
def test_unsupported_configs_are_refused(overrides, words):
    with pytest.raises(LoRAError, match=words) as e:
        AdapterConfig.from_dict(_config(**overrides))
    assert e.value.param == "lora_path"


def test_fan_in_fan_out_is_accepted():
    assert AdapterConfig.from_dict(_config(fan_in_fan_out=True)).fan_in_fan_out


def _tensors(llama_set) -> dict[str, torch.Tensor]:
    return load_file(str(llama_set.paths["all"] / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ("truncate_b", "do not fit"),
        ("transpose_a", "do not fit"),
        ("drop_b", "no lora_B"),
        ("unknown_module", "does not have"),
        ("wrong_parent", "does not have"),
        ("embedding", "unsupported adapter tensor"),
        ("dora_magnitude", "unsupported adapter tensor"),
        ("layer_out_of_range", "layer 7"),
        ("empty", "no LoRA tensors"),
    ],
)
def test_bad_tensors_are_refused(llama_set, edit, words):
    config = AdapterConfig.from_dict(json.loads((llama_set.paths["all"] / "adapter_config.json").read_text()))
    tensors = _tensors(llama_set)
    prefix = "base_model.model.model.layers."
    qa, qb = prefix + "0.self_attn.q_proj.lora_A.weight", prefix + "0.self_attn.q_proj.lora_B.weight"
    if edit == "truncate_b":
        tensors[qb] = tensors[qb][:-1]
    elif edit == "transpose_a":
        tensors[qa] = tensors[qa].T.contiguous()
    elif edit == "drop_b":
        del tensors[qb]
    elif edit == "unknown_module":
        tensors[prefix + "0.self_attn.rotary.lora_A.weight"] = tensors[qa]
    elif edit == "wrong_parent":
        tensors[prefix + "0.mlp.q_proj.lora_A.weight"] = tensors[qa]
    elif edit == "embedding":
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 64)
    elif edit == "dora_magnitude":
        tensors[prefix + "0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(32)
    elif edit == "layer_out_of_range":
        tensors[prefix + "7.self_attn.q_proj.lora_A.weight"] = tensors.pop(qa)
        tensors[prefix + "7.self_attn.q_proj.lora_B.weight"] = tensors.pop(qb)
    elif edit == "empty":
        tensors = {}
    with pytest.raises(LoRAError, match=words):
        adapter_from_tensors(config, tensors, llama_set.cfg)


def test_rank_and_target_disagreements_are_refused(llama_set):
    tensors = _tensors(llama_set)
    raw = json.loads((llama_set.paths["all"] / "adapter_config.json").read_text())
    with pytest.raises(LoRAError, match="config says r=5"):
        adapter_from_tensors(AdapterConfig.from_dict({**raw, "r": 5}), tensors, llama_set.cfg)
    with pytest.raises(LoRAError, match="not in the config's target_modules"):
        adapter_from_tensors(AdapterConfig.from_dict({**raw, "target_modules": ["q_proj"]}), tensors, llama_set.cfg)


def test_folder_errors(llama_set, tmp_path):
    with pytest.raises(LoRAError, match=r"no adapter_config\.json"):
        load_adapter(tmp_path / "missing", llama_set.cfg)
    folder = tmp_path / "no_weights"
    folder.mkdir()
    shutil.copy(llama_set.paths["all"] / "adapter_config.json", folder)
    with pytest.raises(LoRAError, match="has no adapter_model"):
        load_adapter(folder, llama_set.cfg)
    (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAError, match="cannot read the adapter weights"):
        load_adapter(folder, llama_set.cfg)
    (folder / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(LoRAError, match="JSON object"):
        load_adapter(folder, llama_set.cfg)
    dora = tmp_path / "dora"
    shutil.copytree(llama_set.paths["all"], dora)
    raw = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**raw, "use_dora": True}))
    with pytest.raises(LoRAError, match="DoRA"):
        load_adapter(dora, llama_set.cfg)


def test_adapter_for_another_model_is_refused(llama_set, tmp_path):
    """An adapter trained on a wider model: its shapes name the mismatch."""
    wide = {k: torch.cat([v, v], dim=1) if ".lora_A." in k else v for k, v in _tensors(llama_set).items()}
    folder = tmp_path / "wide"
    shutil.copytree(llama_set.paths["all"], folder)
    save_file(wide, str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match=r"lora_A \(4, 80\) .* do not fit \[r, 40\]"):
        load_adapter(folder, llama_set.cfg)
