"""Stop strings end a request in the scheduler's step whose token completes one (issue 32, item 4).

- Forwards: after the forward whose token completed the stop string, no forward planned later
  includes the request. Without overlap none at all; with overlap at most the one forward already
  launched when the match is processed (as for an EOS), and its token is discarded.
- Speculative decoding: a stop string completed by an accepted draft cuts the step's tokens there.
- The text, `matched_stop` and finish reason are those of the output-processor-only path (the
  scheduler given no tokenizer: the `StopStrMatched` fallback), for stop strings spanning two
  tokens, inside one token, several at once, and one that never matches.
- The dashboard's timelines see the finish; replay of a dump (prompts redacted or recorded)
  reproduces the stop-string finishes with zero divergences.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from engine import Engine, SamplingParams, SyncScheduler
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.model_executor.model_runner import ModelRunner
from engine.recorder.events import BatchEvent, RecvEvent, ResultEvent
from engine.recorder.replay import replay
from engine.recorder.ring import load_dump
from engine.scheduler.req import Finished, FinishReason
from engine.server_args import ServerArgs
from tests.sched_harness import build_tiny_folder, make_runner

TIMEOUT = 120
PROMPT = "Write a short story about a cat who learns to swim."
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer) -> str:
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-stop-strings"), default_tokenizer)


def output_processor_cut(tok, prompt_ids: list[int], ids: list[int], stops: list[str]) -> tuple[int, str, str]:
    """What the output processor does with `ids` (its detokenizer and matcher, token by token):
    (index of the token that completes a stop string, that stop string, the text before it)."""
    detok, matcher, text = IncrementalDetokenizer(tok, prompt_ids), StopStringMatcher(stops), ""
    for k, t in enumerate(ids):
        emitted, hit = matcher.push(detok.add([t]))
        text += emitted
        if hit is not None:
            return k, hit, text
    raise AssertionError(f"no stop string of {stops} in the output")


def pick_stops(tok, ids: list[int]) -> dict[str, str]:
    """Stop strings from a greedy output: one spanning tokens k and k+1 (2 characters of each),
    one strictly inside a token, one that is a whole token; each first found where chosen."""
    pieces = [tok.decode(ids[: i + 1], skip_special_tokens=True) for i in range(len(ids))]
    text, found = pieces[-1], {}
    for k in range(3, len(ids) - 1):
        start, end, nxt = len(pieces[k - 1]), len(pieces[k]), len(pieces[k + 1])
        word = text[start:end]
        if (
            "span" not in found
            and end - start >= 2
            and nxt - end >= 2
            and text.find(text[end - 2 : end + 2]) == end - 2
        ):
            found["span"] = text[end - 2 : end + 2]
        if "inside" not in found and len(word) >= 4 and text.find(word[1:3]) == start + 1:
            found["inside"] = word[1:3]
        if "token" not in found and len(word.strip()) >= 3 and k >= 8 and text.find(word) == start:
            found["token"] = word
    assert set(found) == {"span", "inside", "token"}, (found, text)
    return found


# ---- forwards after the match (the synchronous step) --------------------------------------------


def trace(sched: SyncScheduler, rid: str) -> dict:
    """Record the rids of every forward, and which forward's result ended `rid` (and how many
    forwards had been launched by then)."""
    seen: dict = {"forwards": [], "ended_by": None, "launched_then": None}
    run, process = sched.run, sched.process

    def traced_run(lb):
        lb.index = len(seen["forwards"])
        seen["forwards"].append([r.rid for r in lb.reqs])
        return run(lb)

    def traced_process(lb, result):
        out = process(lb, result)
        if seen["ended_by"] is None and any(r.rid == rid and r.finished() for r in lb.reqs):
            seen["ended_by"], seen["launched_then"] = lb.index, len(seen["forwards"])
        return out

    sched.run, sched.process = traced_run, traced_process
    return seen


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_no_forward_planned_after_the_match_includes_the_request(tiny_folder, default_tokenizer, overlap):
    tok = default_tokenizer
    prompt, other = tok.encode(PROMPT), tok.encode("A different prompt that keeps decoding meanwhile.")
    runner, args = make_runner(tiny_folder)
    full = SyncScheduler(runner, args).generate([prompt], SamplingParams(max_new_tokens=40, **GREEDY))[0].output_ids
    stop = pick_stops(tok, full)["span"]
    k, hit, _ = output_processor_cut(tok, prompt, full, [stop])

    runner, args = make_runner(tiny_folder)
    sched = SyncScheduler(runner, args)
    req = sched.add_request(prompt, SamplingParams(max_new_tokens=40, stop=[stop], **GREEDY), rid="stopped")
    sched.add_request(other, SamplingParams(max_new_tokens=60, **GREEDY), rid="other")  # keeps forwards going
    # Its last allowed token completes the stop string: the finish is the stop string's (the user
    # is shown "stop"), not the length's.
    at_limit = sched.add_request(prompt, SamplingParams(max_new_tokens=k + 1, stop=[stop], **GREEDY))
    seen = trace(sched, "stopped")
    sched.run_until_idle(overlap=overlap)
    sched.scheduler.check_memory()

    assert req.finished_reason == Finished(FinishReason.STOP, matched=hit) and hit == stop
    assert req.output_ids == full[: k + 1]  # nothing after the token that completed it
    assert at_limit.finished_reason == req.finished_reason and at_limit.output_ids == req.output_ids
    m, forwards = seen["ended_by"], seen["forwards"]
    later = [i for i in range(m + 1, len(forwards)) if "stopped" in forwards[i]]
    planned_after = [i for i in later if i >= seen["launched_then"]]
    assert planned_after == []
    # Overlap: exactly the next forward, launched before the match was processed (its token is
    # dropped: the output above ends at the match). Without overlap: none.
    assert later == ([m + 1] if overlap else [])
    assert len(forwards) > m + 2, "the other request kept decoding after the match"


def test_speculative_step_is_cut_at_the_token_that_completes_the_stop(default_source, default_tokenizer):
    """Accepted drafts are taken in order; the first whose text completes a stop string ends the
    request there, like an EOS among them: later tokens of the step are not returned, their KV
    slots are freed."""
    tok = default_tokenizer
    prompt = tok.encode("one two three four five six seven eight nine ten one two three four")
    spec_args = ServerArgs(dtype="float32", device="cpu", max_total_tokens=2048, speculative_algorithm="NGRAM")
    runner = ModelRunner(spec_args, default_source)
    plain = SyncScheduler(runner, ServerArgs(dtype="float32", device="cpu", max_total_tokens=2048))
    full = plain.generate([prompt], SamplingParams(max_new_tokens=16, **GREEDY))[0].output_ids
    assert plain.scheduler.flush_cache()
    words = tok.decode(full).split()
    stop = f" {words[2]} {words[3]}"  # e.g. " seven eight": its last token lies inside the first verify
    k, _, text = output_processor_cut(tok, prompt, full, [stop])

    sched = SyncScheduler(runner, spec_args)
    req = sched.add_request(prompt, SamplingParams(max_new_tokens=16, stop=[stop], **GREEDY))
    steps: list[tuple[str, int, int]] = []  # (mode, tokens emitted for req, tokens the step offered it)
    process = sched.process

    def traced(lb, result):
        out = process(lb, result)
        offered = result.accept_lens[0] + 1 if lb.mode.is_verify() else 1
        steps.append((lb.mode.name, out.rids.count(req.rid), offered))
        return out

    sched.process = traced
    sched.run_until_idle()
    sched.scheduler.check_memory()  # the cut drafts' slots went back
    assert req.finished_reason == Finished(FinishReason.STOP, matched=stop)
    assert req.output_ids == full[: k + 1] and tok.decode(full[: k + 1]).startswith(text + stop)
    mode, emitted, offered = steps[-1]
    assert mode == "TARGET_VERIFY" and 1 < emitted < offered, steps  # cut inside accepted drafts


# ---- the Engine: text, timelines, the flight recorder -------------------------------------------


def tiny_engine(folder: str, **kw) -> Engine:
    return Engine(folder, dtype="float32", device="cpu", torch_threads=1, max_total_tokens=4096, **kw)


async def test_text_matches_the_output_processor_only_path(tiny_folder, default_tokenizer):
    """Today's results (the scheduler given no tokenizer: the output processor finds the stop
    string and the `StopStrMatched` fallback frees the request) are what the scheduler's own
    check gives: text, matched_stop, finish reason, tokens, streamed deltas."""
    tok = default_tokenizer
    async with tiny_engine(tiny_folder, enable_overlap=True) as engine:
        async with asyncio.timeout(TIMEOUT):
            full = await engine.generate(PROMPT, SamplingParams(max_new_tokens=48, **GREEDY))
        stops = pick_stops(tok, full.token_ids)
        k = output_processor_cut(tok, tok.encode(PROMPT), full.token_ids, [stops["span"]])[0]
        cases = [([s], {}) for s in stops.values()]
        cases += [([stops["token"], stops["span"]], {}), ([stops["span"]], {"skip_special_tokens": False})]
        # The length limit reached just before, at (both finishes at once: "stop" wins) and after
        # the token that completes the stop string
        cases += [([stops["span"]], {"max_new_tokens": n}) for n in (k, k + 1, k + 2)]
        cases += [(["never in this output", stops["inside"] + "\u00e9"], {})]
        sched = engine._scheduler.sched
        results = {}
        for checked in (True, False):
            sched.tokenizer = tok if checked else None
            for i, (stop, extra) in enumerate(cases):
                params = SamplingParams(**{"max_new_tokens": 48, "stop": stop, **GREEDY, **extra})
                async with asyncio.timeout(TIMEOUT):
                    done = await engine.generate(PROMPT, params)
                    deltas = [d async for d in engine.stream(PROMPT, params)]
                results[checked, i] = (done, "".join(d.text for d in deltas), deltas[-1].finish_reason)
        sched.tokenizer = tok
        assert not engine._scheduler.timelines.live  # the fallback's finishes end timelines too
    limited = [i for i, (_, extra) in enumerate(cases) if "max_new_tokens" in extra]
    assert [results[True, i][0].finish_reason for i in limited] == ["length", "stop", "stop"]
    for i, (stop, _) in enumerate(cases):
        (new, new_streamed, new_reason), (old, old_streamed, old_reason) = results[True, i], results[False, i]
        fields = ("text", "matched_stop", "finish_reason", "token_ids", "completion_tokens")
        assert [getattr(new, f) for f in fields] == [getattr(old, f) for f in fields], stop
        assert new_streamed == old_streamed == new.text and new_reason == old_reason == new.finish_reason
        if i in limited:
            continue
        if i < 5:  # the ones that match: cut before the earliest completing stop string
            ends = {s: full.text.find(s) + len(s) for s in stop if s in full.text}
            first = min(ends, key=ends.get)
            assert new.finish_reason == "stop" and new.matched_stop == first
            assert new.text == full.text[: ends[first] - len(first)]
            assert len(new.token_ids) < len(full.token_ids)
        else:
            assert new.finish_reason == "length" and new.text == full.text and new.matched_stop is None


def stop_steps(dump, rid: str) -> tuple[int, list[int], list]:
    """(the step whose result ended `rid` on a stop string, the later steps that include it, the
    results of those steps)."""
    results = [e for e in dump.events if isinstance(e, ResultEvent)]
    ended = [e for e in results if e.stops and any(r == rid for r, _ in e.stops)]
    assert len(ended) == 1, "one recorded stop-string finish"
    step = ended[0].step
    batches = [e for e in dump.events if isinstance(e, BatchEvent) and e.batch is not None]
    later = [e.step for e in batches if e.step > step and rid in e.batch.rids]
    return step, later, [e for e in results if e.step in later]


@pytest.mark.parametrize(
    ("overlap", "record_prompts"),
    [(True, False), (True, True), (False, False)],
    ids=["overlap-redacted", "overlap-prompts", "sync-redacted"],
)
async def test_engine_finish_is_a_normal_one_and_replays(tiny_folder, tmp_path, overlap, record_prompts):
    opts = dict(
        enable_overlap=overlap, flight_recorder_dir=str(tmp_path), flight_recorder_record_prompts=record_prompts
    )
    async with tiny_engine(tiny_folder, **opts) as engine:
        async with asyncio.timeout(TIMEOUT):
            full = await engine.generate(PROMPT, SamplingParams(max_new_tokens=40, **GREEDY))
            stop = full.text[len(full.text) // 3 : len(full.text) // 3 + 5]
            other = engine.generate(
                "Keep decoding while the other one stops.", SamplingParams(max_new_tokens=60, **GREEDY)
            )
            stopped = [
                engine.generate(PROMPT, SamplingParams(max_new_tokens=40, stop=[stop], **GREEDY), rid=f"stop-{i}")
                for i in range(4)
            ]
            outs = await asyncio.gather(other, *stopped)
        state = await engine.get_internal_state(detail=True)
        live = dict(engine._scheduler.timelines.live)
        path = Path(engine.dump_flight_recorder("test"))
    assert all(o.finish_reason == "stop" and o.matched_stop == stop for o in outs[1:])
    assert outs[1].text == full.text[: full.text.find(stop)]
    # The dashboard: every stop-string request's timeline finished ("stop"); none stays live.
    timelines = {t["rid"]: t for t in state["timelines"]}
    for i in range(4):
        t = timelines[f"stop-{i}"]
        assert t["finish_reason"] == "stop" and t["phases"][-1][0] == "finished"
    assert live == {}

    dump = load_dump(path)
    raw = path.read_bytes()
    assert (stop.encode() in raw) == record_prompts
    assert not any(isinstance(e, RecvEvent) and type(e.msg).__name__ == "StopStrMatched" for e in dump.events)
    for i in range(4):
        step, later, results = stop_steps(dump, f"stop-{i}")
        # Overlap: at most the forward already launched when the match was processed, which
        # returns no token for it; without overlap, none.
        assert len(later) <= (1 if overlap else 0) and all(s == step + 1 for s in later)
        assert all(f"stop-{i}" not in r.out.rids for r in results)
    report = replay(path)
    assert report.divergence is None, report.divergence.describe()

    # Replay applies the recorded decisions: without them the replayed scheduler decides otherwise.
    events = [msgspec.structs.replace(e, stops=None) if isinstance(e, ResultEvent) else e for e in dump.events]
    report = replay(msgspec.structs.replace(dump, events=events))
    assert report.divergence is not None and "result" in report.divergence.what


async def test_fallback_path_ends_once_and_replays(tiny_folder, tmp_path):
    """With the scheduler given no tokenizer (as before this change), the output processor's
    `StopStrMatched` ends the request: once, with its timeline, and such a dump replays."""
    async with tiny_engine(tiny_folder, enable_overlap=True, flight_recorder_dir=str(tmp_path)) as engine:
        async with asyncio.timeout(TIMEOUT):
            full = await engine.generate(PROMPT, SamplingParams(max_new_tokens=40, **GREEDY))
            stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 4]
            engine._scheduler.sched.tokenizer = None
            out = await engine.generate(PROMPT, SamplingParams(max_new_tokens=40, stop=[stop], **GREEDY))
            assert out.finish_reason == "stop" and out.matched_stop == stop
            # The caller has its answer once the output processor matched; the scheduler ends the
            # request when `StopStrMatched` reaches its mailbox, an event later (on a busy machine
            # noticeably later): wait for that, not for a fixed time.
            while engine._scheduler.timelines.live:
                await asyncio.sleep(0.01)
        path = Path(engine.dump_flight_recorder("test"))
    dump = load_dump(path)
    matched = [e for e in dump.events if isinstance(e, RecvEvent) and type(e.msg).__name__ == "StopStrMatched"]
    assert [e.actor for e in matched] == ["dispatcher", "scheduler"]
    assert not any(isinstance(e, ResultEvent) and e.stops for e in dump.events)
    report = replay(path)
    assert report.divergence is None, report.divergence.describe()
