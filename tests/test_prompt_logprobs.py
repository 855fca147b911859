"""Prompt log-probs (`logprob_start_len`), scored in the prefill forward: equal to transformers'
log_softmax on the same weights (fp32), the same with and without chunked prefill, with a radix
hit, under overlap and retraction-free reuse; scoring-only requests (`max_new_tokens=0`); and no
`[prompt_len, vocab]` logits for a long prompt (the LM head sees a bounded slice at a time)."""

from __future__ import annotations

import pytest
import torch

from engine import SyncScheduler
from engine.model_executor.model_runner import ModelRunner
from engine.model_executor.prompt_logprobs import SLICE_ROWS
from engine.sampling import SamplingParams
from engine.scheduler.output import BatchTokenOut
from engine.server_args import ServerArgs

TEXTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Once upon a time there was a lighthouse keeper who lived alone on an island. " * 3,
]
TOP_N = 3


class Collecting(SyncScheduler):
    """A SyncScheduler that keeps every step's output, by request id."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.prompt_lps: dict[str, object] = {}
        self.first_tokens: dict[str, int] = {}

    def process(self, lb, result) -> BatchTokenOut:
        msg = super().process(lb, result)
        for rid, tok, lp in zip(msg.rids, msg.token_ids, msg.input_logprobs):
            if lp is not None:
                assert rid not in self.prompt_lps, "prompt log-probs are sent once"
                self.prompt_lps[rid] = lp
            self.first_tokens.setdefault(rid, tok)
        return msg


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_logprobs(hf_default_model, prompts) -> list[torch.Tensor]:
    """transformers' fp32 log_softmax at every prompt position, one prompt at a time."""
    model = hf_default_model
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in prompts]


@pytest.fixture(scope="module")
def runner(default_source) -> ModelRunner:
    args = ServerArgs(dtype="float32", device="cpu", max_total_tokens=8192, max_running_requests=8)
    return ModelRunner(args, default_source)


def _sched(runner: ModelRunner, **overrides) -> Collecting:
    for k, v in overrides.items():
        setattr(runner.args, k, v)
    return Collecting(runner)


def _done(sched: Collecting) -> None:
    """Everything freed (KV free or in the tree), then the tree emptied: the runner's pools go
    to the next test's scheduler whole."""
    sched.scheduler.check_memory()
    assert sched.scheduler.flush_cache()
    alloc = sched.runner.token_to_kv_pool_allocator
    assert alloc.available_size() == alloc.size


def _check_against_hf(lp, prompt: list[int], ref: torch.Tensor, start: int, top_n: int) -> None:
    assert lp.ids == prompt[start:]
    assert lp.values[0] is None
    want = [float(ref[q - 1, prompt[q]]) for q in range(start + 1, len(prompt))]
    assert len(lp.values) == len(prompt) - start
    assert lp.values[1:] == pytest.approx(want, abs=1e-4)
    if top_n:
        assert lp.top is not None and lp.top[0] is None and len(lp.top) == len(lp.values)
        for q, row in zip(range(start + 1, len(prompt)), lp.top[1:]):
            ids = [t for t, _ in row]
            vals, hf_ids = ref[q - 1].topk(top_n)
            assert [v for _, v in row] == pytest.approx(vals.tolist(), abs=1e-4)
            # equal log-probs may order differently; the sets of a clear top-N agree
            assert set(ids) == set(hf_ids.tolist()) or min(vals[:-1] - vals[1:]) < 1e-4
    else:
        assert lp.top is None


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked16"])
def test_prompt_logprobs_equal_transformers(runner, prompts, hf_logprobs, chunk):
    sched = _sched(runner, chunked_prefill_size=chunk)
    starts = [0, 5, len(prompts[2]) - 1]
    reqs = [
        sched.add_request(
            p, SamplingParams(temperature=0.0, max_new_tokens=2), logprob_start_len=s, return_logprob=True
        )
        for p, s in zip(prompts, starts)
    ]
    top = sched.add_request(
        prompts[1], SamplingParams(temperature=0.0, max_new_tokens=2), top_logprobs_num=TOP_N, logprob_start_len=0
    )
    sched.run_until_idle()
    for req, p, ref, s in zip(reqs, prompts, hf_logprobs, starts):
        _check_against_hf(sched.prompt_lps[req.rid], p, ref, s, 0)
        assert req.output_ids[0] == int(ref[-1].argmax())  # generation is unaffected
    _check_against_hf(sched.prompt_lps[top.rid], prompts[1], hf_logprobs[1], 0, TOP_N)
    _done(sched)


