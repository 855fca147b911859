"""`LoRAPool` (slots, LRU eviction among unpinned adapters, the errors) and the tensor-parallel
slicing of adapters (engine/lora/projections.py): every rank's shard, reassembled, is the whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.distributed.sharding import TPShard
from engine.lora import (
    BASE_SLOT,
    LoRABatchInfo,
    LoRAError,
    LoRAPool,
    LoRAPoolFullError,
    LoRARegistry,
    apply_lora,
    parse_lora_paths,
    resolve_target_modules,
    shard_lora,
)
from engine.lora.projections import MODULES, PROJECTIONS
from engine.model_config import ModelConfig
from tests.lora_random import CFG, random_adapter


def test_lru_eviction_skips_pinned_adapters():
    pool = LoRAPool(CFG, max_loras_per_batch=2, max_lora_rank=4)
    a, b, c, d = (random_adapter(CFG, 2, seed=s) for s in range(4))
    assert pool.load("a", a) == 0 and pool.load("b", b) == 1
    assert pool.load("a", a) == 0  # already resident: only marked used, so "b" is now the LRU
    assert pool.acquire("a") == 0 and pool.pins("a") == 1
    assert pool.load("c", c) == 1 and "b" not in pool  # "b" (unpinned) evicted
    pool.acquire("c")
    with pytest.raises(LoRAPoolFullError) as e:  # both slots pinned
        pool.load("d", d)
    assert isinstance(e.value, LoRAError) and e.value.param == "max_loras_per_batch"
    assert pool.names == ("a", "c")
    pool.release("a")
    assert pool.load("d", d) == 0 and pool.names == ("c", "d")  # "a" evicted once let go
    with pytest.raises(LoRAError, match="in use"):
        pool.unload("c")
    pool.release("c")
    pool.unload("c")
    assert "c" not in pool and pool.load("b", b) == 1  # the unloaded slot is reused
    assert not pool.weights(0, "qkv_proj").a[1].eq(0).all()


def test_pins_count_requests():
    pool = LoRAPool(CFG, max_loras_per_batch=1, max_lora_rank=4)
    pool.load("a", random_adapter(CFG, 2))
    pool.acquire("a")
    pool.acquire("a")
    pool.release("a")
    with pytest.raises(LoRAPoolFullError):
        pool.load("b", random_adapter(CFG, 2, seed=1))
    pool.release("a")
    with pytest.raises(LoRAError, match="not held"):
        pool.release("a")
    pool.load("b", random_adapter(CFG, 2, seed=1))
    assert pool.names == ("b",)


def test_pool_errors():
    pool = LoRAPool(CFG, max_loras_per_batch=2, max_lora_rank=4, target_modules=["q_proj", "v_proj"])
    assert pool.projections == ("qkv_proj",) and pool.weights(0, "o_proj") is None
    for call in (pool.acquire, pool.unload, pool.slot_of):
        with pytest.raises(LoRAError, match="not loaded") as e:
            call("nope")
        assert e.value.param == "lora_path"
    with pytest.raises(LoRAError, match="above max_lora_rank=4") as e:
        pool.load("big", random_adapter(CFG, 5, modules=("q_proj",)))
    assert e.value.param == "max_lora_rank" and "big" not in pool
    with pytest.raises(LoRAError, match=r"adapts \['k_proj'\]") as e:
        pool.load("k", random_adapter(CFG, 2, modules=("q_proj", "k_proj")))
    assert e.value.param == "lora_target_modules"
    a = random_adapter(CFG, 2, modules=("q_proj", "v_proj"))
    pool.load("a", a)
    with pytest.raises(LoRAError, match="already loaded"):
        pool.load("a", random_adapter(CFG, 2, modules=("q_proj",), seed=3))
    other = dataclasses.replace(CFG, hidden_size=12)  # an adapter checked for another model
    with pytest.raises(LoRAError, match="do not fit this model"):
        pool.load("other", random_adapter(other, 2, modules=("q_proj",)))
    assert pool.names == ("a",) and len(pool.weights(0, "qkv_proj").active) == 1  # the failed slot was freed
    with pytest.raises(LoRAError, match="unknown LoRA target module 'lm_head'"):
        resolve_target_modules(["lm_head"])
    assert resolve_target_modules(["qkv_proj", "down_proj"]) == {"q_proj", "k_proj", "v_proj", "down_proj"}
    assert resolve_target_modules(["all"]) == set(MODULES)
    with pytest.raises(LoRAError):
        LoRAPool(CFG, max_loras_per_batch=0)


def test_buffer_layout():
    """Part p's A sits in rank rows [p*R, p*R + r) and its scaling in the same columns; B's rows
    of part p hold its B in the first r columns; everything else is zero."""
    pool = LoRAPool(CFG, max_loras_per_batch=2, max_lora_rank=4)
    adapter = random_adapter(CFG, 3, modules=("k_proj", "up_proj"))
    slot = pool.load("a", adapter)
    w = pool.weights(1, "qkv_proj")
    k = adapter.modules[(1, "k_proj")]
    q_size, kv_size = 24, 12
    assert torch.equal(w.a[slot, 4 : 4 + k.rank], k.a) and w.a[slot, :4].eq(0).all() and w.a[slot, 8:].eq(0).all()
    assert torch.equal(w.b[slot, q_size : q_size + kv_size, : k.rank], k.b)
    assert w.b[slot].count_nonzero() == k.b.count_nonzero()
    assert w.scaling[slot].tolist() == [0] * 4 + [k.scaling] * k.rank + [0] * (8 - k.rank)
    assert slot in w.active and slot not in pool.weights(1, "o_proj").active
    assert w.part_table.tolist() == [[0, q_size, q_size + kv_size], [q_size, kv_size, kv_size]]


def test_registry_names_and_cache_keys(tmp_path):
    reg = LoRARegistry(CFG, max_loaded_loras=2)
    a = reg.add("a", random_adapter(CFG, 2))
    reg.add("b", random_adapter(CFG, 2, seed=1))
    assert reg.get("a") is a and reg.names == ("a", "b") and reg.cache_key(None) == 0
    with pytest.raises(LoRAError, match="max_loaded_loras"):
        reg.add("c", random_adapter(CFG, 2))
    with pytest.raises(LoRAError, match="already loaded"):
        reg.add("a", random_adapter(CFG, 2))
    with pytest.raises(LoRAError, match=r"unknown LoRA adapter 'c' \(loaded: a, b\)") as e:
        reg.get("c")
    assert e.value.param == "lora_path"
    old = reg.cache_key("a")
    reg.remove("a")
    reg.add("a", random_adapter(CFG, 3))
    assert reg.cache_key("a") not in (old, reg.cache_key("b"), 0)  # a new adapter never shares cached KV
    reg.remove("b")
    with pytest.raises(LoRAError, match="PEFT adapter folder"):
        reg.add("c", tmp_path)  # a path is read with load_adapter
    assert reg.names == ("a",)
    assert parse_lora_paths(["x=/p/x", " y = /p/y ", "/p/z"]) == {"x": "/p/x", "y": "/p/y", "/p/z": "/p/z"}
    for bad in (["=/p"], ["x="], ["x=/a", "x=/b"]):
        with pytest.raises(LoRAError) as e:
            parse_lora_paths(bad)
        assert e.value.param == "lora_paths"


# ---- tensor parallelism ---------------------------------------------------------------------------


def _tp_cfg(num_heads: int, num_kv_heads: int) -> ModelConfig:
    return dataclasses.replace(CFG, num_heads=num_heads, num_kv_heads=num_kv_heads, hidden_size=num_heads * 4)


@pytest.mark.parametrize(("size", "heads", "kv_heads"), [(2, 4, 2), (3, 6, 3), (2, 6, 1), (3, 6, 1)])
def test_tp_shards_reassemble_to_the_whole(size, heads, kv_heads):
    """Column-parallel (q/k/v, gate/up): A whole, B's rows cut like the base weight's rows (a
    replicated KV head gives each of its ranks that head's rows). Row-parallel (o, down): A's
    columns cut like the base weight's columns, B whole; the ranks' deltas sum to the whole."""
    cfg = _tp_cfg(heads, kv_heads)
    adapter = random_adapter(cfg, 3, seed=size)
    whole = LoRAPool(cfg, max_loras_per_batch=2, max_lora_rank=4)
    whole.load("a", adapter)
    shards = [TPShard.of(cfg, rank, size) for rank in range(size)]
    pools = [LoRAPool(cfg, max_loras_per_batch=2, max_lora_rank=4, shard=s) for s in shards]
    for pool in pools:
        pool.load("a", adapter)
    for (layer, module), m in adapter.modules.items():
        parts = [shard_lora(m.a, m.b, layer, module, s) for s in shards]
        if module in ("o_proj", "down_proj"):
            assert all(torch.equal(b, m.b) for _, b in parts)
            assert torch.equal(torch.cat([a for a, _ in parts], dim=1), m.a)
        else:
            assert all(torch.equal(a, m.a) for a, _ in parts)
            rows = [b for _, b in parts]
            if module in ("k_proj", "v_proj") and kv_heads < size:  # replicated: rank r holds head r*KVH//size
                rows = rows[:: size // kv_heads]
            assert torch.equal(torch.cat(rows), m.b), (module, size)

    rows = [2, 1, 3]
    gen = torch.Generator().manual_seed(7)
    infos = [LoRABatchInfo.build(p, [p.slot_of("a"), BASE_SLOT, p.slot_of("a")], rows) for p in [whole, *pools]]
    for layer in range(cfg.num_layers):
        for projection in PROJECTIONS:
            w = whole.weights(layer, projection)
            x = torch.randn(sum(rows), w.a.shape[2], generator=gen)
            ref = apply_lora(x, torch.zeros(sum(rows), sum(w.out_sizes)), layer, projection, infos[0])
            deltas = []
            for shard, pool, info in zip(shards, pools, infos[1:]):
                ws = pool.weights(layer, projection)
                xs = x
                if projection in ("o_proj", "down_proj"):  # this rank's input columns
                    per = ws.a.shape[2]
                    xs = x[:, shard.rank * per : (shard.rank + 1) * per]
                deltas.append(apply_lora(xs, torch.zeros(sum(rows), sum(ws.out_sizes)), layer, projection, info))
            if projection in ("o_proj", "down_proj"):
                # partial sums, which the layer's all-reduce adds: only the summation order differs
                torch.testing.assert_close(sum(deltas), ref, rtol=1e-4, atol=1e-4)
                continue
            for p, module in enumerate(PROJECTIONS[projection]):
                mine = []
                for pool, d in zip(pools, deltas):
                    ws = pool.weights(layer, projection)
                    mine.append(d[:, ws.out_starts[p] : ws.out_starts[p] + ws.out_sizes[p]])
                if module in ("k_proj", "v_proj") and kv_heads < size:
                    mine = mine[:: size // kv_heads]
                cols = slice(w.out_starts[p], w.out_starts[p] + w.out_sizes[p])
                torch.testing.assert_close(torch.cat(mine, dim=1), ref[:, cols], rtol=1e-5, atol=1e-5)
