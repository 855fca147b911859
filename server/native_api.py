"""SGLang-native endpoints: /generate, /health, /health_generate, /get_model_info,
/get_server_info, /version, /get_load, /flush_cache, /abort_request.

Shapes follow SGLang so its clients work unchanged: /generate answers
`{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type", ...}, "prompt_tokens",
"completion_tokens", "cached_tokens", "e2e_latency"}}` (plus `spec_verify_ct`, `spec_draft_tokens`,
`spec_accepted_tokens` for a request that speculated; a list for a batch or n > 1), and its
stream sends the *cumulative* text and ids in every event (SGLang's default), then [DONE]. An
aborted generation is a normal answer here with `finish_reason.type == "abort"`, as in SGLang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from engine import PromptLogprobs, RequestStream, ResultBuilder, SamplingParams, StreamDelta
from server.errors import ApiError, unavailable
from server.generation import GenerationGroup, GenSpec
from server.protocol_native import AbortRequest, GenerateRequest, GenerateResponse, LoadInfo, MetaInfo, VersionResponse
from server.request_body import read_json
from server.sse import send_done, send_event, sse_stream
from server.state import STATE, ServerState

VERSION = "0.1.0"
MAX_N = 128  # generations one request may ask for (n), as OpenAI caps it


def finish_reason_obj(d: StreamDelta | None) -> dict[str, Any] | None:
    """SGLang's finish_reason object: {"type": "stop", "matched": ...} / "length" / "abort"."""
    if d is None or d.finish_reason is None:
        return None
    if d.finish_reason == "stop":
        return {"type": "stop", "matched": d.matched_stop}
    if d.finish_reason == "length":
        return {"type": "length", "length": d.completion_tokens}
    return {"type": "abort", "message": d.error}


def meta_info(
    rid: str,
    d: StreamDelta | None,
    start: float,
    lps: list[float] | None = None,
    tops: list | None = None,
    ids: list[int] | None = None,
    prompt: PromptLogprobs | None = None,
    text: Callable[[int], str] | None = None,
) -> MetaInfo:
    """SGLang's meta_info; log-probs as (log-prob, id, text) triples, the text only with `text`
    (return_text_in_logprobs). `prompt`: the request's prompt log-probs (input_token_logprobs)."""
    name = text if text is not None else (lambda t: None)
    token_lps = [(lp, t, name(t)) for lp, t in zip(lps, ids)] if lps is not None and ids is not None else None
    top = [[(lp, t, name(t)) for t, lp in row] for row in tops] if tops is not None else None
    in_lps = in_top = None
    if prompt is not None:
        in_lps = [(lp, t, name(t)) for lp, t in zip(prompt.values, prompt.ids)]
        if tops is not None:
            in_top = [None if row is None else [(lp, t, name(t)) for t, lp in row] for row in prompt.top or []]
    return MetaInfo(
        rid,
        finish_reason_obj(d),
        d.prompt_tokens if d else 0,
        d.completion_tokens if d else 0,
        d.cached_tokens if d else 0,
        time.perf_counter() - start,
        in_lps,
        in_top,
        token_lps,
        top,
        d.spec_verify_ct if d else None,
        d.spec_draft_tokens if d else None,
        d.spec_accepted_tokens if d else None,
        d.weight_version or None if d else None,
    )


