"""N-gram speculative decoding (`speculative_algorithm="NGRAM"`): engine/speculative/ and
engine/scheduler/speculation.py.

- The pieces: n-gram lookup (longest suffix, a repeating pattern continued), the adaptive draft
  length, greedy acceptance.
- fp32: outputs token-identical to plain decoding through the real scheduler, with and without
  overlap, chunked prefill, mixed chunks, radix-cache hits, retractions under a small KV pool,
  and requests that cannot speculate (sampled with a seed, logprobs, a stop string) riding in
  the same verify forwards; drafts were really accepted (the stats say so).
- Memory: after everything, and after aborts in the middle of speculation, every KV slot is free
  or cached, every request row free.
- Tensor parallelism: verify forwards drive the worker ranks the same way.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from engine import Engine, SamplingParams, SyncScheduler
from engine.distributed.driver import TPDriver
from engine.model_executor.model_runner import ModelRunner
from engine.server_args import ServerArgs
from engine.speculative.ngram import DraftLength, NgramIndex
from engine.speculative.verify import accept_drafts
from tests.sched_harness import TINY_VOCAB, make_tiny_llama

TIMEOUT = 120


def test_ngram_lookup_takes_the_longest_earlier_match_and_continues_a_pattern():
    index = NgramIndex()
    index.extend([1, 2, 3, 4, 5, 9, 9, 2, 3, 4])
    assert index.propose(3) == [5, 9, 9]  # "2 3 4" occurred before, followed by 5 9 9
    index.extend([7])
    assert index.propose(3) == []  # "4 7" never occurred before
    periodic = NgramIndex()
    periodic.extend([5, 6, 5, 6, 5])
    assert periodic.propose(5) == [6, 5, 6, 5, 6]  # the pattern runs into the drafts: continued
    assert NgramIndex().propose(4) == []


def test_draft_length_adapts_and_pauses_a_request_whose_drafts_fail():
    length = DraftLength(max_tokens=4)
    assert length.wanted(0) == 4
    out = 10
    while length.wanted(out) > 0:  # every draft rejected: it shrinks, then pauses
        assert length.wanted(out) <= 4 and out < 20
        length.record(drafted=length.wanted(out), accepted=0, output_len=out)
        out += 1
    assert length.wanted(out + DraftLength.PAUSE) > 0  # and tries again after the pause
    good = DraftLength(max_tokens=4)
    good.record(drafted=4, accepted=4, output_len=5)
    assert good.wanted(5) == 4


def test_accept_drafts_keeps_the_agreeing_prefix_and_the_targets_next_token():
    # request 0: last=7, drafts 1 2 3; the model agrees with 1 2, then says 8
    # request 1: no drafts: the sampler's pick; request 2: every draft accepted, then the bonus
    ids = [7, 1, 2, 3, 4, 5, 6]
    argmax = [1, 2, 8, 0, 9, 6, 11]
    assert accept_drafts(ids, [4, 1, 2], argmax, [0, 42, 0]) == ([8, 42, 11], [2, 0, 1])


# ---- identical outputs through the scheduler ------------------------------------------------------


def save_repeating_llama(folder, vocab_size: int) -> str:
    """A tiny random Llama that (nearly always) predicts its current token again: tied embeddings,
    attention and MLP outputs damped so the residual stream stays close to the token's own
    embedding. Its greedy output repeats, so n-gram drafts are accepted; every layer still runs
    (and, under tensor parallelism, all-reduces) real numbers."""
    return str(
        make_tiny_llama(folder, vocab_size, tie_word_embeddings=True, damped=("o_proj.weight", "down_proj.weight"))
    )


@pytest.fixture(scope="module")
def repeating_folder(tmp_path_factory) -> str:
    return save_repeating_llama(tmp_path_factory.mktemp("tiny-repeating"), TINY_VOCAB)


_DOC = (
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n"
)


@pytest.fixture(scope="module")
def copy_prompts(default_tokenizer) -> list[list[int]]:
    """Copy-heavy prompts for the default model (quote a document, continue a file it has seen)."""
    tok = default_tokenizer
    chat = [{"role": "user", "content": "Repeat this code exactly:\n\n" + _DOC}]
    quoted = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return [
        tok.encode(quoted),
        tok.encode(_DOC + "\n# the same function again\n" + _DOC[:60]),
        tok.encode("one two three four five six seven eight nine ten one two three four"),
        tok.encode("Days: Monday, Tuesday, Wednesday, Thursday, Friday. Again: Monday,"),
    ]


SAMPLED = 2  # the index of the sampling request among _run's outputs
MIXED_PARAMS = [
    SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.0, max_new_tokens=33, stop=["# the"]),
    SamplingParams(temperature=0.8, seed=3, max_new_tokens=24, ignore_eos=True),  # sampled: no drafts
    SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True, min_new_tokens=6),
]


def _run(
    source, prompts: list[list[int]], spec: bool, overlap: bool, verify_rows: list[int] | None = None, **options
) -> tuple[list[list[int]], dict | None]:
    """The default model (`source`) in fp32: outputs of every request and the speculation stats.
    The verify forwards may hold every request's drafts (64 rows) unless `options` say otherwise;
    their row counts go to `verify_rows`."""
    args = ServerArgs(
        dtype="float32",
        device="cpu",
        max_running_requests=8,
        speculative_algorithm="NGRAM" if spec else None,
        **{"max_total_tokens": 4096, "speculative_max_verify_tokens": 64, **options},
    )
    runner = ModelRunner(args, source)
    if verify_rows is not None:
        generate = runner.forward_batch_generation

        def recording(batch):
            if batch.forward_mode.is_verify():
                verify_rows.append(len(batch.out_cache_loc))
            return generate(batch)

        runner.forward_batch_generation = recording
    sched = SyncScheduler(runner, args)
    reqs = [sched.add_request(p, sp) for p, sp in zip(prompts[:2], MIXED_PARAMS[:2])]
    logprob = sched.add_request(prompts[0][:40], MIXED_PARAMS[0], return_logprob=True, top_logprobs_num=2)

    def join(step: int) -> None:
        if step == 3:  # the rest join while the first decode (and hit the cache on shared prefixes)
            reqs.extend(sched.add_request(p, sp) for p, sp in zip(prompts[2:], MIXED_PARAMS[2:]))

    sched.run_until_idle(overlap=overlap, on_step=join)
    sched.scheduler.check_memory()  # idle: every slot free or cached, every row free
    spec_stats = sched.scheduler.speculation.stats() if sched.scheduler.speculation is not None else None
    return [r.output_ids for r in [*reqs, logprob]], spec_stats


@pytest.fixture(scope="module")
def run(default_source, copy_prompts):
    """`_run` on the copy prompts with the session's model source (resolving the GGUF again costs
    seconds a runner). Plain decoding is deterministic, so each set of its options is decoded
    once for the module and handed out as fresh lists."""
    plain: dict = {}

    def call(spec: bool, overlap: bool, verify_rows: list[int] | None = None, **options):
        if spec or verify_rows is not None:
            return _run(default_source, copy_prompts, spec, overlap, verify_rows, **options)
        key = (overlap, tuple(sorted(options.items())))
        if key not in plain:
            plain[key] = _run(default_source, copy_prompts, False, overlap, **options)
        outs, stats = plain[key]
        return [list(o) for o in outs], stats

    return call


@pytest.mark.parametrize(
    ("overlap", "options"),
    [
        (False, {}),
        (True, {}),
        (True, {"chunked_prefill_size": 32}),
        (False, {"enable_mixed_chunk": True, "chunked_prefill_size": 48}),
    ],
    ids=["sync", "overlap", "overlap-chunked", "mixed-chunk"],
)
def test_outputs_identical_to_plain_decoding(run, overlap, options):
    want, _ = run(spec=False, overlap=overlap, **options)
    got, stats = run(spec=True, overlap=overlap, **options)
    del want[SAMPLED], got[SAMPLED]  # same distribution, not the same draws (see the test below)
    assert got == want
    assert stats is not None and stats["accepted_tokens"] >= 40, stats  # drafts really were accepted


def test_verify_forwards_keep_to_the_row_budget(run):
    """By default a verify forward has at most num_draft_tokens + 1 rows: the running requests
    share the rows left after their own, and a batch that fills them does not draft. Outputs stay
    those of plain decoding."""
    want, _ = run(spec=False, overlap=False)
    rows: list[int] = []
    got, stats = run(spec=True, overlap=False, verify_rows=rows, speculative_max_verify_tokens=None)
    del want[SAMPLED], got[SAMPLED]
    assert got == want
    budget = ServerArgs().speculative_num_draft_tokens + 1
    assert stats is not None and stats["accepted_tokens"] > 0 and rows and max(rows) <= budget, (stats, rows)
    rows.clear()
    run(spec=True, overlap=False, verify_rows=rows, speculative_max_verify_tokens=3)
    assert rows and max(rows) <= 3


def test_identical_under_retraction(run):
    """A KV pool too small for every request's whole output: retractions happen mid-speculation."""
    want, _ = run(spec=False, overlap=False, max_total_tokens=330)
    got, stats = run(spec=True, overlap=False, max_total_tokens=330)
    del want[SAMPLED], got[SAMPLED]
    assert got == want and stats is not None and stats["accepted_tokens"] > 0


