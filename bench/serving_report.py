"""Metrics, the printed table, the JSON file and the plot of a serving benchmark run.

Definitions (all latencies in ms; percentiles by linear interpolation, numpy's default):
- TTFT: first chunk's arrival - send time.
- ITL: gaps between consecutive streamed chunks of a request, pooled over all requests. A chunk
  is one streamed event with new output, which may hold several tokens: ITL is per chunk, not
  per token.
- TPOT: per request, (E2E - TTFT) / (output_tokens - 1), for requests with > 1 output token.
- E2E: stream end - send time.
- Mean concurrency: sum of successful requests' E2E latencies / benchmark duration.
- ITL by streams in flight: what the ITL tail is made of (bench/serving_tail.py).
- Throughputs count successful requests only, over the whole benchmark duration (first send to
  last completion).
Token counts are the server's (`usage`, `meta_info`) when it reported them, else the tokenizer's
count of the generated text and of the prompt; `token_count_source` says which.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.serving_tail import ItlTail, format_tail, itl_tail

MAX_ERRORS_SHOWN = 5


@dataclass
class RequestRecord:
    """One request of the run, as it goes into the JSON file."""

    index: int  # order of the request in the dataset (conversation-major)
    conversation: int
    turn: int
    group: int | None
    target_input_len: int
    requested_output_len: int
    success: bool
    error: str
    prompt_tokens: int
    output_tokens: int
    token_count_source: str  # "server" or "tokenizer"
    cached_tokens: int | None  # prompt tokens served from the prefix cache, if the server said
    start_ms: float  # send time since the benchmark started
    ttft_ms: float
    e2e_ms: float
    itl_ms: list[float] = field(default_factory=list)
    chunk_times_ms: list[float] = field(default_factory=list)  # since the benchmark started
    chunk_tokens: list[int] | None = None  # tokens per chunk where the protocol says

    @property
    def tpot_ms(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


@dataclass
class Stats:
    mean: float | None
    median: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            return cls(None, None, None)
        a = np.asarray(values, dtype=np.float64)
        return cls(float(a.mean()), float(np.median(a)), float(np.percentile(a, 99)))


@dataclass
class Metrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int | None  # None when no response reported it
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    mean_concurrency: float
    ttft_ms: Stats
    itl_ms: Stats
    # Output tokens per streamed chunk: above 1 where a chunk carries several tokens, e.g. an
    # OpenAI stream holding back a token that ends inside a UTF-8 character until the next one
    # completes it (text-only protocols); each such chunk's ITL spans two steps. None: no chunks.
    tokens_per_chunk: float | None
    tpot_ms: Stats
    e2e_ms: Stats
    errors: list[dict[str, Any]]  # the first distinct messages: {"message", "count"}
    itl_tail: ItlTail | None = None  # the gaps by streams in flight and prefills spanned


def compute_metrics(records: list[RequestRecord], duration_s: float) -> Metrics:
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    dur = max(duration_s, 1e-9)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    counts = Counter(r.error for r in failed)
    errors = [{"message": m, "count": n} for m, n in list(counts.items())[:MAX_ERRORS_SHOWN]]
    chunks = sum(len(r.chunk_times_ms) for r in ok)
    return Metrics(
        completed=len(ok),
        failed=len(failed),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        total_cached_tokens=sum(cached) if cached else None,
        request_throughput=len(ok) / dur,
        input_throughput=total_in / dur,
        output_throughput=total_out / dur,
        total_throughput=(total_in + total_out) / dur,
        mean_concurrency=sum(r.e2e_ms for r in ok) / 1000.0 / dur,
        ttft_ms=Stats.of([r.ttft_ms for r in ok]),
        itl_ms=Stats.of([x for r in ok for x in r.itl_ms]),
        tokens_per_chunk=total_out / chunks if chunks else None,
        tpot_ms=Stats.of([t for r in ok if (t := r.tpot_ms) is not None]),
        e2e_ms=Stats.of([r.e2e_ms for r in ok]),
        errors=errors,
        itl_tail=itl_tail(ok),
    )


@dataclass
class BenchmarkResult:
    config: dict[str, Any]  # backend, dataset, rate, ... as run
    metrics: Metrics
    records: list[RequestRecord]
    warmup_errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "metrics": asdict(self.metrics),
            "warmup_errors": self.warmup_errors,
            "requests": [asdict(r) | {"tpot_ms": r.tpot_ms} for r in self.records],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


_W = 50  # table width, as SGLang's


def _rule(title: str = "", fill: str = "-") -> str:
    return f"{title:{fill}^{_W}}"


def _row(name: str, value: Any) -> str:
    if value is None:
        value = "n/a"
    elif isinstance(value, float):
        value = f"{value:.2f}"
    return f"{name:<40} {value:<10}"


def _stats_rows(name: str, s: Stats) -> list[str]:
    return [
        _row(f"Mean {name} (ms):", s.mean),
        _row(f"Median {name} (ms):", s.median),
        _row(f"P99 {name} (ms):", s.p99),
    ]


def format_table(result: BenchmarkResult) -> str:
    c, m = result.config, result.metrics
    rate = c.get("request_rate")
    lines = [
        _rule(" Serving Benchmark Result ", "="),
        _row("Backend:", c.get("backend")),
        _row("Dataset:", c.get("dataset")),
        _row("Traffic request rate:", "inf" if rate is None or rate == float("inf") else rate),
        _row("Max request concurrency:", c.get("max_concurrency") or "not set"),
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Total cached prompt tokens:", m.total_cached_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Input token throughput (tok/s):", m.input_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_throughput),
        _row("Mean concurrency:", m.mean_concurrency),
        _rule("End-to-End Latency"),
        *_stats_rows("E2E Latency", m.e2e_ms),
        _rule("Time to First Token"),
        *_stats_rows("TTFT", m.ttft_ms),
        _rule("Time per Output Token (excl. 1st token)"),
        *_stats_rows("TPOT", m.tpot_ms),
        _rule("Inter-Token Latency (per chunk)"),
        *_stats_rows("ITL", m.itl_ms),
        _row("Output tokens per chunk:", m.tokens_per_chunk),
        *([_rule("ITL by streams in flight"), *format_tail(m.itl_tail)] if m.itl_tail else []),
        _rule(fill="="),
    ]
    if m.errors:
        lines.append("Errors (first distinct messages):")
        lines += [f"  [{e['count']}x] {e['message']}" for e in m.errors]
    if result.warmup_errors:
        lines.append(f"Warmup errors: {len(result.warmup_errors)} (first: {result.warmup_errors[0]})")
    return "\n".join(lines)


def write_plot(result: BenchmarkResult, path: str | Path) -> None:
    """TTFT and ITL histograms and output throughput over time, as one PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result.records if r.success]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.hist([r.ttft_ms for r in ok], bins=30, color="tab:blue")
    ax.set(title="TTFT", xlabel="ms", ylabel="requests")
    ax = axes[1]
    ax.hist([x for r in ok for x in r.itl_ms], bins=50, color="tab:orange")
    ax.set(title="ITL (between streamed chunks)", xlabel="ms", ylabel="gaps")
    ax = axes[2]
    times: list[float] = []
    weights: list[float] = []
    for r in ok:
        if not r.chunk_times_ms:
            continue
        # Tokens per chunk where the protocol said; otherwise the request's tokens spread evenly.
        per = r.chunk_tokens or [r.output_tokens / len(r.chunk_times_ms)] * len(r.chunk_times_ms)
        times += [t / 1000.0 for t in r.chunk_times_ms]
        weights += per
    duration = max(result.metrics.duration_s, 1e-3)
    bin_s = max(duration / 60.0, 0.05)
    edges = np.arange(0.0, duration + bin_s, bin_s)
    if times and len(edges) > 1:
        hist, _ = np.histogram(times, bins=edges, weights=weights)
        ax.plot(edges[:-1] + bin_s / 2, hist / bin_s, color="tab:green")
    ax.set(title="Output throughput over time", xlabel="s since start", ylabel="tokens/s")
    fig.suptitle(
        f"{result.config.get('backend')} / {result.config.get('dataset')}: {result.metrics.completed} ok, "
        f"{result.metrics.failed} failed"
    )
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=80)
    plt.close(fig)
