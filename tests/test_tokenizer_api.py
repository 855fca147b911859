"""/tokenize, /detokenize, /tokenizer_info, /version, /get_load and metrics-by-default against the
live server with the default model (SmolLM2-135M-Instruct), compared with the same Hugging Face
tokenizer in process, and driven by lm-evaluation-harness's own remote tokenizer
(`tokenizer_backend=remote`, which auto-detects these endpoints)."""

from __future__ import annotations

import json

import aiohttp
import pytest

from server.cli import parse_args
from server.native_api import VERSION
from server.router.__main__ import config_from
from server.router.__main__ import parse_args as router_args
from tests.server_helpers import shared_server, wait_clean

pytestmark = pytest.mark.timeout(300)
NAME = "smollm2"
# The key and arguments of tests/test_clients_*.py: one default-model server for all of them.
CLIENTS_SERVER_ARGS = ("--served-model-name", NAME, "--max-total-tokens", "8192")
TIMEOUT = aiohttp.ClientTimeout(total=120)
TEXTS = [
    "Hello world",
    "  leading spaces,\ttabs and\nnew lines  ",
    "unicode: café, ñ, 日本語, 🙂",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
]


@pytest.fixture
def server(request):
    return shared_server(request, "smollm2-clients", "smollm2-135m", *CLIENTS_SERVER_ARGS)


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


async def test_tokenize_matches_the_hf_tokenizer(server, default_tokenizer):
    tok = default_tokenizer
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(server.url + "/get_model_info") as r:
            ctx = (await r.json())["context_length"]
        for path in ("/tokenize", "/v1/tokenize"):  # vLLM's path and SGLang's
            for text in TEXTS:
                for special in (True, False):
                    status, out = await _post(s, server.url + path, {"prompt": text, "add_special_tokens": special})
                    assert status == 200, out
                    ids = tok.encode(text, add_special_tokens=special)
                    assert out == {"count": len(ids), "max_model_len": ctx, "tokens": ids}
        status, out = await _post(
            s, server.url + "/tokenize", {"model": NAME, "prompt": TEXTS[2], "return_token_strs": True}
        )
        assert status == 200 and out["token_strs"] == tok.convert_ids_to_tokens(tok.encode(TEXTS[2]))
        status, out = await _post(s, server.url + "/tokenize", {"prompt": TEXTS})  # SGLang's batch
        assert status == 200, out
        assert out["tokens"] == [tok.encode(t) for t in TEXTS] and out["count"] == [len(x) for x in out["tokens"]]
        status, out = await _post(s, server.url + "/tokenize", {"prompt": ""})
        assert (status, out["tokens"], out["count"]) == (200, [], 0)