def test_sampled_requests_keep_their_distribution(repeating_folder):
    """temperature > 0: drafts are checked by rejection sampling, so every output position is
    distributed as without speculation. 2,000 seeded requests per side (deterministic: the seeds
    fix every draw); the per-position token histograms agree within sampling noise, while a
    verifier that accepted every draft would push the repeat rate toward 1."""
    prompt = [5, 6, 7, 8] * 6 + [9, 9]
    sampling = dict(temperature=0.8, top_p=0.95, max_new_tokens=8, ignore_eos=True)
    params = [SamplingParams(seed=seed, **sampling) for seed in range(2000)]
    runs = {}
    for spec in (False, True):
        args = ServerArgs(
            model_path=repeating_folder,
            dtype="float32",
            device="cpu",
            max_total_tokens=8192,
            max_running_requests=128,
            speculative_algorithm="NGRAM" if spec else None,
            speculative_max_verify_tokens=1024,  # every request drafts: the sampler is under test
            torch_threads=1,
        )
        sched = SyncScheduler(ModelRunner(args), args)
        reqs = [sched.add_request(prompt, p) for p in params]
        sched.run_until_idle()
        runs[spec] = [r.output_ids for r in reqs]
        stats = sched.scheduler.speculation.stats() if spec else None
    assert stats is not None and stats["accepted_tokens"] > 1000 and stats["draft_tokens"] > stats["accepted_tokens"]
    for pos in range(8):  # histograms of the 8 likeliest tokens and "any other", per position
        plain = Counter(out[pos] for out in runs[False])
        spec = Counter(out[pos] for out in runs[True])
        top = [t for t, _ in plain.most_common(8)]
        bins = [(plain[t], spec[t]) for t in top]
        bins.append((len(params) - sum(a for a, _ in bins), len(params) - sum(b for _, b in bins)))
        tv = sum(abs(a - b) for a, b in bins) / (2 * len(params))
        assert tv < 0.06, (pos, tv, plain.most_common(4), spec.most_common(4))
    repeats = [sum(o[i] == o[i - 1] for o in runs[s] for i in range(1, 8)) / (7 * len(params)) for s in (False, True)]
    assert abs(repeats[0] - repeats[1]) < 0.02, repeats


