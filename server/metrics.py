"""Prometheus metrics, named as SGLang names them (`sglang:*`) so existing dashboards work.

Each app gets its own `CollectorRegistry` (several servers in one process must not collide on
the global one). Counters and latency histograms are fed per generation by `RequestMetrics`;
the engine's gauges (running/queued requests, token usage, cache hit rate) are read from
`Engine.get_internal_state()` when /metrics is scraped, so they are never stale.
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine import StreamDelta

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Tokens generated.")
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache.")
        self.requests = counter("sglang:num_requests", "Generations finished (any reason).")
        self.aborted = counter("sglang:num_aborted_requests", "Generations that ended aborted.")
        self.running = gauge("sglang:num_running_reqs", "Requests in the running batch.")
        self.queued = gauge("sglang:num_queue_reqs", "Requests waiting to be scheduled.")
        self.inflight = gauge("sglang:num_inflight_reqs", "Generations admitted by the HTTP layer.")
        self.token_usage = gauge("sglang:token_usage", "Share of the KV cache pool in use (not evictable).")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "Prompt tokens found in the prefix cache / all.")
        self.gen_throughput = gauge("sglang:gen_throughput", "Generated tokens per second since start.")
        self.spec_accept_length = gauge(
            "sglang:spec_accept_length",
            "Tokens a request gets per verify forward it drafted in (accepted drafts + 1); 0 without speculation.",
        )
        self.spec_accept_rate = gauge("asyncllm:spec_accept_rate", "Drafted tokens accepted / drafted, since start.")
        self.message_errors = gauge(
            "asyncllm:actor_message_errors", "Messages whose handling raised inside an actor (contained, logged)."
        )
        self.ttft = hist("sglang:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("sglang:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = hist("sglang:e2e_request_latency_seconds", "Request latency, submit to last token.", _E2E_BUCKETS)
        self.queue_time = hist(
            "sglang:queue_time_seconds", "Time in the waiting queue before the first prefill.", _LATENCY_BUCKETS
        )

    def track(self) -> RequestMetrics:
        return RequestMetrics(self)

    def refresh(self, state: dict, inflight: int) -> None:
        self.running.set(state.get("running_requests", 0))
        self.queued.set(state.get("waiting_requests", 0))
        self.token_usage.set(state.get("token_usage", 0.0))
        self.cache_hit_rate.set(state.get("cache_hit_rate", 0.0))
        self.gen_throughput.set(state.get("gen_throughput", 0.0))
        self.message_errors.set(state.get("message_errors", 0))
        spec = state.get("speculative") or {}
        self.spec_accept_length.set(spec.get("accept_length", 0.0))
        self.spec_accept_rate.set(spec.get("accept_rate", 0.0))
        self.inflight.set(inflight)

    def render(self) -> web.Response:
        resp = web.Response(body=generate_latest(self.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp


class RequestMetrics:
    """Timing of one generation, fed with its deltas as they arrive."""

    __slots__ = ("ended", "last", "m", "seen_prompt", "seen_queue", "start")

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.seen_prompt = False
        self.seen_queue = False
        self.ended = False

    def on_delta(self, delta: StreamDelta) -> None:
        now = time.perf_counter()
        if not self.seen_prompt and delta.prompt_tokens:
            self.seen_prompt = True
            self.m.prompt_tokens.inc(delta.prompt_tokens)
            self.m.cached_tokens.inc(delta.cached_tokens)
        if not self.seen_queue and delta.queue_time is not None:
            self.seen_queue = True
            self.m.queue_time.observe(delta.queue_time)
        n = len(delta.token_ids)
        if n:
            if self.last == self.start:
                self.m.ttft.observe(now - self.start)
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    self.m.itl.observe(gap)
            self.last = now
            self.m.generation_tokens.inc(n)
        if delta.finish_reason is not None:
            self.finish(delta.finish_reason)

    def finish(self, reason: str = "abort") -> None:
        """Count the generation once, however it ended (also when the client went away)."""
        if self.ended:
            return
        self.ended = True
        self.m.requests.inc()
        if reason == "abort":
            self.m.aborted.inc()
        self.m.e2e.observe(time.perf_counter() - self.start)
