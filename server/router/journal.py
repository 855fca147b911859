"""What the state-changing admin calls made of the workers, so that a worker that missed some is
brought to its siblings' state before it is routed to again.

Every worker behind a router must serve the same weights, the same LoRA adapters, and be paused
or released alike: a rollout that lands on a replica still serving the old policy, or a request
naming an adapter that one replica never loaded, is silently wrong. The router sends these calls
to every healthy worker (server/router/broadcast.py) and records each one that succeeded
anywhere. A worker can then be behind in two ways:

- It missed calls: it was unhealthy when they were sent, or it answered one with an error (an
  unload it refused while its requests used the adapter, a checkpoint it could not read). It is
  held out of routing, and the calls it missed are replayed on it, in order, at each health round
  until they succeed (`missed`).
- It is a fresh process (a --dp-size replica restarted by its supervisor, or one that moved to
  another address): it holds its command line's state, so the journal's net effect since start-up
  is replayed on it (`restore`): the last weight update, the adapters loaded and unloaded since,
  the memory still released, a pause still in force.

A weight update is recorded with the `weight_version` the workers reported, so a replay gives the
caught-up worker the same version string as its siblings. Only what passes through the router is
known: weights a trainer broadcast to each replica's own URL (`/update_weights_from_distributed`)
cannot be replayed, so after its replays a worker must also report the `weight_version` a healthy
sibling reports (GET /get_model_info); one that does not stays out, saying so, until the trainer
sends it the weights too. A standalone router cannot tell a worker restarted at the same address
from one that was briefly unreachable (it replays what that worker missed, not the whole state).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

STATE_ROUTES = (
    "/update_weights_from_disk",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/pause_generation",
    "/continue_generation",
)
MEMORY_TAGS = ("kv_cache", "weights")  # a release/resume without tags means both

Call = tuple[str, dict[str, Any]]  # (path, JSON body)


def parse_body(body: bytes) -> dict[str, Any]:
    """A successful call's body as a dict (these routes take an object or nothing)."""
    if not body.strip():
        return {}
    parsed = json.loads(body)
    return parsed if isinstance(parsed, dict) else {}


@dataclass
class _Adapter:
    """One adapter name's net effect: whether the first call about it was an unload (it was
    loaded at start-up), and the load in force now (None: not loaded)."""

    unloaded_first: bool
    load: dict[str, Any] | None = None


@dataclass
class AdminJournal:
    """The calls since start-up, numbered from 1 (`seq` is the last one), and their net effect.

    Invariant: a worker the router routes to has `synced == seq`. Calls every worker has applied
    are dropped (`trim`); the net effect is kept whole."""

    seq: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one broadcast or one replay at a time
    _calls: list[tuple[int, Call]] = field(default_factory=list)
    _weights: dict[str, Any] | None = None
    _adapters: dict[str, _Adapter] = field(default_factory=dict)
    _released: set[str] = field(default_factory=set)
    _paused: dict[str, Any] | None = None

    def record(self, path: str, body: dict[str, Any], answer: dict[str, Any]) -> int:
        """A call that succeeded on some worker (`answer`: the first success's body); -> its seq."""
        if path == "/update_weights_from_disk":
            body = {**body, "weight_version": answer.get("weight_version", body.get("weight_version"))}
            self._weights = body
            self._released.discard("weights")  # a checkpoint loaded is weights resumed (the engine's rule)
        elif path == "/load_lora_adapter":
            name = str(body.get("lora_name"))
            self._adapters.setdefault(name, _Adapter(unloaded_first=False)).load = body
        elif path == "/unload_lora_adapter":
            name = str(body.get("lora_name"))
            adapter = self._adapters.setdefault(name, _Adapter(unloaded_first=True))
            adapter.load = None
            if not adapter.unloaded_first:  # loaded since start-up, now gone: no net effect
                del self._adapters[name]
        elif path in ("/release_memory_occupation", "/resume_memory_occupation"):
            tags = set(body.get("tags") or MEMORY_TAGS)
            self._released = self._released | tags if path.startswith("/release") else self._released - tags
        elif path == "/pause_generation":
            self._paused = body
        elif path == "/continue_generation":
            self._paused = None
        self.seq += 1
        self._calls.append((self.seq, (path, body)))
        return self.seq

    def missed(self, synced: int) -> list[tuple[int, Call]]:
        """The calls after `synced`, in order, each with its seq."""
        return [(seq, call) for seq, call in self._calls if seq > synced]

    def restore(self) -> list[Call]:
        """The calls that give a fresh worker the net state: weights first (a fresh worker holds
        them), then adapters (unloads before loads, so the slots they free are there), then the
        memory still released, then a pause still in force."""
        calls: list[Call] = []
        if self._weights is not None:
            calls.append(("/update_weights_from_disk", self._weights))
        calls += [("/unload_lora_adapter", {"lora_name": n}) for n, a in self._adapters.items() if a.unloaded_first]
        calls += [("/load_lora_adapter", a.load) for a in self._adapters.values() if a.load is not None]
        if self._released:
            calls.append(("/release_memory_occupation", {"tags": sorted(self._released)}))
        if self._paused is not None:
            calls.append(("/pause_generation", self._paused))
        return calls

    def trim(self, synced: list[int | None]) -> None:
        """Drop the calls every worker that is not fresh has applied (a fresh one is restored)."""
        known = [s for s in synced if s is not None]
        oldest = min(known, default=self.seq)
        self._calls = [(seq, call) for seq, call in self._calls if seq > oldest]


__all__ = ["MEMORY_TAGS", "STATE_ROUTES", "AdminJournal", "Call", "parse_body"]
