"""The serving benchmarks people point at an engine, replayed against the live server.

vLLM (`vllm bench serve`) and SGLang (`python -m sglang.bench_serving`) are far too large to
install for a test, so their request functions are replayed here as data and behaviour: the
exact JSON bodies they post and the way they parse the SSE replies, written out from their
sources as released on PyPI (vLLM 0.33.0 `vllm/benchmarks/lib/endpoint_request_func.py`, run as
`vllm bench serve --temperature 0 --ignore-eos`, which merges its sampling parameters into the
body; SGLang 0.5.23 `sglang/benchmark/serving.py`, which `python -m sglang.bench_serving` now
re-exports, greedy with ignore_eos by default). A benchmark that counts a request as failed, reads a wrong
token count or a different text reports numbers that are silently wrong, so each backend sends
8 concurrent requests with `ignore_eos` and per-request output lengths, and the test asserts
zero failures, the client's token count equal to the server's (`usage` / `meta_info`) and to the
requested length, and the streamed text equal to the same request's non-streamed greedy text.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import random
from dataclasses import dataclass, field

import aiohttp
import pytest

from tests.server_helpers import shared_server, wait_clean

pytestmark = pytest.mark.timeout(300)
NAME = "smollm2"
# The same key and arguments in tests/test_clients_*.py: one server for all three modules.
CLIENTS_SERVER_ARGS = ("--served-model-name", NAME, "--max-total-tokens", "8192")
N_REQUESTS = 8
TIMEOUT = aiohttp.ClientTimeout(total=240)
WORDS = [
    "river",
    "mountain",
    "quiet",
    "engine",
    "lantern",
    "market",
    "orange",
    "whisper",
    "copper",
    "garden",
    "silver",
    "thunder",
    "harbor",
    "pencil",
    "meadow",
    "violin",
    "canyon",
    "ribbon",
    "glacier",
    "compass",
    "velvet",
    "orchard",
    "falcon",
    "candle",
]


@pytest.fixture
def server(request):
    return shared_server(request, "smollm2-clients", "smollm2-135m", *CLIENTS_SERVER_ARGS)


@dataclass
class Workload:
    prompts: list[str]
    output_lens: list[int]


@pytest.fixture(scope="module")
def workload() -> Workload:
    """Seeded prompts of different lengths and different output lengths (as the random datasets)."""
    rng = random.Random(1234)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 30))) for _ in range(N_REQUESTS)]
    return Workload(prompts, [6 + i % 5 for i in range(N_REQUESTS)])


@dataclass
class Output:
    """What both benchmarks record per request (their RequestFuncOutput), less the timings."""

    generated_text: str = ""
    success: bool = False
    output_tokens: int = 0
    prompt_len: int = 0
    error: str = ""
    chunks: int = 0  # events that advanced the text (vLLM: TTFT + ITL entries)
    events: list[dict] = field(default_factory=list)  # every parsed JSON event, for the checks


# ---- vLLM --------------------------------------------------------------------------------------


class VllmSseMessages:
    """vLLM's StreamedResponseHandler: the bytes of each read in, complete SSE messages out.
    Messages split on blank lines; a trailing `data: ` message counts as complete once it is
    `[DONE]` or parses as JSON."""

    def __init__(self) -> None:
        self.buffer = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, data: bytes) -> list[str]:
        self.buffer += self.decoder.decode(data)
        out = []
        while "\n\n" in self.buffer:
            msg, self.buffer = self.buffer.split("\n\n", 1)
            if msg.strip():
                out.append(msg.strip())
        if self.buffer.startswith("data: "):
            rest = self.buffer.removeprefix("data: ").strip()
            complete = rest == "[DONE]"
            if not complete and rest:
                try:
                    json.loads(rest)
                    complete = True
                except json.JSONDecodeError:
                    pass
            if complete:
                out.append(self.buffer.strip())
                self.buffer = ""
        return out


async def vllm_request(session: aiohttp.ClientSession, url: str, payload: dict, chat: bool, prompt_len: int) -> Output:
    """vLLM's openai / openai-chat request functions: iter_any() reads (empty ones skipped) through
    the message handler; `:` comments skipped; a chunk with choices adds its text (completions:
    `choices[0].text`, chat: `choices[0].delta.content`), else its `usage` gives the output token
    count and prompt length. Success needs at least one chunk with choices."""
    out = Output(prompt_len=prompt_len)
    headers = {"Content-Type": "application/json"} if chat else {}
    headers["x-request-id"] = f"bench-0a1b2c3d-{payload['_index']}"  # --request-id-prefix's default shape
    body = {k: v for k, v in payload.items() if k != "_index"}
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                out.error = resp.reason or ""
                return out
            handler = VllmSseMessages()
            async for raw in resp.content.iter_any():
                if not raw:
                    continue
                for message in handler.feed(raw):
                    if message.startswith(":"):
                        continue
                    chunk = message.removeprefix("data: ")
                    if chunk == "[DONE]":
                        continue
                    data = json.loads(chunk)
                    out.events.append(data)
                    if choices := data.get("choices"):
                        text = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                        out.chunks += 1
                        out.generated_text += text or ""
                    elif usage := data.get("usage"):
                        out.output_tokens = usage.get("completion_tokens")
                        if (pt := usage.get("prompt_tokens")) is not None:
                            out.prompt_len = pt
            out.success = out.chunks > 0
            if not out.success:
                out.error = "Never received a valid chunk to calculate TTFT."
    except Exception as e:  # the benchmark records the failure and goes on
        out.error = repr(e)
    return out


def vllm_completions_payload(prompt: str, output_len: int, index: int) -> dict:
    """`vllm bench serve --backend openai --ignore-eos --temperature 0`: the request function's
    body, with the sampling parameters merged in as its extra body."""
    return {
        "model": NAME,
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": output_len,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
        "_index": index,
    }


def vllm_chat_payload(prompt: str, output_len: int, index: int) -> dict:
    """`vllm bench serve --backend openai-chat --ignore-eos --temperature 0`: the content is a
    list of text parts."""
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "max_completion_tokens": output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
        "_index": index,
    }


def _assert_clean_run(outs: list[Output], output_lens: list[int]) -> None:
    failures = [(i, o.error) for i, o in enumerate(outs) if not o.success]
    assert failures == []
    assert [o.output_tokens for o in outs] == output_lens


async def test_vllm_openai_completions_backend(server, workload, default_tokenizer):
    url = server.url + "/v1/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        payloads = [
            vllm_completions_payload(p, n, i) for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))
        ]
        prompt_lens = [len(default_tokenizer.encode(p)) for p in workload.prompts]
        outs = await asyncio.gather(
            *(vllm_request(s, url, body, False, 0) for body in payloads),
        )
        _assert_clean_run(outs, workload.output_lens)
        # the prompt length the benchmark reports comes from usage: the tokenizer's count
        assert [o.prompt_len for o in outs] == prompt_lens
        for o, n in zip(outs, workload.output_lens):
            usage = o.events[-1]["usage"]
            assert o.events[-1]["choices"] == [] and usage["total_tokens"] == usage["prompt_tokens"] + n
            assert [e["choices"][0]["finish_reason"] for e in o.events if e["choices"]][-1] == "length"
        # the same requests, not streamed: the same greedy text, the same counts
        refs = await asyncio.gather(*(_post(s, url, {**_unstreamed(b), "_index": None}) for b in payloads))
        assert [r["choices"][0]["text"] for r in refs] == [o.generated_text for o in outs]
        assert [r["usage"]["completion_tokens"] for r in refs] == workload.output_lens
        assert all(o.generated_text for o in outs)
        await wait_clean(s, server.url)


async def test_vllm_openai_chat_backend(server, workload):
    url = server.url + "/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        payloads = [vllm_chat_payload(p, n, i) for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))]
        outs = await asyncio.gather(*(vllm_request(s, url, body, True, 0) for body in payloads))
        _assert_clean_run(outs, workload.output_lens)
        assert all(o.prompt_len > 0 for o in outs)
        refs = await asyncio.gather(*(_post(s, url, {**_unstreamed(b), "_index": None}) for b in payloads))
        assert [r["choices"][0]["message"]["content"] for r in refs] == [o.generated_text for o in outs]
        assert [r["usage"]["completion_tokens"] for r in refs] == workload.output_lens
        assert [r["usage"]["prompt_tokens"] for r in refs] == [o.prompt_len for o in outs]
        await wait_clean(s, server.url)


def test_vllm_message_handler_reassembles_split_and_joined_reads():
    """The handler replica itself: a JSON event split across reads waits for its end; two events
    in one read come out as two messages; [DONE] completes on its own."""
    h = VllmSseMessages()
    assert h.feed(b'data: {"a": ') == []
    assert h.feed(b"1}") == ['data: {"a": 1}']
    assert h.feed(b'data: {"b": 2}\n\ndata: {"c": 3}') == ['data: {"b": 2}', 'data: {"c": 3}']
    assert h.feed(b"data: [DONE]") == ["data: [DONE]"]
    assert h.buffer == ""


# ---- SGLang ------------------------------------------------------------------------------------


async def sglang_request(session: aiohttp.ClientSession, url: str, payload: dict, prompt_len: int) -> Output:
    """bench_serving's line-based parsing: each line stripped, `data: ` removed, [DONE] skipped;
    any event's `usage` or else `meta_info` with a non-zero `prompt_tokens` replaces the dataset's
    prompt length. sglang (/generate): an event with non-empty (cumulative) `text` replaces the
    text and gives `meta_info.completion_tokens`. sglang-oai (/v1/completions): a non-empty
    `choices[0].text` is appended, and `usage.completion_tokens` (if any) replaces the count,
    which otherwise stays the requested length. sglang-oai-chat: any event's usage gives the count;
    events without choices are skipped; the delta's reasoning then content text is appended."""
    out = Output(prompt_len=prompt_len)
    generate, chat = "sampling_params" in payload, "messages" in payload
    if generate:
        out.output_tokens = payload["sampling_params"]["max_new_tokens"]
    else:
        out.output_tokens = payload["max_completion_tokens" if chat else "max_tokens"]
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                out.error = resp.reason or ""
                return out
            async for raw in resp.content:
                raw = raw.strip()
                if not raw:
                    continue
                chunk = raw.decode("utf-8")
                chunk = chunk[len("data: ") :] if chunk.startswith("data: ") else chunk
                if chunk == "[DONE]":
                    continue
                data = json.loads(chunk)
                out.events.append(data)
                reported = data.get("usage") or data.get("meta_info") or {}
                if reported.get("prompt_tokens"):
                    out.prompt_len = reported["prompt_tokens"]
                if chat:
                    out.output_tokens = (data.get("usage") or {}).get("completion_tokens", out.output_tokens)
                    if not (choices := data.get("choices") or []):
                        continue
                    delta = choices[0].get("delta") or {}
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    if text := reasoning + (delta.get("content") or ""):
                        out.generated_text += text
                        out.chunks += 1
                elif generate:
                    if data.get("text"):
                        out.generated_text = data["text"]
                        out.output_tokens = data["meta_info"]["completion_tokens"]
                        out.chunks += 1
                elif text := data["choices"][0]["text"]:
                    out.generated_text += text
                    out.output_tokens = (data.get("usage") or {}).get("completion_tokens", out.output_tokens)
                    out.chunks += 1
            out.success = True
    except Exception as e:
        out.error = repr(e)
    return out