async def test_chat_tokenize_is_what_chat_completions_prompts(server, default_tokenizer):
    tok = default_tokenizer
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        status, out = await _post(s, server.url + "/tokenize", {"messages": CHAT})
        assert status == 200, out
        assert out["tokens"] == list(
            tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        body = {"model": NAME, "messages": CHAT, "max_tokens": 1, "temperature": 0}
        status, done = await _post(s, server.url + "/v1/chat/completions", body)
        assert status == 200 and done["usage"]["prompt_tokens"] == out["count"]
        status, bare = await _post(s, server.url + "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
        text = tok.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
        assert status == 200 and bare["tokens"] == tok.encode(text, add_special_tokens=False)
        assert bare["count"] < out["count"]  # without the assistant header
        prefill = [*CHAT, {"role": "assistant", "content": "The answer"}]
        body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
        status, cont = await _post(s, server.url + "/tokenize", body)
        assert status == 200 and tok.decode(cont["tokens"]).endswith("The answer")
        await wait_clean(s, server.url)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, 49152]}, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"tokens": [[1], [2, 10**6]]}, "tokens[1][1]"),
        ("/detokenize", {"tokens": [1, [2]]}, "tokens"),
        ("/v1/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        status, out = await _post(s, server.url + path, body)
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param, out


async def test_detokenize_round_trips(server, default_tokenizer):
    tok = default_tokenizer
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for path in ("/detokenize", "/v1/detokenize"):
            for text in TEXTS:
                ids = tok.encode(text)
                status, out = await _post(s, server.url + path, {"tokens": ids})
                assert status == 200 and out == {"prompt": tok.decode(ids), "text": tok.decode(ids)}
                assert out["prompt"] == text  # this tokenizer loses nothing on these texts
        ids = tok.encode(TEXTS[3])
        status, out = await _post(s, server.url + "/detokenize", {"tokens": ids, "skip_special_tokens": True})
        assert status == 200 and out["prompt"] == tok.decode(ids, skip_special_tokens=True) != TEXTS[3]
        batch = [tok.encode(t) for t in TEXTS]
        status, out = await _post(s, server.url + "/detokenize", {"tokens": batch})
        assert status == 200 and out["prompt"] == TEXTS
        status, out = await _post(s, server.url + "/detokenize", {"tokens": []})
        assert status == 200 and out["prompt"] == ""


async def test_tokenizer_info_describes_the_tokenizer(server, default_tokenizer):
    tok = default_tokenizer
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(server.url + "/tokenizer_info") as r:
            assert r.status == 200
            info = await r.json()
        async with s.get(server.url + "/get_model_info") as r:
            model = await r.json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        assert (info[name], info[f"{name}_id"]) == (getattr(tok, name), getattr(tok, f"{name}_id")), name
    assert info["model_max_length"] == model["context_length"] and info["vocab_size"] == model["vocab_size"]
    added = {int(k): v["content"] for k, v in info["added_tokens_decoder"].items()}
    assert added == {k: v.content for k, v in tok.added_tokens_decoder.items()}
    assert info["added_tokens_decoder"][str(tok.eos_token_id)]["special"] is True


async def test_version_and_get_load(server, default_tokenizer):
    url = server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/version") as r:
            assert r.status == 200 and await r.json() == {"version": VERSION}
        await wait_clean(s, url)
        async with s.get(url + "/get_load") as r:
            idle = await r.json()
        assert idle == [
            {
                "dp_rank": 0,
                "num_reqs": 0,
                "num_waiting_reqs": 0,
                "num_tokens": 0,
                "max_total_num_tokens": 8192,
                "token_usage": 0.0,
            }
        ]
        prompt = "Count slowly from one to a thousand:"
        sp = {"max_new_tokens": 1024, "temperature": 0.0, "ignore_eos": True}
        # A long generation, read until its first tokens arrive: it is running while /get_load answers.
        async with s.post(url + "/generate", json={"text": prompt, "sampling_params": sp, "stream": True}) as gen:
            async for line in gen.content:
                if line.startswith(b"data: {") and json.loads(line[6:])["output_ids"]:
                    break
            async with s.get(url + "/get_load") as r:
                (busy,) = await r.json()
            gen.close()  # drops the connection: the server aborts the generation
        assert busy["num_reqs"] == 1 and busy["num_waiting_reqs"] == 0
        assert busy["num_tokens"] >= len(default_tokenizer.encode(prompt)) and busy["token_usage"] > 0
        await wait_clean(s, url)


async def test_metrics_are_on_by_default(server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(server.url + "/metrics") as r:
        assert r.status == 200 and "sglang:num_running_reqs" in await r.text()  # started without a flag
    assert parse_args([])[1].enable_metrics is True
    assert parse_args(["--enable-metrics"])[1].enable_metrics is True  # SGLang's flag: accepted, a no-op
    assert parse_args(["--disable-metrics"])[1].enable_metrics is False
    urls = ["--worker-urls", "http://127.0.0.1:1"]
    assert config_from(router_args(urls)).enable_metrics is True
    assert config_from(router_args([*urls, "--enable-metrics"])).enable_metrics is True
    assert config_from(router_args([*urls, "--disable-metrics"])).enable_metrics is False


def test_lm_eval_remote_tokenizer_matches_hf(server, default_tokenizer):
    """lm-eval picks its remote tokenizer by itself when the server offers the endpoints (it would
    otherwise try to load a Hugging Face tokenizer named after the model, impossible offline)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    tok = default_tokenizer
    base = server.url + "/v1/completions"
    assert check_remote_tokenizer_support(base)
    remote = RemoteTokenizer(base)
    for text in TEXTS:
        ids = remote.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False)
        assert remote.decode(ids) == tok.decode(ids)
    assert remote.batch_decode([tok.encode(t) for t in TEXTS]) == tok.batch_decode([tok.encode(t) for t in TEXTS])
    assert (remote.eos_token_id, remote.bos_token_id) == (tok.eos_token_id, tok.bos_token_id)
    assert remote.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    lm = LocalCompletionsAPI(base_url=base, model=NAME)
    assert lm.tokenizer_backend == "remote"
    assert lm.tok_encode(TEXTS[0]) == tok.encode(TEXTS[0], add_special_tokens=False)
    assert lm.decode_batch([tok.encode(TEXTS[2])]) == [TEXTS[2]]
    assert (lm.eot_token_id, lm.prefix_token_id) == (tok.eos_token_id, tok.bos_token_id)
