"""The soak run's WebSocket client: one socket per work unit, several generations on it at once
(sent at their planned offsets), each tagged `g<index>`, read by one loop.

Abort plans: `ws_cancel` sends `{"type": "cancel"}` once the generation has had its planned number
of output deltas (the server must answer with one final `abort` delta per unfinished choice, or
with a 404 error when the generation had already finished: a race, not a failure);
`ws_close` closes the whole socket at that point, which must abort everything still running on
it: the other unfinished generations are recorded as collateral aborts.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.soak_clients import Choice, Outcome, SoakClient
from bench.soak_plan import SoakRequest


@dataclass
class _Gen:
    req: SoakRequest
    out: Outcome
    sent_at: float = 0.0
    deltas: int = 0  # deltas that carried output
    finished: set[int] = field(default_factory=set)
    cancel_sent: bool = False


def _generate_msg(gen_id: str, req: SoakRequest) -> dict[str, Any]:
    sp = {"max_new_tokens": req.max_tokens, "temperature": req.temperature, "ignore_eos": True, "n": req.n}
    msg = {"type": "generate", "id": gen_id, "text": req.text, "sampling_params": sp}
    return msg | ({"lora_path": req.adapter} if req.adapter is not None else {})


class _Session:
    def __init__(self, client: SoakClient, reqs: list[SoakRequest]) -> None:
        self.client = client
        self.gens = {
            f"g{r.index}": _Gen(r, Outcome(r.index, "ws", [Choice(token_ids=[], counted=0) for _ in range(r.n)]))
            for r in reqs
        }
        self.pending = set(self.gens)
        self.close_now = False
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._lock = asyncio.Lock()

    def fail_pending(self, message: str) -> None:
        for gid in sorted(self.pending):
            self.gens[gid].out.fail(f"/ws #{self.gens[gid].req.index}: {message}")
        self.pending.clear()

    async def send(self, obj: dict[str, Any]) -> None:
        async with self._lock:  # frames from the sender and the reader must not interleave
            await self.ws.send_str(json.dumps(obj))

    async def trigger(self, gid: str, g: _Gen) -> None:
        """Carry out g's abort plan now."""
        g.out.abort_sent = True
        if g.req.abort.mode == "ws_cancel":
            g.cancel_sent = True
            await self.send({"type": "cancel", "id": gid})
        else:
            self.close_now = True

    async def sender(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for gid, g in sorted(self.gens.items(), key=lambda kv: kv[1].req.ws_offset):
            await asyncio.sleep(max(0.0, t0 + g.req.ws_offset - loop.time()))
            g.sent_at = time.perf_counter()
            await self.send(_generate_msg(gid, g.req))
            if g.req.abort is not None and g.req.abort.after_chunks == 0:
                await self.trigger(gid, g)

    async def on_message(self, data: dict[str, Any]) -> None:
        gid, g = data.get("id"), self.gens.get(data.get("id"))
        if data.get("type") == "error":
            err = data.get("error")
            if g is not None and g.cancel_sent and isinstance(err, dict) and err.get("code") == 404:
                return  # the cancel raced the generation's end: it finished normally
            if g is None:  # not about one generation: it fails every running one
                for other in sorted(self.pending):
                    self.client.error_event("/ws", err, self.gens[other].out)
                self.pending.clear()
                return
            self.client.error_event("/ws", err, g.out)
            self.pending.discard(gid)
            return
        if data.get("type") != "delta" or g is None:
            self.fail_pending(f"an unexpected message: {json.dumps(data)[:300]}")
            return
        i = data.get("index") or 0
        ch = g.out.choices[i]
        ids, text = data.get("token_ids") or [], data.get("text") or ""
        ch.text += text
        ch.token_ids += ids
        ch.counted += len(ids)
        if ids or text:
            g.deltas += 1
            g.out.ttft = g.out.ttft or time.perf_counter() - g.sent_at
        reason = data.get("finish_reason")
        if reason is not None:
            if i in g.finished:
                g.out.fail(f"/ws #{g.req.index}: a second final delta for choice {i}")
            g.finished.add(i)
            ch.finish = reason.get("type")
            ch.reported = (data.get("meta_info") or {}).get("completion_tokens")
            if len(g.finished) == g.req.n:
                self.pending.discard(gid)
                g.out.latency = time.perf_counter() - g.sent_at
        plan = g.req.abort
        if plan is not None and not g.out.abort_sent and gid in self.pending and g.deltas >= plan.after_chunks:
            await self.trigger(gid, g)

    async def run(self, timeout: float) -> list[Outcome]:
        client = self.client
        try:
            self.ws = await client.session.ws_connect(client.base + "/ws", headers=client.headers, max_msg_size=0)
        except aiohttp.WSServerHandshakeError as e:
            client.statuses[f"/ws {e.status}"] += 1
            if e.status >= 500:
                client.server_errors.append(f"/ws handshake: HTTP {e.status}: {e.message}")
            self.fail_pending(f"handshake failed: HTTP {e.status}: {e.message}")
            return self.outcomes()
        except (aiohttp.ClientError, OSError) as e:
            self.fail_pending(f"cannot connect: {type(e).__name__}: {e}")
            return self.outcomes()
        client.statuses["/ws 101"] += 1
        send_task = asyncio.create_task(self.sender())
        closed_by_us = False
        try:
            async with asyncio.timeout(timeout):
                while self.pending:
                    if self.close_now:
                        await send_task
                        await self.ws.close()
                        closed_by_us = True
                        break
                    msg = await self.ws.receive()
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        break  # closed, closing or broken
                    await self.on_message(json.loads(msg.data))
        except TimeoutError:
            self.fail_pending(f"no end within {timeout:.0f} s")
        except Exception as e:  # a broken socket, or a message of an unexpected shape: a finding
            self.fail_pending(f"{type(e).__name__}: {e}")
        finally:
            if not send_task.done():
                send_task.cancel()
            await asyncio.gather(send_task, return_exceptions=True)
            if not self.ws.closed:
                await self.ws.close()
        if closed_by_us:
            for gid in self.pending:
                g = self.gens[gid]
                g.out.disconnected = True
                g.out.collateral = not g.out.abort_sent
            self.pending.clear()
        elif self.pending:
            code = self.ws.close_code
            if code is not None and code >= 1011:
                client.server_errors.append(f"/ws: the server closed the socket with code {code}")
            self.fail_pending(f"the socket closed with generations running (code {code})")
        return self.outcomes()

    def outcomes(self) -> list[Outcome]:
        return [g.out for g in self.gens.values()]


async def run_ws_session(client: SoakClient, reqs: list[SoakRequest], timeout: float) -> list[Outcome]:
    """Every generation of one WebSocket work unit, with their abort plans; never raises for the server."""
    return await _Session(client, reqs).run(timeout)