def test_radix_hit_recomputes_the_scored_span(runner, prompts, hf_logprobs):
    """A prompt whose prefix is cached still gets its log-probs: the match stops at
    `logprob_start_len`, and only the span after it is recomputed."""
    sched = _sched(runner, chunked_prefill_size=2048)
    p, ref = prompts[2], hf_logprobs[2]
    sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=1))
    sched.run_until_idle()  # the whole prompt is in the tree now
    again = sched.add_request(
        p, SamplingParams(temperature=0.0, max_new_tokens=1), logprob_start_len=10, return_logprob=True
    )
    plain = sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=1))
    sched.run_until_idle()
    assert again.cached_tokens <= 10  # the scored span was computed, not reused
    assert plain.cached_tokens == len(p) - 1  # requests without prompt log-probs reuse it all
    _check_against_hf(sched.prompt_lps[again.rid], p, ref, 10, 0)
    _done(sched)


def test_overlap_and_scoring_only(runner, prompts, hf_logprobs):
    """Under the overlap order, and with max_new_tokens=0 (score the prompt, generate nothing)."""
    sched = _sched(runner, chunked_prefill_size=8)
    score = sched.add_request(prompts[0], SamplingParams(max_new_tokens=0), logprob_start_len=0, return_logprob=True)
    gen = sched.add_request(
        prompts[1], SamplingParams(temperature=0.0, max_new_tokens=4), logprob_start_len=2, return_logprob=True
    )
    sched.run_until_idle(overlap=True)
    assert score.output_ids == [] and score.finished_reason.reason.value == "length"
    assert sched.first_tokens[score.rid] == -1
    _check_against_hf(sched.prompt_lps[score.rid], prompts[0], hf_logprobs[0], 0, 0)
    _check_against_hf(sched.prompt_lps[gen.rid], prompts[1], hf_logprobs[1], 2, 0)
    assert len(gen.output_ids) == 4
    _done(sched)


def test_long_prompt_never_holds_prompt_by_vocab_logits(runner, default_tokenizer):
    """A prompt of several slices (two full, one partial) scored whole (no chunking): the LM head
    never sees more than SLICE_ROWS rows at once, so no [prompt_len, vocab] logits tensor exists.
    Longer prompts only add slices of the same kind (and quadratic attention time)."""
    sched = _sched(runner, chunked_prefill_size=None)
    ids = (default_tokenizer.encode(TEXTS[2]) * 200)[: 2 * SLICE_ROWS + SLICE_ROWS // 2]
    model = runner.model
    seen: list[int] = []
    real = model.compute_logits

    def spy(hidden):
        seen.append(hidden.shape[0])
        return real(hidden)

    model.compute_logits = spy
    try:
        req = sched.add_request(ids, SamplingParams(max_new_tokens=0), logprob_start_len=0, return_logprob=True)
        sched.run_until_idle()
    finally:
        del model.compute_logits
    lp = sched.prompt_lps[req.rid]
    assert len(lp.values) == len(ids) and all(v is not None and v <= 0 for v in lp.values[1:])
    assert sum(seen) == (len(ids) - 1) + 1  # every scored row once, plus the sampling row
    assert max(seen) <= SLICE_ROWS
    assert seen.count(SLICE_ROWS) >= 2  # the prompt really was cut into slices
    _done(sched)
