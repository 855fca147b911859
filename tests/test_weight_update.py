"""Weight updates without a restart (the RL rollout issue): from disk and from tensors, checked
against transformers on the new checkpoint; bad weights change nothing; requests already running
end under the weights they started with."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import Engine, EngineError, InvalidRequestError, ModelLoadError, SamplingParams
from tests.sched_harness import save_random_llama
from tests.server_helpers import free_port, server_env
from tests.weight_helpers import GREEDY, PROMPTS, greedy, hf_greedy, hf_named_tensors, make_checkpoints, perturbed_copy
from tests.weight_trainer import GROUP


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_tokenizer) -> dict[str, str]:
    return make_checkpoints(tmp_path_factory.mktemp("weights"), default_tokenizer)


async def test_update_from_disk_serves_the_new_checkpoint_and_bad_ones_change_nothing(checkpoints):
    want_a, want_b = hf_greedy(checkpoints["a"]), hf_greedy(checkpoints["b"])
    assert want_a != want_b
    async with Engine(checkpoints["a"], dtype="float32", max_total_tokens=4096) as engine:
        assert engine.model_info.weight_version == "default"
        assert await greedy(engine) == want_a
        assert await engine.update_weights_from_disk(checkpoints["b"], weight_version="step-1") == "step-1"
        assert engine.model_info.weight_version == "step-1"
        results = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
        assert [r.token_ids for r in results] == want_b
        assert {r.weight_version for r in results} == {"step-1"}
        assert all(r.weight_versions == ["step-1"] for r in results)
        # the radix cache was flushed: the same prompts hit nothing computed by the old weights
        state = await engine.get_internal_state()
        assert state["evictable_tokens"] > 0  # the new prompts are cached again
        for bad, why in (("wide", "intermediate_size"), ("missing", "layers.1.mlp.down_proj")):
            with pytest.raises(ModelLoadError, match=why):
                await engine.update_weights_from_disk(checkpoints[bad])
            assert engine.model_info.weight_version == "step-1"
            assert await greedy(engine) == want_b
        with pytest.raises(ModelLoadError, match="does not exist"):
            await engine.update_weights_from_disk("/nonexistent/checkpoint")
        with pytest.raises(InvalidRequestError) as info:
            await engine.update_weights_from_disk(checkpoints["a"], load_format="pickle")
        assert info.value.param == "load_format"
        # no version named: the count of updates applied
        assert await engine.update_weights_from_disk(checkpoints["a"]) == "2"
        assert await greedy(engine) == want_a


async def test_update_from_tensor_in_buckets_and_all_or_nothing(checkpoints):
    want_a, want_b = hf_greedy(checkpoints["a"]), hf_greedy(checkpoints["b"])
    named = hf_named_tensors(checkpoints["b"])
    async with Engine(checkpoints["a"], dtype="float32", max_total_tokens=4096) as engine:
        assert await greedy(engine) == want_a
        # one bad tensor fails the whole call, the good ones in it included
        bad = [*named[:4], ("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))]
        with pytest.raises(ModelLoadError, match=r"shape \(3, 3\)"):
            await engine.update_weights_from_tensor(bad)
        with pytest.raises(ModelLoadError, match="unexpected weight"):
            await engine.update_weights_from_tensor([("model.layers.7.mlp.up_proj.weight", named[0][1])])
        with pytest.raises(InvalidRequestError, match="floating-point"):
            await engine.update_weights_from_tensor([(named[0][0], named[0][1].long())])
        assert await greedy(engine) == want_a
        assert engine.model_info.weight_version == "default"
        # a trainer's buckets: the cache flushed after the last one only
        third = len(named) // 3
        buckets = [named[:third], named[third : 2 * third], named[2 * third :]]
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            version = await engine.update_weights_from_tensor(bucket, weight_version=f"b{i}", flush_cache=last)
            assert version == f"b{i}"
        assert await greedy(engine) == want_b


@pytest.mark.parametrize("dtype", ["bfloat16"])
async def test_bf16_update_rebuilds_every_derived_form(checkpoints, dtype):
    """bf16 on a CPU runs VNNI-pair (or oneDNN-prepacked) projections and the fused C++ decode loop: after an
    update both must read the new values, so outputs equal an engine started on the new weights."""
    async with Engine(checkpoints["b"], dtype=dtype, max_total_tokens=4096) as fresh:
        want_b = await greedy(fresh)
    async with Engine(checkpoints["a"], dtype=dtype, max_total_tokens=4096) as engine:
        want_a = await greedy(engine)
        assert want_a != want_b
        await engine.update_weights_from_tensor(hf_named_tensors(checkpoints["b"]))
        assert await greedy(engine) == want_b
        await engine.update_weights_from_disk(checkpoints["a"])
        assert await greedy(engine) == want_a


async def test_running_requests_finish_under_the_old_weights(checkpoints):
    """SGLang's update lock: an update waits for the requests already running; new ones wait for it."""
    long = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    async with Engine(checkpoints["a"], dtype="float32", max_total_tokens=4096) as engine:
        stream = engine.open_stream(PROMPTS[0], long)
        first = await stream.__anext__()  # it is running
        assert first.token_ids
        update = asyncio.ensure_future(engine.update_weights_from_disk(checkpoints["b"], weight_version="new"))
        await asyncio.sleep(0)
        later = asyncio.ensure_future(engine.generate(PROMPTS[1], GREEDY))
        deltas = [first]
        async for d in stream:
            deltas.append(d)
        assert sum(len(d.token_ids) for d in deltas) == 60
        assert {d.weight_version for d in deltas} == {"default"}
        assert await update == "new"
        assert (await later).weight_versions == ["new"]
        # abort_all_requests ends what runs instead of waiting for it
        stream = engine.open_stream(PROMPTS[0], long)
        await stream.__anext__()
        await engine.update_weights_from_disk(checkpoints["a"], abort_all_requests=True)
        tail = [d async for d in stream]
        assert tail[-1].finish_reason == "abort"


