"""`logit_bias` (OpenAI's semantics) end to end: validation, the sampler, the in-process engine
(tiny random Llama with the real tokenizer) and the real server with the real `openai` client.

The bias is added to the logits before penalties, temperature and top-k/top-p/min-p; log-probs
stay the model's raw ones (see `Sampler`). Requests without a bias must be untouched: same tokens
alone or next to biased neighbours, with overlap scheduling on or off.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import msgspec
import openai
import pytest
import torch

from engine import Engine, SamplingParams
from engine.errors import InvalidRequestError
from engine.sampling import MAX_LOGIT_BIAS_ENTRIES, Sampler, SamplingBatchInfo, apply_penalties
from tests.sched_harness import build_tiny_folder
from tests.server_helpers import tiny_model_dir, tiny_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(300)
VOCAB = 49152  # the SmolLM2 tokenizer's, the tiny model's logits width
TIMEOUT = 120
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _info(params: list[SamplingParams], vocab: int, device: str = "cpu", **kw) -> SamplingBatchInfo:
    n = len(params)
    seeds = [p.seed if p.seed is not None else 0 for p in params]
    kw.setdefault("output_ids", None)
    kw.setdefault("input_ids", None)
    return SamplingBatchInfo.from_requests(params, seeds, [0] * n, vocab_size=vocab, device=device, **kw)


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bias",
    [
        {"5": 1.0},  # a string key from an in-process caller: ids are ints here
        {True: 1.0},
        {-1: 1.0},
        {VOCAB: 1.0},
        {5: 100.5},
        {5: -101},
        {5: float("nan")},
        {5: float("inf")},
        {5: "1"},
        [5, 1.0],
        dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 1.0),
    ],
)
def test_verify_rejects_bad_logit_bias(bias) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias=bias).verify(VOCAB)
    assert e.value.param == "logit_bias"


def test_verify_accepts_bounds_and_json_keys_decode_to_ints() -> None:
    ok = {0: -100, VOCAB - 1: 100.0, **dict.fromkeys(range(1, MAX_LOGIT_BIAS_ENTRIES - 1), 0.5)}
    SamplingParams(logit_bias=ok).verify(VOCAB)
    sp = msgspec.json.decode(b'{"logit_bias": {"123": 2, "7": -1.5}}', type=SamplingParams)
    assert sp.logit_bias == {123: 2.0, 7: -1.5} and not sp.has_penalties()  # never forces a sync step
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"logit_bias": {"abc": 2}}', type=SamplingParams)
    with pytest.raises(msgspec.ValidationError):  # still strict about unknown fields
        msgspec.json.decode(b'{"logit_bias_typo": {}}', type=SamplingParams)


# ---- the sampler ------------------------------------------------------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_bias_moves_greedy_and_leaves_other_rows_alone(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen).to(device)
    plain = SamplingParams(temperature=0.0)
    params = [plain, SamplingParams(temperature=0.0, logit_bias={17: 100.0}), plain]
    params += [SamplingParams(temperature=0.0, logit_bias={int(logits[3].argmax()): -100.0}), plain, plain]
    out = Sampler()(logits, _info(params, 300, device)).next_token_ids.cpu()
    argmax = logits.argmax(dim=-1).cpu()
    assert out[1] == 17
    assert out[3] != argmax[3] and out[3] == logits[3].topk(2).indices[1].cpu()
    for row in (0, 2, 4, 5):
        assert out[row] == argmax[row]


def test_bias_comes_before_penalties_and_logprobs_stay_raw() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 50, generator=gen)
    bias = {3: 2.5, 9: -4.0}
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.5, logit_bias=bias),
        SamplingParams(temperature=0.0),
    ]
    info = _info(params, 50, output_ids=[[3, 3, 9, 11], []], input_ids=[[9, 4], []], return_logprob=[True, True])
    biased = logits.clone()
    for token, value in bias.items():
        biased[0, token] += value
    expected = apply_penalties(biased, info).argmax(dim=-1)
    out = Sampler()(logits, info)
    assert torch.equal(out.next_token_ids, expected)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(out.logprobs, raw.gather(1, expected[:, None]).squeeze(1))


def test_sampled_rows_never_draw_a_banned_token_and_ids_out_of_range_are_dropped() -> None:
    logits = torch.zeros(64, 20)
    logits[:, 4] = 3.0  # the favourite by far
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias={4: -100.0}) for s in range(64)]
    unbiased = [SamplingParams(temperature=1.0, seed=s) for s in range(64)]
    drawn = Counter()
    for step in range(8):
        info = SamplingBatchInfo.from_requests(params, list(range(64)), [step] * 64, None, None, 20, "cpu")
        drawn.update(Sampler()(logits, info).next_token_ids.tolist())
    assert drawn[4] == 0 and len(drawn) > 10
    info = SamplingBatchInfo.from_requests(unbiased, list(range(64)), [0] * 64, None, None, 20, "cpu")
    assert Counter(Sampler()(logits, info).next_token_ids.tolist())[4] > 10
    # an unverified id past the vocabulary must not spill into the next row
    info = _info([SamplingParams(temperature=0.0, logit_bias={20: 100.0})] * 2, 20)
    assert info.logit_bias_index is None


# ---- the in-process engine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tok_folder(tmp_path_factory, default_tokenizer) -> str:
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-logit-bias"), default_tokenizer)


def _engine(folder: str, **kw) -> Engine:
    opts = dict(dtype="float32", device="cpu", torch_threads=1, max_total_tokens=8192, max_running_requests=32)
    return Engine(folder, **{**opts, **kw})


def _greedy(n: int, bias: dict[int, float] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, logit_bias=bias)


async def test_engine_force_ban_and_mixed_batches(tiny_tok_folder, default_tokenizer) -> None:
    forced = default_tokenizer.encode(" Paris")[0]
    prompts = [f"Story {i}: once upon a time" for i in range(6)]
    async with _engine(tiny_tok_folder, enable_overlap=False) as engine, asyncio.timeout(TIMEOUT):
        alone = [(await engine.generate(p, _greedy(10))).token_ids for p in prompts]
        out = await engine.generate(PROMPT, _greedy(8, {forced: 100.0}))
        assert out.token_ids == [forced] * 8
        banned = alone[0][0]
        out = await engine.generate(prompts[0], _greedy(10, {banned: -100.0}))
        assert out.token_ids != alone[0] and banned not in out.token_ids
        with pytest.raises(InvalidRequestError) as e:
            await engine.generate(PROMPT, _greedy(4, {VOCAB: 1.0}))
        assert e.value.param == "logit_bias"
    for overlap in (False, True):
        async with _engine(tiny_tok_folder, enable_overlap=overlap) as engine, asyncio.timeout(TIMEOUT):
            jobs = [engine.generate(p, _greedy(10)) for p in prompts]
            jobs += [engine.generate(p, _greedy(10, {forced: 100.0, banned: -50.0})) for p in prompts[:3]]
            outs = await asyncio.gather(*jobs)
        assert [o.token_ids for o in outs[:6]] == alone, overlap
        assert all(o.token_ids == [forced] * 10 for o in outs[6:])


async def test_engine_sampled_never_draws_a_banned_token(tiny_tok_folder) -> None:
    """Each request bans every token its unbiased sample (same seed) drew: at temperature 1 its
    first draw must change (the race is the same but for the banned tokens) and none may appear."""
    prompts = [f"Sample {i} begins with" for i in range(8)]

    def params(seed: int, bias: dict[int, float] | None) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed, ignore_eos=True, logit_bias=bias)

    async with _engine(tiny_tok_folder) as engine, asyncio.timeout(TIMEOUT):
        free = await asyncio.gather(*(engine.generate(p, params(i, None)) for i, p in enumerate(prompts)))
        bans = [dict.fromkeys(o.token_ids, -100.0) for o in free]
        banned = await asyncio.gather(*(engine.generate(p, params(i, bans[i])) for i, p in enumerate(prompts)))
    for f, b, ban in zip(free, banned, bans):
        assert b.token_ids[0] != f.token_ids[0] and not set(b.token_ids) & set(ban)


# ---- the server -------------------------------------------------------------------------------


@pytest.fixture
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


async def _native(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
        async with s.post(url + "/generate", json=body) as r:
            return r.status, await r.json()


def test_openai_client_force_and_ban(client, tiny_server, default_tokenizer) -> None:
    model = client.models.list().data[0].id
    forced = default_tokenizer.encode(" Paris")[0]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={forced: 100})
    assert r.choices[0].text == default_tokenizer.decode([forced] * 6)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a city."}],
        max_tokens=5,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert chat.choices[0].message.content == default_tokenizer.decode([forced] * 5)
    greedy = {**GREEDY, "max_new_tokens": 8}
    _, base = asyncio.run(_native(tiny_server.url, {"text": PROMPT, "sampling_params": greedy}))
    banned = base["output_ids"][0]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={banned: -100})
    assert r.choices[0].text != base["text"]
    sp = {**greedy, "logit_bias": {str(banned): -100}}
    status, out = asyncio.run(_native(tiny_server.url, {"text": PROMPT, "sampling_params": sp}))
    assert status == 200 and banned not in out["output_ids"] and r.choices[0].text == out["text"]
    sampled = {"max_new_tokens": 12, "n": 4, "seed": 3, "temperature": 1.0, "ignore_eos": True}
    _, free = asyncio.run(_native(tiny_server.url, {"text": PROMPT, "sampling_params": sampled}))
    drawn = {t for o in free for t in o["output_ids"]}  # every token the 4 seeded samples drew
    sp = {**sampled, "logit_bias": {str(t): -100 for t in drawn}}
    status, outs = asyncio.run(_native(tiny_server.url, {"text": PROMPT, "sampling_params": sp}))
    assert status == 200 and all(not set(o["output_ids"]) & drawn for o in outs)


@pytest.mark.parametrize(
    "bias", [{"abc": 1}, {" 5": 1}, {"05": 1}, {"-1": 1}, {str(VOCAB): 1}, {"5": 101}, {"5": -100.01}, {"5": "x"}]
)
def test_openai_bad_logit_bias_is_a_400(client, bias) -> None:
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logit_bias=bias
        )
    assert e.value.body["param"] == "logit_bias", e.value.body


def test_too_many_entries_and_native_bad_keys_are_400s(client, tiny_server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        many = {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}
        client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=2, logit_bias=many)
    assert e.value.body["param"] == "logit_bias"
    for bias, param in (({"abc": 1}, "sampling_params.logit_bias"), ({"5": 300}, "logit_bias")):
        status, out = asyncio.run(_native(tiny_server.url, {"text": PROMPT, "sampling_params": {"logit_bias": bias}}))
        assert status == 400 and out["error"]["param"] == param, out


async def test_websocket_generation_takes_logit_bias(tiny_server, default_tokenizer) -> None:
    forced = default_tokenizer.encode(" Paris")[0]
    sp = {**GREEDY, "max_new_tokens": 5, "logit_bias": {str(forced): 100}}
    ids: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
        async with s.ws_connect(tiny_server.url + "/ws") as ws:
            await ws.send_json({"type": "generate", "id": "a", "text": PROMPT, "sampling_params": sp})
            while True:
                msg = await ws.receive_json()
                assert msg["type"] == "delta", msg
                ids += msg["token_ids"]
                if msg.get("finish_reason") is not None:
                    break
    assert ids == [forced] * 5
