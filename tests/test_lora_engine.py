"""Multi-LoRA through the in-process Engine: one forward serves the base model and several adapters.

A tiny real Llama (the real tokenizer beside it) and three real PEFT adapters of different ranks
and targets (tests/lora_fixtures.py: every module at r=4, rsLoRA r=8 on q/v/down, r=2 with rank and
alpha patterns); fp32 greedy outputs of one batch mixing base and adapter requests must be the
tokens transformers + PEFT pick for each, with overlap on and off and with chunked prefill.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import LlamaForCausalLM

from engine import Engine, SamplingParams
from engine.actors.messages import TokenizedGenerateReq
from engine.errors import InvalidRequestError, InvalidServerArgsError
from engine.recorder.events import RecvEvent
from engine.recorder.replay import replay
from engine.recorder.ring import load_dump
from tests.lora_fixtures import LLAMA_ADAPTERS, wrap
from tests.sched_harness import build_tiny_folder, make_tiny_llama

NAMES = ("all", "rslora", "patterns")
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, default_tokenizer):
    root = tmp_path_factory.mktemp("lora-engine")
    folder = build_tiny_folder(root / "base", default_tokenizer)
    base = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    peft, paths = {}, {}
    for i, name in enumerate(NAMES):
        peft[name] = wrap(base, name, LLAMA_ADAPTERS[name], seed=200 + i)
        paths[name] = str(root / name)
        peft[name].save_pretrained(paths[name])
    models = {None: base, **peft}
    return folder, paths, models


def greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers (+ PEFT) greedy decoding, recomputing the whole sequence each step, no EOS stop."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 30))] for _ in range(n)]


def lora_engine(folder: str, paths: dict[str, str], **kw) -> Engine:
    opts = dict(
        dtype="float32",
        device="cpu",
        torch_threads=1,
        max_total_tokens=4096,
        max_running_requests=32,
        lora_paths=[f"{n}={p}" for n, p in paths.items()],
    )
    opts.update(kw)
    return Engine(folder, **opts)


async def idle_state(engine: Engine) -> dict:
    while True:
        st = await engine.get_internal_state()
        if st["running_requests"] == 0 and st["waiting_requests"] == 0 and st["protected_tokens"] == 0:
            return st
        await asyncio.sleep(0.01)


async def assert_clean(engine: Engine) -> None:
    st = await idle_state(engine)
    assert st["available_tokens"] + st["evictable_tokens"] == st["total_tokens"], st
    assert st["memory_errors"] == [], st["memory_errors"]


SP = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    "opts",
    [
        dict(enable_overlap=True),
        dict(enable_overlap=False),
        dict(enable_overlap=True, chunked_prefill_size=8, enable_mixed_chunk=True),
    ],
    ids=["overlap", "no-overlap", "chunked-mixed"],
)
async def test_mixed_batch_matches_peft(lora_setup, opts):
    folder, paths, models = lora_setup
    ps = prompts(8, seed=1)
    names = [(None, *NAMES)[i % 4] for i in range(len(ps))]
    # max_loras_per_batch=2 < 3 adapters: admission must hold some requests back and the pool swap
    async with lora_engine(folder, paths, max_loras_per_batch=2, **opts) as engine:
        outs = await asyncio.gather(*(engine.generate(p, SP, lora_path=n) for p, n in zip(ps, names)))
        await assert_clean(engine)
    differs = 0
    for p, n, out in zip(ps, names, outs):
        want = greedy(models[n], p)
        assert out.token_ids == want, f"adapter {n}"
        differs += n is not None and want != greedy(models[None], p)
    assert differs >= 4  # the adapters really change the outputs (6 adapter requests)


async def test_prefix_cached_under_one_adapter_is_not_reused_by_another(lora_setup):
    folder, paths, _ = lora_setup
    prompt = prompts(1, seed=7)[0] * 3  # long enough for whole cached pages
    sp = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    async with lora_engine(folder, paths) as engine:
        await engine.generate(prompt, sp)  # cached under the base model first
        first = await engine.generate(prompt, sp, lora_path="all")
        assert first.cached_tokens == 0  # an adapter with nothing cached yet does not see the base's
        again = await engine.generate(prompt, sp, lora_path="all")
        assert again.cached_tokens > 0  # the same adapter reuses it
        assert (await engine.generate(prompt, sp, lora_path="rslora")).cached_tokens == 0
        assert (await engine.generate(prompt, sp)).cached_tokens > 0  # the base keeps its own
        fresh = prompts(1, seed=8)[0] * 3
        await engine.generate(fresh, sp, lora_path="all")
        assert (await engine.generate(fresh, sp)).cached_tokens == 0  # nor does the base see an adapter's
        await assert_clean(engine)


async def test_load_unload_at_run_time(lora_setup):
    folder, paths, models = lora_setup
    p = prompts(1, seed=3)[0]
    async with lora_engine(folder, {"all": paths["all"]}, max_lora_rank=8, lora_target_modules=["all"]) as engine:
        assert engine.lora_adapters() == ["all"]
        with pytest.raises(InvalidRequestError) as e:
            await engine.generate(p, SP, lora_path="rslora")
        assert e.value.param == "lora_path"
        assert await engine.load_lora_adapter("rslora", paths["rslora"]) == ["all", "rslora"]
        out = await engine.generate(p, SP, lora_path="rslora")
        assert out.token_ids == greedy(models["rslora"], p)
        with pytest.raises(InvalidRequestError):  # the name is taken
            await engine.load_lora_adapter("rslora", paths["patterns"])
        with pytest.raises(InvalidRequestError):  # not a PEFT folder
            await engine.load_lora_adapter("bad", folder)
        # in use by an open request: refused, naming it
        stream = engine.open_stream(p, SamplingParams(max_new_tokens=50, ignore_eos=True), lora_path="rslora")
        with pytest.raises(InvalidRequestError, match="rslora"):
            await engine.unload_lora_adapter("rslora")
        await stream.aclose()
        await idle_state(engine)
        # cached prefixes under it are freed with it
        assert await engine.unload_lora_adapter("rslora") == ["all"]
        with pytest.raises(InvalidRequestError):
            await engine.generate(p, SP, lora_path="rslora")
        with pytest.raises(InvalidRequestError):
            await engine.unload_lora_adapter("rslora")
        # loaded again under the same name: a new cache key, nothing reused from before
        await engine.load_lora_adapter("rslora", paths["rslora"])
        again = await engine.generate(p, SP, lora_path="rslora")
        assert again.token_ids == out.token_ids and again.cached_tokens == 0
        await assert_clean(engine)


async def test_unknown_adapter_and_lora_off(lora_setup):
    folder, paths, _ = lora_setup
    p = prompts(1, seed=4)[0]
    async with lora_engine(folder, paths) as engine:
        for call in (engine.generate, engine.submit):
            with pytest.raises(InvalidRequestError) as e:
                await call(p, SP, lora_path="nope")
            assert e.value.param == "lora_path"
        with pytest.raises(InvalidRequestError):
            engine.open_stream(p, SP, lora_path="nope")
    async with lora_engine(folder, {}, lora_paths=None) as engine:  # LoRA off
        with pytest.raises(InvalidRequestError):
            await engine.generate(p, SP, lora_path="all")
        with pytest.raises(InvalidRequestError):
            await engine.load_lora_adapter("all", paths["all"])
        assert engine.lora_adapters() == []


async def test_aborts_keep_memory_and_pins_clean(lora_setup):
    folder, paths, _ = lora_setup
    ps = prompts(12, seed=5)
    long = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    async with lora_engine(folder, paths, max_loras_per_batch=2, chunked_prefill_size=16) as engine:
        streams = [engine.open_stream(p, long, lora_path=(None, *NAMES)[i % 4]) for i, p in enumerate(ps)]
        for i, s in enumerate(streams):
            if i % 2:
                await s.aclose()  # aborted, running or waiting
        for s in streams[::2]:
            async for _ in s:
                pass
        await assert_clean(engine)
        # every adapter unpinned again: each one can be unloaded now
        for name in NAMES:
            await engine.unload_lora_adapter(name)
        await assert_clean(engine)


@pytest.fixture(scope="module")
def repeating_lora_setup(tmp_path_factory, default_tokenizer):
    """A tiny Llama that mostly repeats its current token (damped attention and MLP outputs) and
    weak adapters (std 0.05): their outputs differ from the base's and still fall into repeats,
    so n-gram drafts get accepted."""
    root = tmp_path_factory.mktemp("lora-repeating")
    folder = make_tiny_llama(root / "base", len(default_tokenizer), tie_word_embeddings=True,
                             damped=("o_proj.weight", "down_proj.weight"))  # fmt: skip
    default_tokenizer.save_pretrained(folder)
    base = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    models, paths = {None: base}, {}
    for i, name in enumerate(("all", "patterns")):
        models[name] = wrap(base, name, LLAMA_ADAPTERS[name], seed=200 + i, scale=0.05)
        paths[name] = str(root / name)
        models[name].save_pretrained(paths[name])
    return str(folder), paths, models


async def test_speculative_decoding_with_adapters_matches_peft(repeating_lora_setup):
    """N-gram drafts are verified through each request's adapter, in a verify forward that
    mixes the base and two adapters: the tokens are PEFT's, and adapter requests had drafts
    accepted."""
    folder, paths, models = repeating_lora_setup
    rng = random.Random(11)
    ps = [[rng.randrange(100, 40000) for _ in range(6)] * 4 for _ in range(6)]
    names = [None, "all", "patterns"] * 2
    sp = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    async with lora_engine(folder, paths, speculative_algorithm="NGRAM") as engine:
        outs = await asyncio.gather(*(engine.generate(p, sp, lora_path=n) for p, n in zip(ps, names)))
        await assert_clean(engine)
    for p, n, out in zip(ps, names, outs):
        want = greedy(models[n], p, 24)
        assert out.token_ids == want, f"adapter {n}"
        assert n is None or want != greedy(models[None], p, 24)  # the adapter changes the output
    assert sum(o.spec_accepted_tokens or 0 for o, n in zip(outs, names) if n is not None) > 0


async def test_default_model_tp3_adapters_match_peft(tmp_path, hf_default_model, default_tokenizer):
    """tp_size=3 on the default model: each rank holds its shard of every slot, and rank 0's slot
    changes (swaps forced by max_loras_per_batch=1, a run-time load and unload) are replayed on
    the others; fp32 greedy tokens are transformers + PEFT's."""
    models, paths = {None: hf_default_model}, {}
    for i, name in enumerate(NAMES):
        models[name] = wrap(hf_default_model, name, LLAMA_ADAPTERS[name], seed=300 + i, scale=0.08)
        paths[name] = str(tmp_path / name)
        models[name].save_pretrained(paths[name])
    texts = ["The capital of France is", "def fibonacci(n):", "List colors:", "Once upon a time"]
    ps = [default_tokenizer.encode(t) for t in texts] * 2
    names = [None, "all", "rslora", "all", "rslora", None, "all", "rslora"]
    async with lora_engine("smollm2-135m", {k: paths[k] for k in ("all", "rslora")}, tp_size=3, torch_threads=None,
                           max_loras_per_batch=1, max_lora_rank=8, lora_target_modules=["all"]) as engine:  # fmt: skip
        outs = await asyncio.gather(*(engine.generate(p, SP, lora_path=n) for p, n in zip(ps, names)))
        differs = 0
        for p, n, out in zip(ps, names, outs):
            want = greedy(models[n], p)
            assert out.token_ids == want, f"adapter {n}"
            differs += n is not None and want != greedy(models[None], p)
        assert differs >= 3  # the adapters really change the outputs
        assert await engine.unload_lora_adapter("all") == ["rslora"]
        assert await engine.load_lora_adapter("patterns", paths["patterns"]) == ["patterns", "rslora"]
        out = await engine.generate(ps[0], SP, lora_path="patterns")
        assert out.token_ids == greedy(models["patterns"], ps[0])
        await assert_clean(engine)
        assert len((await engine.get_internal_state())["tensor_parallel"]) == 3