async def test_update_on_a_stopped_engine_is_a_typed_error(checkpoints):
    engine = Engine(checkpoints["a"], dtype="float32", max_total_tokens=4096)
    with pytest.raises(EngineError):
        await engine.update_weights_from_disk(checkpoints["b"])


@pytest.fixture(scope="module")
def tp3_checkpoints(tmp_path_factory, default_tokenizer) -> dict[str, str]:
    """A tiny Llama whose 6 heads / 3 KV heads split over 3 ranks, and a second step of it."""
    root = tmp_path_factory.mktemp("tp3-weights")
    cfg = LlamaConfig(
        vocab_size=len(default_tokenizer),
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=default_tokenizer.eos_token_id,
    )
    a = save_random_llama(root / "a", cfg)
    default_tokenizer.save_pretrained(a)
    return {"a": str(a), "b": perturbed_copy(str(a), root / "b", seed=4)}


async def test_update_from_disk_under_tensor_parallelism(tp3_checkpoints, checkpoints):
    """Each of 3 ranks loads its own shard of the new checkpoint (from disk, or from tensors rank 0
    broadcasts); a bad one is refused by all."""
    a, b = tp3_checkpoints["a"], tp3_checkpoints["b"]
    want_a, want_b = hf_greedy(a), hf_greedy(b)
    async with Engine(a, dtype="float32", tp_size=3, torch_threads=1, max_total_tokens=4096) as engine:
        assert await greedy(engine) == want_a
        assert await engine.update_weights_from_disk(b, weight_version="tp-b") == "tp-b"
        assert await greedy(engine) == want_b
        with pytest.raises(ModelLoadError, match="not the served model"):
            await engine.update_weights_from_disk(checkpoints["a"])  # another model's shapes
        assert await greedy(engine) == want_b
        # from tensors: rank 0 broadcasts them whole, each rank keeps its shard; one bad tensor
        # fails every rank (the good ones in the same call included)
        named_a = hf_named_tensors(a)
        with pytest.raises(ModelLoadError, match="unexpected weight"):
            await engine.update_weights_from_tensor(
                [*named_a[:3], ("model.layers.5.mlp.up_proj.weight", named_a[0][1])]
            )
        assert await greedy(engine) == want_b
        assert await engine.update_weights_from_tensor(named_a, weight_version="tp-a") == "tp-a"
        assert await greedy(engine) == want_a
        # memory released and resumed on every rank (the weights from the last checkpoint: b)
        await engine.release_memory_occupation()
        await engine.resume_memory_occupation()
        assert await greedy(engine) == want_b and engine.model_info.weight_version == "tp-b"
        # a trainer's group of 1 + 3 ranks: every engine rank takes the broadcast whole
        sd = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).state_dict()
        port = free_port()
        trainer = subprocess.Popen([sys.executable, "-m", "tests.weight_trainer", str(port), "4", a], env=server_env())
        try:
            await engine.init_weights_update_group("127.0.0.1", port, 1, 4, GROUP)
            spec = [list(sd), [str(t.dtype) for t in sd.values()], [list(t.shape) for t in sd.values()]]
            assert await engine.update_weights_from_distributed(*spec, GROUP, weight_version="tp-g") == "tp-g"
            assert trainer.wait(timeout=120) == 0
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        await engine.destroy_weights_update_group(GROUP)
        assert await greedy(engine) == want_a
        assert engine.healthy


async def test_update_from_a_trainer_process_group(checkpoints):
    """A trainer in its own process hosts a gloo group, the engine joins it, and weights arrive by
    broadcast (SGLang's init_weights_update_group + update_weights_from_distributed)."""
    a, b = checkpoints["a"], checkpoints["b"]
    want_a, want_b = hf_greedy(a), hf_greedy(b)
    sd = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict()
    names = list(sd)
    dtypes = [str(t.dtype) for t in sd.values()]
    shapes = [list(t.shape) for t in sd.values()]
    port = free_port()
    # two rounds: B's weights, then A's under one wrong name (refused whole, after it arrived)
    trainer = subprocess.Popen([sys.executable, "-m", "tests.weight_trainer", str(port), "2", b, a], env=server_env())
    try:
        async with Engine(a, dtype="float32", max_total_tokens=4096) as engine:
            assert await greedy(engine) == want_a
            await engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP)
            with pytest.raises(InvalidRequestError, match="exists already"):
                await engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP)
            version = await engine.update_weights_from_distributed(names, dtypes, shapes, GROUP, weight_version="g1")
            assert version == "g1"
            assert await greedy(engine) == want_b
            wrong = ["model.layers.9.mlp.up_proj.weight", *names[1:]]
            with pytest.raises(ModelLoadError, match="unexpected weight"):
                await engine.update_weights_from_distributed(wrong, dtypes, shapes, GROUP)
            assert await greedy(engine) == want_b and engine.model_info.weight_version == "g1"
            await engine.destroy_weights_update_group(GROUP)
            with pytest.raises(InvalidRequestError, match="no weight update group"):
                await engine.update_weights_from_distributed(names, dtypes, shapes, GROUP)
            with pytest.raises(InvalidRequestError):
                await engine.update_weights_from_distributed(names, dtypes[:-1], shapes, GROUP)
        assert trainer.wait(timeout=120) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
