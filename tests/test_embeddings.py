"""Embeddings: a prompt's final hidden states (after the model's last norm) pooled by last token,
mean or first token and L2-normalised, equal to transformers' `last_hidden_state` pooled the same
way (fp32, cosine >= 0.99999); the same with chunked prefill, batched with generations, and with
a radix hit for last-token pooling; the in-process `Engine.encode`."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, InvalidRequestError, SamplingParams, SyncScheduler
from engine.model_executor.model_runner import ModelRunner
from engine.scheduler.output import BatchTokenOut
from engine.server_args import ServerArgs

TEXTS = [
    "Embeddings map text to vectors.",
    "The lighthouse keeper climbed the spiral staircase every evening and lit the great lamp.",
    "def add(a, b):\n    return a + b\n" * 3,
]


class Collecting(SyncScheduler):
    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.embeddings: dict[str, list[float]] = {}

    def process(self, lb, result) -> BatchTokenOut:
        msg = super().process(lb, result)
        for rid, emb in zip(msg.rids, msg.embeddings):
            if emb is not None:
                assert rid not in self.embeddings
                self.embeddings[rid] = emb
        return msg


def hf_pooled(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()
    pooled = {"last": h[-1], "cls": h[0], "mean": h.mean(0)}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0)


def cosine(a: list[float], b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0))


@pytest.fixture(scope="module")
def hf_model(hf_default_model):
    return hf_default_model


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def runner(default_source) -> ModelRunner:
    args = ServerArgs(dtype="float32", device="cpu", max_total_tokens=4096, max_running_requests=8)
    return ModelRunner(args, default_source)


@pytest.mark.parametrize(
    ("pooling", "chunk"),
    [("last", None), ("cls", None), ("mean", None), ("last", 8), ("mean", 8)],  # chunks matter for mean and last
    ids=["last", "cls", "mean", "last-chunked8", "mean-chunked8"],
)
def test_pooled_hidden_states_equal_transformers(runner, hf_model, prompts, pooling, chunk):
    runner.args.chunked_prefill_size = chunk
    sched = Collecting(runner)
    gen = sched.add_request(prompts[1], SamplingParams(temperature=0.0, max_new_tokens=6))  # batched beside them
    reqs = [sched.add_request(p, SamplingParams(), pooling=pooling) for p in prompts]
    sched.run_until_idle()
    for req, p in zip(reqs, prompts):
        emb = sched.embeddings[req.rid]
        assert len(emb) == runner.model_config.hidden_size
        assert cosine(emb, hf_pooled(hf_model, p, pooling)) >= 0.99999
        assert req.output_ids == [] and req.finished_reason.reason.value == "length"
    assert len(gen.output_ids) == 6 and gen.rid not in sched.embeddings
    if pooling == "last":  # the prompt is cached now: a second embedding reuses all but its last token
        again = sched.add_request(prompts[2], SamplingParams(), pooling="last")
        sched.run_until_idle()
        assert again.cached_tokens == len(prompts[2]) - 1
        assert cosine(sched.embeddings[again.rid], hf_pooled(hf_model, prompts[2], "last")) >= 0.99999
    sched.scheduler.check_memory()
    assert sched.scheduler.flush_cache()


async def test_engine_encode(default_source, hf_model, prompts):
    async with Engine("smollm2-135m", dtype="float32", device="cpu", torch_threads=1, max_total_tokens=4096) as e:
        one = await e.encode(TEXTS[0])
        many = await e.encode(TEXTS)
        by_ids = await e.encode(prompts[1])  # a token-id list alone is one prompt
        gen = await e.generate(TEXTS[0], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert one.prompt_tokens == len(prompts[0]) and len(gen.token_ids) == 3
    assert [r.prompt_tokens for r in many] == [len(p) for p in prompts]
    for r, p in zip(many, prompts):
        assert cosine(r.embedding, hf_pooled(hf_model, p, "last")) >= 0.99999
    assert by_ids.embedding == pytest.approx(many[1].embedding, abs=1e-5)


async def test_embedding_only_engine_refuses_generation(default_source):
    async with Engine(
        "smollm2-135m", dtype="float32", device="cpu", torch_threads=1, max_total_tokens=2048, is_embedding=True
    ) as e:
        assert len((await e.encode("still embeds")).embedding) == e.model_info.hidden_size
        with pytest.raises(InvalidRequestError):
            await e.generate("no generation here", SamplingParams(max_new_tokens=2))
