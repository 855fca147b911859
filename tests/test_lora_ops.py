"""The LoRA delta of our fused projections (engine/lora/ops.py) on batches mixing the base model and
several adapters, against real PEFT modules: for each decoder layer and each part of each fused
projection, our delta equals PEFT's module output minus its base layer's output (fp32); base rows
are bit-identical to a forward without LoRA."""

from __future__ import annotations

import pytest
import torch

from engine.lora import BASE_SLOT, LoRABatchInfo, LoRAError, LoRAPool, apply_lora, load_adapter
from engine.lora.projections import PROJECTIONS
from tests.lora_fixtures import LLAMA_ADAPTERS, build_set, llama_base, mixed_batch, peft_delta, projection_inputs
from tests.lora_random import random_adapter, tiny_config


@pytest.fixture(scope="module")
def llama_set(tmp_path_factory):
    return build_set(llama_base(), LLAMA_ADAPTERS, tmp_path_factory.mktemp("llama_lora"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def adapters(llama_set):
    return {name: load_adapter(path, llama_set.cfg) for name, path in llama_set.paths.items()}


def _pool(llama_set, adapters, names, slots=4, kernel=None) -> LoRAPool:
    pool = LoRAPool(llama_set.cfg, max_loras_per_batch=slots, max_lora_rank=8, kernel=kernel)
    for name in names:
        pool.load(name, adapters[name])
    return pool


def _check_against_peft(llama_set, pool, names, rows, seed=0):
    """Every layer and projection: `apply_lora` on top of a random base output equals base + PEFT's
    delta per row (tight fp32 tolerance), and base rows keep their exact bits."""
    info = mixed_batch(names, pool, rows)
    row_names = [n for n, r in zip(names, rows) for _ in range(r)]
    base_rows = torch.tensor([n is None for n in row_names])
    gen = torch.Generator().manual_seed(seed)
    xs = projection_inputs(llama_set.cfg, sum(rows), gen)
    for layer in range(llama_set.cfg.num_layers):
        for projection, parts in PROJECTIONS.items():
            w = pool.weights(layer, projection)
            x = xs[projection]
            base = torch.randn(x.shape[0], sum(w.out_sizes), generator=gen)
            out = apply_lora(x, base.clone(), layer, projection, info)
            assert torch.equal(out[base_rows], base[base_rows]), (layer, projection)
            for p, module in enumerate(parts):
                cols = slice(w.out_starts[p], w.out_starts[p] + w.out_sizes[p])
                ref = torch.stack(
                    [
                        torch.zeros(w.out_sizes[p])
                        if n is None
                        else peft_delta(llama_set.peft[n], layer, module, xi[None])[0]
                        for n, xi in zip(row_names, x)
                    ]
                )
                torch.testing.assert_close(
                    out[:, cols] - base[:, cols], ref, rtol=1e-5, atol=2e-5, msg=f"layer {layer} {module}"
                )


@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_mixed_batch_matches_peft(llama_set, adapters, kernel):
    """Base, four adapters (every module / rsLoRA / rank and alpha patterns / a regex on one layer),
    interleaved: requests of one adapter are not adjacent, so the rows are gathered and scattered.
    Both CPU implementations: the C++ kernel (fp32's default) and torch ops."""
    pool = _pool(llama_set, adapters, ["all", "rslora", "patterns", "regex"], kernel=kernel)
    assert pool.kernel == kernel
    names = [None, "all", "rslora", None, "all", "patterns", "regex", "rslora", None]
    _check_against_peft(llama_set, pool, names, [3, 2, 1, 1, 4, 2, 2, 3, 1])


def test_single_adapter_batch_needs_no_gather(llama_set, adapters):
    """Every row on one adapter (a decode batch of one adapter): no index, same deltas."""
    pool = _pool(llama_set, adapters, ["patterns"])
    info = mixed_batch(["patterns"] * 3, pool, [1, 1, 1])
    assert info.row_index is None and info.seg_lens == (3,)
    _check_against_peft(llama_set, pool, ["patterns"] * 3, [1, 1, 1], seed=1)


@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_recycled_slot_holds_only_the_new_adapter(llama_set, adapters, kernel):
    """A slot freed by eviction or unload is cleared: the next adapter there adds only its own
    modules (the evicted one adapted projections the new one does not)."""
    pool = _pool(llama_set, adapters, ["all", "regex"], slots=2, kernel=kernel)
    pool.unload("all")
    pool.load("rslora", adapters["rslora"])  # takes the slot "all" filled
    pool.load("patterns", adapters["patterns"])  # evicts "regex", least recently used
    assert set(pool.names) == {"rslora", "patterns"}
    _check_against_peft(llama_set, pool, ["rslora", None, "patterns"], [2, 1, 3], seed=2)


def test_no_lora_rows_leave_out_untouched(llama_set, adapters):
    pool = _pool(llama_set, adapters, ["all"])
    info = LoRABatchInfo.build(pool, [BASE_SLOT, BASE_SLOT], [2, 1])
    assert info.empty
    x, out = torch.randn(3, 32), torch.randn(3, 64)
    assert torch.equal(apply_lora(x, out.clone(), 0, "qkv_proj", info), out)


def test_batch_info_groups_rows_by_adapter(llama_set, adapters):
    pool = _pool(llama_set, adapters, ["all", "rslora", "patterns"])
    a, b, c = (pool.slot_of(n) for n in ("all", "rslora", "patterns"))
    info = LoRABatchInfo.build(pool, [b, BASE_SLOT, a, b, c, a], [2, 3, 1, 0, 2, 2])
    # rows: b b | base x3 | a | (b: none) | c c | a a
    assert info.num_rows == 10 and info.num_lora_rows == 7
    segs = dict(zip(info.seg_slots, zip(info.seg_starts, info.seg_lens)))
    assert segs == {a: (0, 3), b: (3, 2), c: (5, 2)}
    assert info.row_index.tolist() == [5, 8, 9, 0, 1, 6, 7]  # in batch order within each segment
    assert info.seg_table.tolist() == [[a, b, c], [0, 3, 5], [3, 2, 2]]
    with pytest.raises(LoRAError, match="max_loras_per_batch is 2"):
        LoRABatchInfo.build(pool, [a, b, c], [1, 1, 1], max_loras_per_batch=2)
    with pytest.raises(LoRAError, match=r"slots \[3\] hold no adapter"):
        LoRABatchInfo.build(pool, [a, 3], [1, 1])
    with pytest.raises(ValueError):
        LoRABatchInfo.build(pool, [a], [1, 2])
    info = LoRABatchInfo.build(pool, [a, 3], [1, 0])  # an empty request's slot is never read
    assert info.seg_slots == (a,)


@pytest.mark.parametrize(("kernel", "rows"), [("torch", [2, 1, 3]), ("cpu", [2, 1, 3]), ("cpu", [130, 1, 3])])
def test_bf16_close_to_fp32(llama_set, adapters, kernel, rows):
    """A bf16 pool and inputs give the fp32 deltas within bf16 rounding (no dtype mix-ups) in every
    layer and projection, with torch ops and with the C++ kernel (csrc/cpu_lora.cpp: bf16's
    default on a CPU, also run by the fused layer loop; blocks of up to 8 rows of an adapter, a
    prefill's many); base rows keep their exact bits."""
    pools = {}
    for dtype in (torch.float32, torch.bfloat16):
        pools[dtype] = LoRAPool(
            llama_set.cfg,
            max_loras_per_batch=2,
            max_lora_rank=8,
            dtype=dtype,
            kernel="torch" if dtype == torch.float32 else kernel,
        )
        for name in ("all", "rslora"):
            pools[dtype].load(name, adapters[name])
    for dtype in pools:  # the C++ kernel is the default on a CPU in both
        assert LoRAPool(llama_set.cfg, dtype=dtype).kernel == "cpu"
    with pytest.raises(ValueError, match="bf16 or fp32"):
        LoRAPool(llama_set.cfg, dtype=torch.float16, kernel="cpu")
    gen = torch.Generator().manual_seed(4)
    n = sum(rows)
    xs = projection_inputs(llama_set.cfg, n, gen)
    base_rows = torch.zeros(n, dtype=torch.bool)
    base_rows[rows[0] : rows[0] + rows[1]] = True
    names = ["rslora", None, "all"]
    for layer in range(llama_set.cfg.num_layers):
        for projection in PROJECTIONS:
            x, out_f = xs[projection], sum(pools[torch.float32].weights(layer, projection).out_sizes)
            outs = {}
            for dtype, pool in pools.items():
                info = mixed_batch(names, pool, rows)
                outs[dtype] = apply_lora(x.to(dtype), torch.zeros(n, out_f, dtype=dtype), layer, projection, info)
            assert outs[torch.bfloat16].dtype == torch.bfloat16
            torch.testing.assert_close(outs[torch.bfloat16].float(), outs[torch.float32], rtol=3e-2, atol=0.3)
            base = torch.randn(n, out_f, generator=gen).to(torch.bfloat16)
            info = mixed_batch(names, pools[torch.bfloat16], rows)
            out = apply_lora(x.to(torch.bfloat16), base.clone(), layer, projection, info)
            assert torch.equal(out[base_rows], base[base_rows])


def test_cpu_kernel_odd_shapes_and_row_blocks():
    """The C++ kernel's packed groups (csrc/cpu_lora.cpp) on odd shapes: odd input widths (the last
    bf16 pair half padding), odd ranks (a rank pair straddling two parts of q|k|v), output widths
    that are not a multiple of 16 (the scalar tail), ranks that pad to 16. In bf16 against torch
    ops in bf16 (the same roundings, another summation order: within an ulp or two of the largest
    delta) and in fp32 (within bf16 rounding of the shrink); in fp32 against torch ops in fp32
    (another summation order only). A row's delta has the same bits whether or not its adapter's
    other rows share its block."""
    cfg = tiny_config(hidden_size=15, num_heads=5, num_kv_heads=1, head_dim=3, intermediate_size=21, num_layers=1)
    kinds = ((torch.float32, "torch"), (torch.bfloat16, "torch"), (torch.bfloat16, "cpu"), (torch.float32, "cpu"))
    pools = {key: LoRAPool(cfg, max_loras_per_batch=2, max_lora_rank=3, dtype=key[0], kernel=key[1]) for key in kinds}
    for seed, name in enumerate(("a", "b")):
        adapter = random_adapter(cfg, 3, seed=seed, scaling=0.25)
        for pool in pools.values():
            pool.load(name, adapter)
    gen = torch.Generator().manual_seed(11)
    rows, names = [5, 1, 11], ["a", None, "b"]
    xs = projection_inputs(cfg, sum(rows), gen)
    for projection in PROJECTIONS:
        x = xs[projection].to(torch.bfloat16)
        out_f = sum(pools[torch.float32, "torch"].weights(0, projection).out_sizes)
        outs = {}
        for (dtype, kernel), pool in pools.items():
            info = mixed_batch(names, pool, rows)
            zeros = torch.zeros(sum(rows), out_f, dtype=dtype)
            outs[kernel, dtype] = apply_lora(x.to(dtype), zeros, 0, projection, info).float()
        ours, largest = outs["cpu", torch.bfloat16], outs["torch", torch.float32].abs().amax()
        assert largest > 1.0  # the deltas are not all zero
        torch.testing.assert_close(ours, outs["torch", torch.bfloat16], rtol=0, atol=float(largest) / 64)
        torch.testing.assert_close(ours, outs["torch", torch.float32], rtol=0, atol=float(largest) / 16)
        torch.testing.assert_close(outs["cpu", torch.float32], outs["torch", torch.float32], rtol=1e-5, atol=1e-5)
        assert not torch.equal(outs["cpu", torch.float32], ours)  # fp32 kept fp32: no bf16 rounding
        # the last row of "b" alone in its block: the same bits as among the other ten
        for dtype in (torch.bfloat16, torch.float32):
            single = mixed_batch(["b"], pools[dtype, "cpu"], [1])
            alone = apply_lora(x[-1:].to(dtype), torch.zeros(1, out_f, dtype=dtype), 0, projection, single)
            assert torch.equal(alone.float(), outs["cpu", dtype][-1:])
