"""Soak test for a real server: `python -m bench.soak --url http://127.0.0.1:30000` (or `--launch`).

It sends `--num-requests` requests (default 2,000) at `--concurrency` work units at a time, mixing
`/v1/chat/completions` (streaming or not, `n` 1-3, logprobs or not), `/generate` (streaming or
not, `n` 1-2) and `/ws` sessions of several generations per socket, over a few shared prompt
prefixes with random suffixes and random `max_tokens`, all with `ignore_eos`. With LoRA adapters
(`--num-lora-adapters N` with `--launch`, or `--lora-adapter NAME` per adapter a running server
has), each request names one of them or the base model (`model` on the OpenAI route, `lora_path`
on /generate and /ws), and the greedy re-runs use the same adapter. A fraction
(`--abort-fraction`, 0.3) is aborted at a random point: the client disconnects, posts the rid to
/abort_request, cancels over the socket or closes it (bench/soak_plan.py). The workload is a pure
function of `--seed`.

At the end it requires (bench/soak_checks.py):
- every request not aborted got exactly its token count, by every count the protocol gives;
- a sample of greedy requests gives the same tokens when re-run alone, one at a time;
- idle, the KV memory identity holds (available + evictable + protected == total, nothing
  protected, the scheduler's own idle check clean, no admission slot held), after the warm-up and
  at the end, and /flush_cache then frees everything;
- the server's RSS grew by at most `--max-rss-growth-mb` (50) from after the warm-up (the first
  ~10% of requests) to the end (needs the server's pid: `--launch` or `--server-pid`);
- no 5xx (HTTP status, or an error event no abort of ours explains), every 4xx has OpenAI's error
  body (a bad request is mixed in after every 50 work units: each must get its 4xx), no traceback
  in the server's log (with `--launch` or `--server-log`), /health is 200, and a launched server
  exits 0 on SIGTERM.

The JSON report (`--report`) has the counts per endpoint, the failures with details, latencies,
RSS and the memory checks. Exit status: 0 passed, 1 failed (or the server could not start), 2 bad
flags. In-process: `report = await run_soak(SoakConfig(url=...))`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.soak_checks import (
    compare_outputs,
    flush_and_check,
    health,
    judge,
    memory_identity,
    percentiles,
    read_rss,
    scan_log,
    server_info,
    wait_idle,
)
from bench.soak_clients import Outcome, SoakClient
from bench.soak_plan import KINDS, SoakPlan, SoakRequest, WorkUnit, build_plan
from bench.soak_server import LaunchedServer, LaunchError, write_adapters
from bench.soak_ws import run_ws_session

MAX_FAILURES_LISTED = 50


@dataclass
class SoakConfig:
    """One run's settings (the command line's flags; `--launch` fills in url, pid and log)."""

    url: str | None = None
    num_requests: int = 2000
    concurrency: int = 32
    seed: int = 0
    abort_fraction: float = 0.3
    max_tokens: int = 64
    greedy_sample: int = 20
    server_pid: int | None = None  # for RSS (--launch or --server-pid)
    server_log: Path | None = None  # scanned for tracebacks (--launch or --server-log)
    api_key: str | None = None
    request_timeout: float = 600.0
    idle_timeout: float = 120.0
    max_rss_growth_mb: float = 50.0
    warmup_fraction: float = 0.1  # the RSS baseline is taken after this share of the requests
    progress: bool = False
    adapters: list[str] = field(default_factory=list)  # LoRA adapters the server has: requests spread over them


@dataclass
class _Run:
    """The run's mutable state: outcomes by request index, progress, RSS samples, bad requests."""

    cfg: SoakConfig
    plan: SoakPlan
    client: SoakClient
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    done: int = 0
    rss_peak: int = 0
    rss_trend: list[tuple[int, float]] = field(default_factory=list)  # (requests done, MB) at each tenth
    invalid: list[str | None] = field(default_factory=list)  # the bad requests' problems (None: as expected)

    async def unit(self, sem: asyncio.Semaphore, unit: WorkUnit) -> None:
        async with sem:
            if unit.kind == "invalid":
                problem = await self.client.invalid(unit.invalid)
                self.invalid.append(problem)
                return
            if unit.kind == "ws":
                outs = await run_ws_session(self.client, unit.requests, self.cfg.request_timeout)
            else:
                outs = [await self.client.run(unit.requests[0])]
        for out in outs:
            self.outcomes[out.index] = out
        before, self.done = self.done, self.done + len(outs)
        total = self.cfg.num_requests
        if before * 10 // total != self.done * 10 // total:
            rss = read_rss(self.cfg.server_pid) if self.cfg.server_pid else None
            if rss is not None:
                self.rss_trend.append((self.done, round(rss / 2**20, 1)))
            if self.cfg.progress:
                mb = "" if rss is None else f" (server RSS {rss / 2**20:.0f} MB)"
                print(f"  {self.done}/{total} requests done{mb}", file=sys.stderr, flush=True)

    async def units(self, units: list[WorkUnit]) -> None:
        sem = asyncio.Semaphore(self.cfg.concurrency)
        await asyncio.gather(*(self.unit(sem, u) for u in units))

    async def sample_rss(self) -> None:
        while self.cfg.server_pid is not None:
            self.rss_peak = max(self.rss_peak, read_rss(self.cfg.server_pid) or 0)
            await asyncio.sleep(0.5)