def sglang_generate_payload(prompt: str | list[int], output_len: int) -> dict:
    """`bench_serving --backend sglang` with its defaults (temperature 0.0, ignore_eos, no
    logprobs, no LoRA); a token id list (`--tokenize-prompt`) goes as `input_ids`."""
    return {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }


async def _sglang_generate_run(server, prompts: list, output_lens: list[int], prompt_lens: list[int]) -> None:
    url = server.url + "/generate"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        payloads = [sglang_generate_payload(p, n) for p, n in zip(prompts, output_lens)]
        outs = await asyncio.gather(*(sglang_request(s, url, b, 0) for b in payloads))
        _assert_clean_run(outs, output_lens)
        assert [o.prompt_len for o in outs] == prompt_lens
        for o, n in zip(outs, output_lens):
            last = o.events[-1]["meta_info"]
            assert last["finish_reason"] == {"type": "length", "length": n}
            assert last["completion_tokens"] == len(o.events[-1]["output_ids"]) == n
        # the same requests, not streamed
        refs = await asyncio.gather(*(_post(s, url, {**b, "stream": False}) for b in payloads))
        assert [r["text"] for r in refs] == [o.generated_text for o in outs]
        assert [r["meta_info"]["completion_tokens"] for r in refs] == output_lens
        assert all(o.generated_text for o in outs)
        await wait_clean(s, server.url)