async def test_a_run_with_adapters_replays_from_the_flight_recorder(lora_setup, tmp_path):
    """The dump records each request's adapter; replay rebuilds the pool's slots and pins
    (max_loras_per_batch=2 < 3 adapters: swaps), an adapter's own radix hits, and a run-time
    unload (its cached prefixes freed) and load, with no divergence."""
    folder, paths, _ = lora_setup
    ps = prompts(10, seed=13)
    names = [(None, *NAMES)[i % 4] for i in range(len(ps))]
    opts = dict(max_loras_per_batch=2, chunked_prefill_size=16, flight_recorder_dir=str(tmp_path))
    async with lora_engine(folder, paths, **opts) as engine:
        await asyncio.gather(*(engine.generate(p, SP, lora_path=n) for p, n in zip(ps, names)))
        assert (await engine.generate(ps[1], SP, lora_path=names[1])).cached_tokens > 0
        await engine.unload_lora_adapter(names[1])
        await engine.load_lora_adapter(names[1], paths[names[1]])
        again = await asyncio.gather(*(engine.generate(p, SP, lora_path=n) for p, n in zip(ps[:6], names[:6])))
        assert again[1].cached_tokens == 0 and again[2].cached_tokens > 0
        path = engine.dump_flight_recorder("lora")
    dump = load_dump(path)
    reqs = [e.msg for e in dump.events if isinstance(e, RecvEvent) and isinstance(e.msg, TokenizedGenerateReq)]
    adapters = {r.rid: r.lora_path for r in reqs}  # each request is recorded where each actor took it
    assert len(adapters) == 17 and set(adapters.values()) == {None, *NAMES}
    report = replay(path)
    assert report.divergence is None, report.divergence.describe()
    assert report.requests == 17 and report.steps > 10


def test_refused_combinations():
    from engine import ServerArgs

    with pytest.raises(InvalidServerArgsError):
        ServerArgs(enable_lora=True, max_loras_per_batch=0).verify()