async def _greedy_reruns(run: _Run, verdicts: dict[int, str]) -> dict[str, Any]:
    """Re-run a sample of completed greedy requests alone, one at a time; outputs must match."""
    by_index = {r.index: r for r in run.plan.requests}
    candidates = sorted(i for i, v in verdicts.items() if v == "ok" and by_index[i].greedy)
    sample = sorted(random.Random(run.cfg.seed + 1).sample(candidates, min(run.cfg.greedy_sample, len(candidates))))
    run.client.run_id += "-solo"  # the re-runs' rids must not collide with the originals'
    mismatches = []
    for i in sample:
        req: SoakRequest = by_index[i].without_abort()
        if req.kind == "ws":
            alone = (await run_ws_session(run.client, [req], run.cfg.request_timeout))[0]
        else:
            alone = await run.client.run(req)
        verdict = judge(req, alone)
        diff = "; ".join(alone.errors) if verdict != "ok" else compare_outputs(run.outcomes[i], alone)
        if diff is not None:
            mismatches.append(
                {"index": i, "kind": req.kind, "n": req.n, "max_tokens": req.max_tokens, "adapter": req.adapter}
                | {"detail": diff}
            )
    return {"candidates": len(candidates), "checked": len(sample), "mismatches": mismatches}


def _summary(plan: SoakPlan, run: _Run, verdicts: dict[int, str]) -> dict[str, Any]:
    per_kind: dict[str, Counter] = {k: Counter() for k in KINDS}
    per_adapter: dict[str, Counter] = {}
    latency: dict[str, list[float]] = {k: [] for k in KINDS}
    ttft: dict[str, list[float]] = {k: [] for k in KINDS}
    tokens = 0
    for req in plan.requests:
        out, verdict, c = run.outcomes[req.index], verdicts[req.index], per_kind[req.kind]
        c["requests"] += 1
        c[verdict] += 1
        if plan.adapters:
            per_adapter.setdefault(req.adapter or "(base model)", Counter())[verdict] += 1
        c["abort_planned"] += req.abort is not None
        c["abort_sent"] += out.abort_sent
        c["abort_raced"] += out.abort_sent and verdict == "ok"  # the request finished first: checked
        c["abort_not_reached"] += req.abort is not None and not out.abort_sent  # ended before the abort point
        c["collateral_aborts"] += out.collateral
        if verdict == "ok":
            tokens += req.n * req.max_tokens
            latency[req.kind].append(out.latency)
            if out.ttft is not None:
                ttft[req.kind].append(out.ttft)
    totals: Counter = Counter()
    for c in per_kind.values():
        totals.update(c)
    return {
        "totals": dict(totals),
        "per_endpoint": {k: dict(c) for k, c in per_kind.items()},
        **({"per_adapter": {k: dict(c) for k, c in sorted(per_adapter.items())}} if plan.adapters else {}),
        "checked_tokens": tokens,
        "latency_s": {k: percentiles(v) for k, v in latency.items()},
        "ttft_s": {k: percentiles(v) for k, v in ttft.items() if v},
    }


