"""lm-evaluation-harness (`lm-eval[api]`) against the live server: its `local-completions` model
scores multiple-choice answers and perplexity from `echo` + `logprobs` over the prompt, so these
must equal transformers' own log-probabilities on the same weights (fp32), with its Hugging Face
tokenizer and with its remote one (the server's /tokenize, /detokenize, /tokenizer_info);
`generate_until` must stop at its stop strings."""

from __future__ import annotations

import pytest
import torch

from tests.server_helpers import shared_server

pytestmark = pytest.mark.timeout(600)
NAME = "smollm2"
CLIENTS_SERVER_ARGS = ("--served-model-name", NAME, "--max-total-tokens", "8192")
PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " a small village in the mountains"),
    ("Question: What is two plus two?\nAnswer:", " four"),
    ("def add(a, b):\n    return", " a + b"),
]
ROLLING = ["The quick brown fox jumps over the lazy dog. It was a sunny day in the park."]


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request, "smollm2-clients", "smollm2-135m", *CLIENTS_SERVER_ARGS)


@pytest.fixture(scope="module")
def hf_model(hf_default_model):
    return hf_default_model


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, default_tokenizer) -> str:
    """The default model's tokenizer as a folder, for lm-eval's Hugging Face tokenizer backend."""
    out = tmp_path_factory.mktemp("lm-eval-tokenizer")
    default_tokenizer.save_pretrained(out)
    return str(out)


def _lm(server, backend: str, tokenizer_dir: str):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    kwargs = {"tokenizer": tokenizer_dir} if backend == "huggingface" else {}
    return LocalCompletionsAPI(
        base_url=server.url + "/v1/completions",
        model=NAME,
        tokenizer_backend=backend,
        max_retries=1,
        timeout=300,
        **kwargs,
    )


def _instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _hf_score(hf_model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """transformers' log-probability of `cont` after `ctx`, and whether each of its tokens is
    the argmax (lm-eval's is_greedy)."""
    ids = ctx + cont
    with torch.no_grad():
        lps = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    rows = lps[len(ctx) - 1 : len(ids) - 1]
    target = torch.tensor(cont)
    total = float(rows.gather(1, target[:, None]).sum())
    greedy = bool((rows.argmax(-1) == target).all())
    return total, greedy


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_loglikelihood_equals_transformers(server, hf_model, tokenizer_dir, backend):
    lm = _lm(server, backend, tokenizer_dir)
    got = lm.loglikelihood(_instances("loglikelihood", PAIRS))
    assert len(got) == len(PAIRS)
    greedy_seen = set()
    for (ctx, cont), (ll, greedy) in zip(PAIRS, got):
        whole = lm.tok_encode(ctx + cont)  # lm-eval's own split of the pair (trailing spaces move)
        ctx_ids = lm.tok_encode(ctx)
        want, want_greedy = _hf_score(hf_model, ctx_ids, whole[len(ctx_ids) :])
        assert ll == pytest.approx(want, abs=1e-3), (ctx, cont)
        assert ll < 0  # a silent (0, True) is what the bug looked like
        assert greedy == want_greedy, (ctx, cont)
        greedy_seen.add(greedy)
    assert greedy_seen == {True, False}  # the pairs exercise both answers of is_greedy


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_loglikelihood_rolling_equals_transformers(server, hf_model, tokenizer_dir, backend):
    lm = _lm(server, backend, tokenizer_dir)
    got = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in ROLLING]))
    for text, ll in zip(ROLLING, got):
        ids = lm.tok_encode(text)
        want, _ = _hf_score(hf_model, [lm.prefix_token_id], ids)  # one window, after the prefix token
        assert ll == pytest.approx(want, abs=1e-3)


def test_generate_until_honours_stop_strings(server, tokenizer_dir):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "Here is a list of fruits: apple, banana,"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    words = [w for w in full.replace(",", " ").split() if len(w) > 2]
    assert len(words) >= 2, full
    stop = words[1]  # cut in the middle of the greedy answer
    lm = _lm(server, "huggingface", tokenizer_dir)
    (out,) = lm.generate_until(_instances("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 24})]))
    assert stop not in out
    assert out == full.split(stop)[0]