def parse_generate(req: GenerateRequest) -> tuple[list[GenSpec], bool]:
    """The generations a /generate (or WebSocket) request asks for, and whether it was a batch."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", param="text")
    if req.text is not None:
        batch = isinstance(req.text, list)
        prompts: list[Any] = list(req.text) if batch else [req.text]
    else:
        ids = req.input_ids
        batch = bool(ids) and all(isinstance(x, list) for x in ids)
        if not batch and not all(isinstance(x, int) for x in ids):
            raise ApiError(400, "input_ids must be a list of token ids or a list of such lists", param="input_ids")
        prompts = list(ids) if batch else [ids]
    if batch and not prompts:
        raise ApiError(400, "the batch is empty", param="text" if req.text is not None else "input_ids")
    sp = req.sampling_params or SamplingParams()
    n = sp.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="sampling_params.n")
    rids: list[str | None]
    if isinstance(req.rid, list):
        if len(req.rid) != len(prompts):
            raise ApiError(400, f"rid has {len(req.rid)} entries for {len(prompts)} prompts", param="rid")
        rids = list(req.rid)
    else:
        rids = [req.rid] * len(prompts)
    starts = req.logprob_start_len
    if not isinstance(starts, list):
        starts = [starts] * len(prompts)
    if len(starts) != len(prompts):
        raise ApiError(
            400, f"logprob_start_len has {len(starts)} entries for {len(prompts)} prompts", param="logprob_start_len"
        )
    loras = req.lora_path if isinstance(req.lora_path, list) else [req.lora_path] * len(prompts)
    if len(loras) != len(prompts):
        raise ApiError(400, f"lora_path has {len(loras)} entries for {len(prompts)} prompts", param="lora_path")
    specs = []
    for p, r, lp_start, lora in zip(prompts, rids, starts, loras):
        for j in range(n):
            seed = None if sp.seed is None else sp.seed + j
            params = msgspec.structs.replace(sp, n=1, seed=seed)
            rid = r if r is None or n == 1 else f"{r}-{j}"
            specs.append(
                GenSpec(p, params, rid, req.return_logprob, req.top_logprobs_num, None, lp_start, lora_path=lora)
            )
    return specs, batch or n > 1


def result_meta(spec: GenSpec, out: ResultBuilder, start: float, text: Callable[[int], str] | None) -> MetaInfo:
    """The meta_info of generation `spec` so far (`out`: its deltas folded), log-probs included
    as it asked for them (also the WebSocket's final delta)."""
    lps = out.logprobs if spec.return_logprob or spec.top_logprobs_num else None
    tops = out.top_logprobs if spec.top_logprobs_num else None
    rid = out.last.rid if out.last else (spec.rid or "")
    return meta_info(rid, out.last, start, lps, tops, out.token_ids, out.input_logprobs, text)


def _response(
    spec: GenSpec, out: ResultBuilder, start: float, index: int | None, text: Callable[[int], str] | None
) -> GenerateResponse:
    return GenerateResponse(out.full_text, out.token_ids, result_meta(spec, out, start, text), index)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, GenerateRequest)
    specs, many = parse_generate(req)
    start = time.perf_counter()
    group = GenerationGroup(state, specs)
    text = state.token_text if req.return_text_in_logprobs else None
    if not req.stream:
        async with group:
            outs = await group.collect()
        res = [_response(s, o, start, i if many else None, text) for i, (s, o) in enumerate(zip(specs, outs))]
        return web.json_response(body=msgspec.json.encode(res if many else res[0]))
    outs = [ResultBuilder() for _ in specs]
    async with group, sse_stream(request) as resp:  # leaving the group aborts what still runs
        async for i, d in group:
            outs[i].add(d)
            await send_event(resp, _response(specs[i], outs[i], start, i if many else None, text))
        await send_done(resp)
    return resp


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining or not state.engine.healthy:
        raise unavailable("the server is shutting down" if state.draining else "the engine is unhealthy")
    return web.Response(text="")


class HealthProbe:
    """SGLang's deep health check, one at a time: concurrent callers of /health_generate share
    the probe in flight, so the open (keyless) endpoint cannot be used to queue generations.

    The probe is a one-token greedy generation. It does not pass admission (`--max-queued-
    requests`): a full queue is normal saturation, not ill health. Under load the ping waits in
    the engine's queue like any request, so, as SGLang does, any forward that completes after
    the probe began also proves the engine alive.
    """

    POLL = 0.25  # seconds between looks at the engine's recent forwards

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None

    async def check(self, state: ServerState) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._probe(state))
            self.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if all left
        await asyncio.shield(self.task)  # one caller leaving does not cancel the others' probe

    async def _probe(self, state: ServerState) -> None:
        engine, timeout = state.engine, state.config.health_check_timeout
        t0 = time.perf_counter()
        stream = engine.open_stream("ping", SamplingParams(max_new_tokens=1, temperature=0.0))
        pump = asyncio.ensure_future(self._last_delta(stream))
        try:
            while True:
                left = t0 + timeout - time.perf_counter()
                if left <= 0:
                    raise unavailable(f"no token within {timeout:g}s", code="health_check_timeout")
                done, _ = await asyncio.wait({pump}, timeout=min(self.POLL, left))
                if done:
                    last = pump.result()
                    if last is None or last.finish_reason == "abort" or not engine.healthy:
                        reason = last.error if last is not None else "no output"
                        raise unavailable(f"health generation failed: {reason}", code="engine_unhealthy")
                    return
                steps = engine.recent_steps()
                if steps and steps[-1].end > t0 and engine.healthy:
                    return  # busy, and making progress
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            await stream.aclose()

    @staticmethod
    async def _last_delta(stream: RequestStream) -> StreamDelta | None:
        last = None
        async for d in stream:
            last = d
        return last