async def _idle_point(client: SoakClient, cfg: SoakConfig, baseline: int) -> dict[str, Any]:
    """Wait for idle; what the server then says about its engine, admission slots and memory."""
    _, st = await wait_idle(client, cfg.idle_timeout, baseline)
    inflight = st.get("inflight_generations")
    return {
        "engine_idle": "error" not in st
        and not any(st.get(k) for k in ("running_requests", "waiting_requests", "protected_tokens")),
        "inflight_generations": inflight,
        "slots_released": inflight is not None and inflight <= baseline,
        "memory": memory_identity(st),
        "state": st,
    }


async def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """The whole run against `cfg.url`; the report (`report["passed"]` says whether it passed)."""
    plan = build_plan(
        cfg.num_requests,
        cfg.seed,
        cfg.abort_fraction,
        cfg.max_tokens,
        warmup_fraction=cfg.warmup_fraction,
        adapters=cfg.adapters,
    )
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        client = SoakClient(session, cfg.url, uuid.uuid4().hex[:8], headers, lora=bool(cfg.adapters))
        try:
            baseline = (await server_info(client)).get("inflight_generations") or 0
        except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError, KeyError, ValueError) as e:
            return {"passed": False, "error": f"the server at {cfg.url} does not answer: {type(e).__name__}: {e}"}
        run = _Run(cfg, plan, client)
        sampler = asyncio.create_task(run.sample_rss())
        try:
            return await _soak(cfg, plan, run, baseline)
        finally:
            sampler.cancel()