async def test_sglang_generate_backend_text(server, workload, default_tokenizer):
    prompt_lens = [len(default_tokenizer.encode(p)) for p in workload.prompts]
    await _sglang_generate_run(server, workload.prompts, workload.output_lens, prompt_lens)


async def test_sglang_generate_backend_token_ids(server, workload, default_tokenizer):
    ids = [default_tokenizer.encode(p) for p in workload.prompts]
    await _sglang_generate_run(server, ids, workload.output_lens, [len(x) for x in ids])


async def test_sglang_oai_completions_backend(server, workload):
    """`bench_serving --backend sglang-oai` (also its `vllm` backend): /v1/completions with best_of
    1 and no stream_options. No usage arrives in the stream, so the client keeps the requested
    length as the output count; the non-streamed replies' usage is what checks it."""
    url = server.url + "/v1/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        payloads = [
            {
                "model": NAME,
                "prompt": p,
                "best_of": 1,
                "max_tokens": n,
                "stream": True,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            for p, n in zip(workload.prompts, workload.output_lens)
        ]
        outs = await asyncio.gather(*(sglang_request(s, url, b, -1) for b in payloads))
        _assert_clean_run(outs, workload.output_lens)
        assert [o.prompt_len for o in outs] == [-1] * N_REQUESTS  # nothing reported it
        # without stream_options no usage chunk comes (it would have empty choices, which this
        # client indexes), so every event has a choice
        assert all(e["choices"] and e["usage"] is None for o in outs for e in o.events)
        refs = await asyncio.gather(*(_post(s, url, {**b, "stream": False}) for b in payloads))
        assert [r["choices"][0]["text"] for r in refs] == [o.generated_text for o in outs]
        assert [r["usage"]["completion_tokens"] for r in refs] == workload.output_lens
        await wait_clean(s, server.url)


