"""What the soak run checks: each request's outcome against its plan, greedy outputs against
their solo re-runs, and the server's state when idle (memory identity, admission slots, RSS,
health, its log).

A request that completed (whether or not an abort of ours raced it) must have finished every
choice by `length` with exactly `max_tokens` tokens by every count the protocol gives: ids,
logprob entries, the server's `completion_tokens`, usage (`n * max_tokens` for chat). An aborted
one is not counted, but any of its choices that did finish by `length` still must be exact, and
the server must never abort a request we did not.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp

from bench.soak_clients import Outcome, SoakClient
from bench.soak_plan import SoakRequest


def judge(req: SoakRequest, out: Outcome) -> str:
    """'ok', 'aborted' or 'failed'; what was wrong goes to `out.errors`."""
    if out.errors:
        return "failed"
    if out.disconnected or out.collateral:
        return "aborted"
    where = f"{req.kind} #{req.index}"
    aborted = any(ch.finish == "abort" for ch in out.choices)
    if aborted and not out.abort_sent:
        out.fail(f"{where}: aborted by the server although nobody aborted it")
        return "failed"
    for j, ch in enumerate(out.choices):
        if ch.finish == "abort":
            if ch.reported is not None and ch.reported > req.max_tokens:
                out.fail(f"{where}: choice {j} aborted after {ch.reported} tokens, more than max_tokens")
            continue
        if ch.finish is None and aborted:
            continue  # the abort ended the stream before this choice said anything final
        if ch.finish != "length":
            out.fail(f"{where}: choice {j} finished with {ch.finish!r}, expected 'length' (ignore_eos)")
            continue
        for what, value in (("tokens in the response", ch.counted), ("completion_tokens", ch.reported)):
            if value is not None and value != req.max_tokens:
                out.fail(f"{where}: choice {j} has {value} {what}, expected max_tokens={req.max_tokens}")
        if not req.kind.startswith("chat") and ch.counted is None:
            out.fail(f"{where}: choice {j} came without its token ids")
    if req.kind.startswith("chat") and not aborted:
        if out.usage_completion != req.n * req.max_tokens:
            out.fail(f"{where}: usage.completion_tokens={out.usage_completion}, expected {req.n}*{req.max_tokens}")
    if out.errors:
        return "failed"
    return "aborted" if aborted else "ok"


def compare_outputs(under_load: Outcome, alone: Outcome) -> str | None:
    """None when every choice has the same tokens (ids where both have them, else text)."""
    for j, (a, b) in enumerate(zip(under_load.choices, alone.choices)):
        if a.token_ids is not None and b.token_ids is not None:
            if a.token_ids != b.token_ids:
                k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
                k = min(len(a.token_ids), len(b.token_ids)) if k is None else k
                got, want = a.token_ids[k : k + 4], b.token_ids[k : k + 4]
                return f"choice {j}: token ids differ from position {k} ({got} under load, {want} alone)"
        elif a.text != b.text:
            k = next((i for i, (x, y) in enumerate(zip(a.text, b.text)) if x != y), min(len(a.text), len(b.text)))
            return f"choice {j}: text differs from character {k} ({a.text[k : k + 30]!r} vs {b.text[k : k + 30]!r})"
    return None


# ---- the server's state ---------------------------------------------------------------------


async def server_info(client: SoakClient) -> dict[str, Any]:
    async with client.session.get(client.base + "/get_server_info", headers=client.headers) as r:
        client.statuses[f"/get_server_info {r.status}"] += 1
        if r.status != 200:
            raise RuntimeError(f"/get_server_info answered {r.status}: {(await r.text())[:300]}")
        info = await r.json()
    state = dict(info["internal_states"][0])
    state["inflight_generations"] = info.get("inflight_generations")
    return state


def _engine_idle(st: dict[str, Any]) -> bool:
    return not any(st.get(k) for k in ("running_requests", "waiting_requests", "protected_tokens"))


async def wait_idle(
    client: SoakClient, timeout: float, inflight_baseline: int = 0, settle: float = 5.0
) -> tuple[bool, dict[str, Any]]:
    """(idle?, the last state). Idle: the engine runs, queues and locks nothing (waited for up to
    `timeout`), and the HTTP layer holds no more admission slots than before the run (given
    `settle` seconds more: a slot still held then, with the engine idle, is leaked)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    settled: float | None = None
    while True:
        try:
            st = await server_info(client)
        except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError, KeyError, ValueError) as e:
            return False, {"error": f"/get_server_info: {type(e).__name__}: {e}"}
        engine_idle = _engine_idle(st)
        released = (st.get("inflight_generations") or 0) <= inflight_baseline
        if engine_idle and released:
            return True, st
        if engine_idle and settled is None:
            settled = loop.time() + settle
        if loop.time() > deadline or (settled is not None and loop.time() > settled):
            return False, st
        await asyncio.sleep(0.05)