async def _soak(cfg: SoakConfig, plan: SoakPlan, run: _Run, baseline: int) -> dict[str, Any]:
    """Warm-up, idle check, the load, idle check, greedy re-runs, final checks; the report."""
    client = run.client
    t0 = time.perf_counter()
    await run.units(plan.units[: plan.warmup_units])
    load_time = time.perf_counter() - t0
    warm = await _idle_point(client, cfg, baseline)
    rss_warm = read_rss(cfg.server_pid) if cfg.server_pid else None
    anon_warm = read_rss(cfg.server_pid, "RssAnon") if cfg.server_pid else None
    t1 = time.perf_counter()
    await run.units(plan.units[plan.warmup_units :])
    load_time += time.perf_counter() - t1
    after_load = await _idle_point(client, cfg, baseline)
    verdicts = {r.index: judge(r, run.outcomes[r.index]) for r in plan.requests}
    greedy = await _greedy_reruns(run, verdicts)
    end = await _idle_point(client, cfg, baseline)
    flush = await flush_and_check(client)
    rss_end = read_rss(cfg.server_pid) if cfg.server_pid else None
    hwm_end = read_rss(cfg.server_pid, "VmHWM") if cfg.server_pid else None
    anon_end = read_rss(cfg.server_pid, "RssAnon") if cfg.server_pid else None
    health_status = await health(client)
    summary = _summary(plan, run, verdicts)
    failures = [e for r in plan.requests for e in run.outcomes[r.index].errors]
    growth = None if rss_warm is None or rss_end is None else (rss_end - rss_warm) / 2**20
    log = scan_log(cfg.server_log)
    checks = {
        "every_completed_request_exact": not failures,
        "greedy_matches_solo": not greedy["mismatches"],
        "engine_idle_after_warmup_and_load": warm["engine_idle"] and after_load["engine_idle"] and end["engine_idle"],
        "admission_slots_released": warm["slots_released"] and after_load["slots_released"] and end["slots_released"],
        "memory_identity_after_warmup": warm["memory"]["ok"],
        "memory_identity_at_end": end["memory"]["ok"],
        "flush_frees_everything": flush["ok"],
        "rss_growth_within_limit": None if growth is None else growth <= cfg.max_rss_growth_mb,
        "no_5xx": not client.server_errors,
        "every_4xx_has_openai_error_body": not client.bad_error_bodies,
        "bad_requests_get_their_4xx": not any(run.invalid),
        "no_tracebacks_in_server_log": None if log is None else log["tracebacks"] == 0,
        "healthy_at_end": health_status == 200,
    }
    return {
        "passed": all(v is not False for v in checks.values()),
        "checks": checks,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "api_key"},
        "duration_s": round(load_time, 2),  # sending the load (warm-up included), not the checks
        "warmup_requests": sum(len(u.requests) for u in plan.units[: plan.warmup_units]),
        "requests_per_s": round(cfg.num_requests / load_time, 3),
        "checked_tokens_per_s": round(summary["checked_tokens"] / load_time, 1),
        **summary,
        "failures": failures[:MAX_FAILURES_LISTED],
        "failures_total": len(failures),
        "server_errors_5xx": client.server_errors[:MAX_FAILURES_LISTED],
        "server_errors_5xx_total": len(client.server_errors),
        "bad_4xx_bodies": client.bad_error_bodies[:MAX_FAILURES_LISTED],
        "bad_requests": {"sent": len(run.invalid), "problems": [p for p in run.invalid if p][:MAX_FAILURES_LISTED]},
        "http_statuses": dict(sorted(client.statuses.items())),
        "greedy": greedy,
        "idle": {
            "inflight_generations_before": baseline,
            "after_warmup": _brief(warm),
            "after_load": _brief(after_load),
            "at_end": _brief(end),
        },
        "memory": {"after_warmup": warm["memory"], "at_end": end["memory"], "after_flush": flush},
        "state_after_load": after_load["state"],
        "rss_mb": {
            "after_warmup": None if rss_warm is None else round(rss_warm / 2**20, 1),
            "at_end": None if rss_end is None else round(rss_end / 2**20, 1),
            "peak_sampled": round(run.rss_peak / 2**20, 1) if run.rss_peak else None,
            "high_water_mark": None if hwm_end is None else round(hwm_end / 2**20, 1),  # VmHWM at the end
            # RSS less the mapped files (libraries the kernel may drop and page in again at will)
            "anon_growth": None if anon_warm is None or anon_end is None else round((anon_end - anon_warm) / 2**20, 1),
            "growth": None if growth is None else round(growth, 1),
            "limit": cfg.max_rss_growth_mb,
            "trend": run.rss_trend,
        },
        "server_log": log,
        "health": health_status,
    }


def _brief(point: dict[str, Any]) -> dict[str, Any]:
    return {"engine_idle": point["engine_idle"], "inflight_generations": point["inflight_generations"]}


