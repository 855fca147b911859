"""User-visible text on the default model: incremental detokenization, stop strings, EOS.

Stop strings are chosen from the model's own greedy output so that they straddle a token
boundary; multi-byte output (emoji, CJK) must never reach a client as broken UTF-8.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from engine import Engine, SamplingParams
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

TIMEOUT = 120
MULTIBYTE_TEXTS = [
    "Hello, world! Plain ASCII first.",
    "Emoji: 🍎🍌🍇 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done",
    "CJK: 你好，世界。日本語のテキスト。한국어 문장입니다.",
    "Mixed ünïcödé — “quotes” … and tabs\tand\nnewlines",
]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_detokenizer_deltas_are_whole_characters(default_tokenizer, text):
    tok = default_tokenizer
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == tok.decode(ids)
    # Byte-level BPE really splits these characters across tokens (else the test proves nothing).
    if any(ord(c) > 0x2000 for c in text):
        assert any(d == "" for d in deltas[:-1]), "no character was split across tokens"


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_stop_string_matcher_finds_stops_across_any_split(split):
    text = "The answer is 42. END of story. More text after."
    out, hit = [], None
    m = StopStringMatcher(["END", "story."])
    for i in range(0, len(text), split):
        emitted, hit = m.push(text[i : i + split])
        out.append(emitted)
        if hit is not None:
            break
    assert hit == "END" and "".join(out) == "The answer is 42. "


# One engine for the module's generation tests (a start costs ~9 s), on the module's event loop.
ON_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    async with Engine("smollm2-135m", dtype="float32", device="cpu", torch_threads=1, max_total_tokens=4096) as e:
        yield e


@ON_MODULE_LOOP
async def test_stop_string_across_token_boundary(engine, default_tokenizer):
    tok = default_tokenizer
    prompt = "Write a short story about a cat who learns to swim."
    params = dict(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    async with asyncio.timeout(TIMEOUT):
        full = await engine.generate(prompt, SamplingParams(**params))
    assert full.text == tok.decode(full.token_ids)
    # A stop string made of the end of token k and the start of token k+1.
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    k = next(
        i
        for i in range(5, len(pieces) - 1)
        if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2
    )
    boundary = len(pieces[k])
    stop = full.text[boundary - 2 : boundary + 2]
    index = full.text.find(stop)
    async with asyncio.timeout(TIMEOUT):
        cut = await engine.generate(prompt, SamplingParams(**params, stop=[stop]))
        streamed = [d async for d in engine.stream(prompt, SamplingParams(**params, stop=stop))]
    assert cut.finish_reason == "stop" and cut.matched_stop == stop
    assert cut.text == full.text[:index]
    assert stop not in cut.text
    assert "".join(d.text for d in streamed) == cut.text
    assert streamed[-1].finish_reason == "stop"
    # The request ended (and was freed) at the token that completed the stop string.
    assert cut.completion_tokens < len(full.token_ids)


@ON_MODULE_LOOP
async def test_multibyte_output_streams_without_broken_characters(engine, default_tokenizer):
    prompts = [
        "🍎🍌🍇🍓🍎🍌🍇🍓🍎🍌🍇",
        "中文：我喜欢吃苹果。我喜欢",
        [{"role": "user", "content": "Translate to Chinese: I love apples."}],
    ]
    for prompt in prompts:
        async with asyncio.timeout(TIMEOUT):
            deltas = [d async for d in engine.stream(prompt, SamplingParams(temperature=0.0, max_new_tokens=24))]
        ids = [t for d in deltas for t in d.token_ids]
        text = "".join(d.text for d in deltas)
        assert all("\ufffd" not in d.text for d in deltas)
        eos_ended = deltas[-1].finish_reason == "stop"
        assert text == default_tokenizer.decode(ids[:-1] if eos_ended else ids, skip_special_tokens=True)
        assert any(ord(c) > 0x2000 for c in text), f"no multi-byte output for {prompt!r}: {text!r}"


@ON_MODULE_LOOP
async def test_eos_stops_unless_ignored(engine, default_tokenizer):
    chat = [{"role": "user", "content": "Hi!"}]
    async with asyncio.timeout(TIMEOUT):
        natural = await engine.generate(chat, SamplingParams(temperature=0.0, max_new_tokens=64))
        forced = await engine.generate(chat, SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True))
    assert natural.finish_reason == "stop", natural
    assert natural.matched_stop == natural.token_ids[-1] == default_tokenizer.eos_token_id
    assert default_tokenizer.eos_token not in natural.text
    assert forced.finish_reason == "length" and forced.completion_tokens == 64
    assert forced.token_ids[: len(natural.token_ids)] == natural.token_ids