HEALTH_PROBE: web.AppKey[HealthProbe] = web.AppKey("health_probe", HealthProbe)


async def health_generate(request: web.Request) -> web.Response:
    """Healthy only if the engine produces a token in time (see `HealthProbe`)."""
    state = request.app[STATE]
    if state.draining or not state.engine.healthy:
        raise unavailable("the server is shutting down" if state.draining else "the engine is unhealthy")
    await request.app[HEALTH_PROBE].check(state)
    return web.Response(text="")


async def get_model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info, cfg = state.engine.model_info, state.config
    return web.json_response(
        {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path,
            "served_model_name": cfg.model_name,
            "is_generation": not info.is_embedding,
            "architecture": info.architecture,
            "context_length": info.context_len,
            "vocab_size": info.vocab_size,
            "dtype": info.dtype,
            "device": info.device,
            "weight_version": info.weight_version,
        }
    )


async def get_server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine_state = await state.engine.get_internal_state()
    info = {
        **dataclasses.asdict(state.engine.args),
        "weight_version": state.engine.weight_version,  # the one serving now, not the start-up flag
        **state.config.public(),
        "version": VERSION,
        "inflight_generations": state.inflight,
        "internal_states": [engine_state],
    }
    return web.json_response(body=msgspec.json.encode(info))


async def version(request: web.Request) -> web.Response:
    return web.json_response(body=msgspec.json.encode(VersionResponse(VERSION)))


def load_info(state: dict[str, Any], dp_rank: int = 0) -> LoadInfo:
    """SGLang's /get_load entry from the scheduler's internal state. `num_tokens` counts the KV
    slots requests hold: neither free nor evictable prefix cache (which a new request can reuse)."""
    total = int(state["total_tokens"])
    used = total - int(state["available_tokens"]) - int(state["evictable_tokens"])
    return LoadInfo(
        dp_rank=dp_rank,
        num_reqs=int(state["running_requests"]),
        num_waiting_reqs=int(state["waiting_requests"]),
        num_tokens=used,
        max_total_num_tokens=total,
        token_usage=used / total if total else 0.0,
    )


async def get_load(request: web.Request) -> web.Response:
    """One entry per data-parallel rank, as SGLang answers (this process is one rank; the --dp-size
    front end and the router list every replica's, numbered)."""
    state = request.app[STATE]
    return web.json_response(body=msgspec.json.encode([load_info(await state.engine.get_internal_state())]))


async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    # Right after the last request ends (an abort, say) the scheduler may still be finishing the
    # step it had in flight and refuses; wait that out, but not real work.
    for _ in range(100):
        if await engine.flush_cache():
            return web.json_response({"success": True, "message": "Cache flushed."})
        st = await engine.get_internal_state()
        if st["running_requests"] or st["waiting_requests"]:
            break
        await asyncio.sleep(0.01)
    raise ApiError(400, "cannot flush the cache while requests are running", code="requests_running")


async def abort_request(request: web.Request) -> web.Response:
    """Abort a request by rid (the `rid` given to /generate; OpenAI requests use '<id>-<choice>'),
    or every request with `abort_all`."""
    state = request.app[STATE]
    req = await read_json(request, AbortRequest)
    if req.abort_all:
        await state.engine.abort_all()
    elif req.rid:
        await state.engine.abort(req.rid)
    else:
        raise ApiError(400, "give a rid, or abort_all: true", param="rid")
    return web.json_response({"success": True})


def add_routes(app: web.Application) -> None:
    app[HEALTH_PROBE] = HealthProbe()
    r = app.router
    r.add_post("/generate", generate)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, get_model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, get_server_info)
    r.add_get("/version", version)
    r.add_get("/get_load", get_load)
    r.add_post("/flush_cache", flush_cache)
    r.add_get("/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