def format_summary(report: dict[str, Any]) -> str:
    if "error" in report:
        return f"soak: FAILED: {report['error']}"
    t, rss, idle = report["totals"], report["rss_mb"], report["idle"]
    lines = [
        f"soak: {'PASSED' if report['passed'] else 'FAILED'} in {report['duration_s']} s "
        f"({report['requests_per_s']} requests/s)",
        f"  requests {t.get('requests', 0)}: ok {t.get('ok', 0)} (exact token counts checked), aborted "
        f"{t.get('aborted', 0)}, aborts raced by completion {t.get('abort_raced', 0)}, failed {t.get('failed', 0)}",
        f"  greedy re-runs alone: {report['greedy']['checked']} checked, {len(report['greedy']['mismatches'])} differ",
        f"  5xx: {report['server_errors_5xx_total']}; RSS after warm-up {rss['after_warmup']} MB, at end "
        f"{rss['at_end']} MB (growth {rss['growth']} MB, limit {rss['limit']}); health {report['health']}",
        f"  idle at end: engine {idle['at_end']['engine_idle']}, admission slots held "
        f"{idle['at_end']['inflight_generations']} (before the run: {idle['inflight_generations_before']})",
    ]
    lines += [f"  check failed: {k}" for k, v in report["checks"].items() if v is False]
    lines += [f"  {f}" for f in report["failures"][:10]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    where.add_argument("--launch", action="store_true", help="start `python -m server` on a free port for the run")
    p.add_argument("--model-path", default="smollm2-135m", help="with --launch (default: smollm2-135m)")
    p.add_argument(
        "--dtype",
        default="float32",
        help="with --launch (default float32: bf16 on CPU is not batch-invariant, so the greedy check needs fp32)",
    )
    p.add_argument("--server-arg", action="append", default=[], help="one more flag for the launched server (repeat)")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32, help="work units (a request or a ws session) at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--abort-fraction", type=float, default=0.3)
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens is drawn from 1..this")
    p.add_argument("--greedy-sample", type=int, default=20, help="greedy requests re-run alone at the end")
    p.add_argument("--server-pid", type=int, help="with --url: the server's pid, to check its RSS")
    p.add_argument(
        "--server-log", type=Path, help="the server's log, scanned for tracebacks (with --launch: where it is written)"
    )
    p.add_argument("--api-key")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    p.add_argument("--warmup-fraction", type=float, default=0.1, help="requests before the RSS baseline")
    p.add_argument("--report", type=Path, help="write the JSON report here")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument(
        "--num-lora-adapters",
        type=int,
        default=0,
        help="with --launch: this many random rank-8 adapters of the model, served with --enable-lora",
    )
    lora.add_argument(
        "--lora-adapter", action="append", default=[], help="with --url: an adapter the server has (repeat)"
    )
    args = p.parse_args(argv)
    if (args.num_lora_adapters and not args.launch) or (args.lora_adapter and args.launch):
        p.error("--num-lora-adapters goes with --launch, --lora-adapter with --url")
    if args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--num-requests, --concurrency and --max-tokens must be positive")
    if not 0 <= args.abort_fraction <= 1 or not 0 <= args.warmup_fraction < 1:
        p.error("--abort-fraction must be in [0, 1] and --warmup-fraction in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    import uvloop

    args = parse_args(argv)
    cfg = SoakConfig(
        url=args.url,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        seed=args.seed,
        abort_fraction=args.abort_fraction,
        max_tokens=args.max_tokens,
        greedy_sample=args.greedy_sample,
        server_pid=args.server_pid,
        server_log=args.server_log,
        api_key=args.api_key,
        max_rss_growth_mb=args.max_rss_growth_mb,
        warmup_fraction=args.warmup_fraction,
        progress=True,
        adapters=args.lora_adapter,
    )
    server = None
    if args.launch:
        extra = ["--dtype", args.dtype, *args.server_arg]
        if args.num_lora_adapters > 0:
            cfg.adapters = [f"soak-{i}" for i in range(args.num_lora_adapters)]
            extra += ["--enable-lora", "--lora-paths", *write_adapters(args.model_path, cfg.adapters)]
        if args.api_key:
            extra += ["--api-key", args.api_key]
        server = LaunchedServer(args.model_path, extra, args.server_log)
        print(f"starting {' '.join(server.cmd)} (log: {server.log_path})", file=sys.stderr, flush=True)
        try:
            server.start()
        except LaunchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        cfg.url, cfg.server_pid, cfg.server_log = server.url, server.pid, server.log_path
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            report = runner.run(run_soak(cfg))
        if server is not None:  # SIGTERM: a clean drain exits 0
            report["server_command"] = server.cmd
            report["server_exit_status"] = server.stop()
            report.setdefault("checks", {})["server_exits_cleanly"] = report["server_exit_status"] == 0
            report["passed"] = report["passed"] and report["server_exit_status"] == 0
    finally:
        if server is not None and server.alive():
            server.stop()
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(format_summary(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