async def test_sglang_oai_chat_backend_with_usage(server, workload):
    """`bench_serving --backend sglang-oai-chat --extra-request-body
    '{"stream_options": {"include_usage": true}}'`: the final usage chunk (no choices) gives the
    output and prompt token counts."""
    url = server.url + "/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        payloads = [
            {
                "model": NAME,
                "messages": [{"role": "user", "content": p}],
                "max_completion_tokens": n,
                "stream": True,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            for p, n in zip(workload.prompts, workload.output_lens)
        ]
        outs = await asyncio.gather(*(sglang_request(s, url, b, -1) for b in payloads))
        assert [(i, o.error) for i, o in enumerate(outs) if not o.success] == []
        usages = [o.events[-1]["usage"] for o in outs]  # the last event: usage, no choices
        assert all(o.events[-1]["choices"] == [] for o in outs)
        assert [u["completion_tokens"] for u in usages] == [o.output_tokens for o in outs] == workload.output_lens
        assert [u["prompt_tokens"] for u in usages] == [o.prompt_len for o in outs]
        assert all(o.prompt_len > 0 for o in outs)
        refs = await asyncio.gather(*(_post(s, url, _unstreamed(b)) for b in payloads))
        assert [r["choices"][0]["message"]["content"] for r in refs] == [o.generated_text for o in outs]
        assert [r["usage"]["completion_tokens"] for r in refs] == workload.output_lens
        await wait_clean(s, server.url)


# ---- helpers -----------------------------------------------------------------------------------


def _unstreamed(payload: dict) -> dict:
    return {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    body = {k: v for k, v in body.items() if k != "_index"}
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()