def test_tensor_parallel_verify(repeating_folder):
    """Verify forwards drive the worker ranks like any other: TP=2 gives TP=1's tokens, with
    drafts accepted and rejected slots freed on the way."""
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 6 + [9, 9], [(37 * j + 11) % TINY_VOCAB for j in range(40)]]
    outputs = []
    for tp in (1, 2):
        args = ServerArgs(
            model_path=repeating_folder,
            dtype="float32",
            device="cpu",
            max_total_tokens=4096,
            speculative_algorithm="NGRAM",
            tp_size=tp,
            torch_threads=1,
        )
        driver = TPDriver(args) if tp > 1 else None
        try:
            sched = SyncScheduler(driver.load() if driver else ModelRunner(args), args)
            reqs = [sched.add_request(p, params) for p in prompts]
            sched.run_until_idle(overlap=True)
            outputs.append([r.output_ids for r in reqs])
            assert sched.scheduler.speculation.stats()["accepted_tokens"] > 0
            sched.scheduler.check_memory()
        finally:
            if driver is not None:
                driver.stop(healthy=True)
    assert outputs[0] == outputs[1]


# ---- aborts in the middle of speculation ----------------------------------------------------------


@pytest.fixture(scope="module")
def repeating_tok_folder(tmp_path_factory, default_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("tiny-repeating-tok")
    save_repeating_llama(folder, len(default_tokenizer))
    default_tokenizer.save_pretrained(folder)
    return str(folder)


async def test_aborts_mid_speculation_free_everything(repeating_tok_folder):
    engine = Engine(
        repeating_tok_folder,
        dtype="float32",
        device="cpu",
        torch_threads=1,
        max_total_tokens=8192,
        speculative_algorithm="NGRAM",
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    text = "one two three four five six seven eight nine ten " * 6
    async with engine:
        async with asyncio.timeout(TIMEOUT):
            streams = [engine.open_stream(text + str(i), params) for i in range(4)]
            for stream in streams[:3]:  # leave three in the middle of their decode
                got = 0
                async for delta in stream:
                    got += len(delta.token_ids)
                    if got >= 12:
                        break
                await stream.aclose()
            done = [d async for d in streams[3]]
            assert done[-1].finish_reason == "length"
            while (st := await engine.get_internal_state())["running_requests"] or st["protected_tokens"]:
                await asyncio.sleep(0.01)
        assert st["available_tokens"] + st["evictable_tokens"] == st["total_tokens"], st
        assert st["memory_errors"] == [] and st["speculative"]["verify_steps"] > 0, st


async def test_each_request_reports_what_its_speculation_did(repeating_tok_folder):
    """`StreamDelta.spec_*` per request (carried by the last delta, so by `GenerateResult` and the
    native meta_info), the engine's totals and the Prometheus gauges built from them."""
    from prometheus_client import generate_latest

    from server.metrics import Metrics
    from server.native_api import meta_info

    engine = Engine(repeating_tok_folder, dtype="float32", device="cpu", torch_threads=1, speculative_algorithm="NGRAM")
    params = SamplingParams(temperature=0.0, max_new_tokens=80, ignore_eos=True)
    text = "one two three four five six seven eight nine ten " * 6
    async with engine:
        async with asyncio.timeout(TIMEOUT):
            deltas = [d async for d in engine.open_stream(text, params)]
            plain = await engine.generate(text, SamplingParams(temperature=0.0, max_new_tokens=20), return_logprob=True)
            st = await engine.get_internal_state()
    last = deltas[-1]
    assert last.spec_verify_ct and last.spec_draft_tokens and last.spec_accepted_tokens is not None
    assert 0 < last.spec_accepted_tokens <= last.spec_draft_tokens
    assert last.spec_accepted_tokens + last.spec_verify_ct <= last.completion_tokens == 80
    counts = [d.spec_verify_ct for d in deltas if d.spec_verify_ct is not None]
    assert counts == sorted(counts)  # running totals
    assert plain.spec_verify_ct is None and plain.spec_accepted_tokens is None  # logprobs: no drafts
    spec = st["speculative"]
    assert (spec["verify_rows"], spec["draft_tokens"]) == (last.spec_verify_ct, last.spec_draft_tokens)
    assert spec["accept_length"] == pytest.approx((spec["accepted_tokens"] + spec["verify_rows"]) / spec["verify_rows"])
    assert spec["accept_length"] > 1
    info = meta_info(last.rid, last, 0.0)
    assert (info.spec_verify_ct, info.spec_accepted_tokens) == (last.spec_verify_ct, last.spec_accepted_tokens)
    metrics = Metrics("m")
    metrics.refresh(st, 0)
    page = generate_latest(metrics.registry).decode()
    assert f'sglang:spec_accept_length{{model_name="m"}} {spec["accept_length"]}' in page


async def test_speculative_run_replays_from_the_flight_recorder(repeating_tok_folder, tmp_path):
    """Drafts are a pure function of the tokens, so a dump of a speculative run replays exactly."""
    from engine import replay

    opts = dict(dtype="float32", device="cpu", torch_threads=1, max_total_tokens=600, chunked_prefill_size=32)
    engine = Engine(repeating_tok_folder, speculative_algorithm="NGRAM", flight_recorder_dir=str(tmp_path), **opts)
    params = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)
    async with engine:
        async with asyncio.timeout(TIMEOUT):
            await asyncio.gather(*(engine.generate(f"a b c a b c {i} " * (3 + i), params) for i in range(6)))
        assert (await engine.get_internal_state())["speculative"]["accepted_tokens"] > 0
        path = engine.dump_flight_recorder()
    report = replay(path)
    assert report.divergence is None, report.divergence.describe()