MEMORY_KEYS = ("total_tokens", "available_tokens", "evictable_tokens", "protected_tokens", "memory_errors")


def memory_identity(st: dict[str, Any]) -> dict[str, Any]:
    """free + cached (evictable) + used (protected) == total, nothing used, no idle-check errors."""
    facts = {k: st.get(k) for k in MEMORY_KEYS}
    problems = []
    if None in (facts["total_tokens"], facts["available_tokens"], facts["evictable_tokens"]):
        problems.append("the server does not report total/available/evictable tokens")
    else:
        used = facts["protected_tokens"] or 0
        lhs = facts["available_tokens"] + facts["evictable_tokens"] + used
        if lhs != facts["total_tokens"]:
            problems.append(f"available + evictable + protected = {lhs} != total = {facts['total_tokens']}")
        if used:
            problems.append(f"{used} tokens still protected (locked) while idle")
    if facts["memory_errors"]:
        problems.append(f"the scheduler's idle check found leaks: {facts['memory_errors'][:3]}")
    if st.get("message_errors"):
        problems.append(f"{st['message_errors']} actor message errors")
    return {**facts, "message_errors": st.get("message_errors"), "ok": not problems, "problems": problems}


async def flush_and_check(client: SoakClient) -> dict[str, Any]:
    """After /flush_cache an idle server must have every KV slot free."""
    try:
        async with client.session.post(client.base + "/flush_cache", headers=client.headers) as r:
            client.statuses[f"/flush_cache {r.status}"] += 1
            status, text = r.status, await r.text()
        if status != 200:
            return {"ok": False, "problems": [f"/flush_cache answered {status}: {text[:300]}"]}
        st = await server_info(client)
    except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError, KeyError, ValueError) as e:
        return {"ok": False, "problems": [f"{type(e).__name__}: {e}"]}
    avail, total, cached = st.get("available_tokens"), st.get("total_tokens"), st.get("evictable_tokens")
    ok = avail == total and not cached
    problems = [] if ok else [f"after /flush_cache: available={avail} of {total}, evictable={cached}"]
    return {"available_tokens": avail, "total_tokens": total, "ok": ok, "problems": problems}


async def health(client: SoakClient) -> int | str:
    try:
        async with client.session.get(client.base + "/health", headers=client.headers) as r:
            client.statuses[f"/health {r.status}"] += 1
            return r.status
    except Exception as e:  # the server is gone: that is the finding
        return f"{type(e).__name__}: {e}"


def read_rss(pid: int, field: str = "VmRSS") -> int | None:
    """The process's resident set in bytes (VmRSS; VmHWM: its peak so far), or None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_TRACEBACK = re.compile(r"^Traceback \(most recent call last\)", re.M)
_ERROR_LINE = re.compile(r"^.* (ERROR|CRITICAL) .*$", re.M)


def scan_log(path: Path | None) -> dict[str, Any] | None:
    """Tracebacks and error lines the server logged (each is a finding)."""
    if path is None or not path.exists():
        return None
    text = path.read_text(errors="replace")
    errors = _ERROR_LINE.findall(text)
    lines = [m.group(0)[:300] for m in _ERROR_LINE.finditer(text)]
    return {"tracebacks": len(_TRACEBACK.findall(text)), "error_lines": len(errors), "first_error_lines": lines[:5]}


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    xs = sorted(values)

    def q(p: float) -> float:
        return round(xs[min(len(xs) - 1, int(p * len(xs)))], 4)

    mean = round(sum(xs) / len(xs), 4)
    return {"count": len(xs), "mean": mean, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(xs[-1], 4)}
