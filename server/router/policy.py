"""Which worker gets a request: round robin, shortest queue, and SGLang's cache-aware policy.

Pure (no I/O), so the choices can be unit-tested without servers. A policy sees the workers
with their health and the router's in-flight count, and returns one healthy worker or None.

Cache-aware (SGLang's router): each worker has an approximate radix tree of the routing texts
sent to it (server/router/tree.py). A request goes to the worker whose tree holds the longest
prefix of its text when that prefix is more than `cache_threshold` of the text (its KV cache
probably still holds it, so the prefill is mostly a cache hit); otherwise to the worker with the
smallest tree (spreading new prefixes over the workers' caches). When the load is imbalanced
(in-flight spread above both the absolute and the relative threshold) the cache is ignored and
the least loaded worker gets it: a hot prefix must not pile everything onto one worker.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from server.router.tree import ApproxRadixTree

POLICIES = ("cache_aware", "round_robin", "shortest_queue")


@dataclass(eq=False)
class Worker:
    """One engine server as the router sees it."""

    url: str
    healthy: bool = True
    inflight: int = 0  # requests the router sent there that have not finished
    # The router's admin journal (server/router/journal.py) up to which this worker's state is
    # known to be its siblings': None for a fresh process (restarted, or at a new address), which
    # needs the whole state restored before it routes.
    synced: int | None = 0
    sync_error: str = ""  # why the last attempt to bring it up to date failed


class Policy:
    """Base: `pick` returns a healthy worker (None when there is none)."""

    name = "base"

    def pick(self, workers: Sequence[Worker], text: str) -> Worker | None:
        raise NotImplementedError

    def forget(self, worker: Worker) -> None:
        """The worker went away (its cache with it): drop what the policy knows about it."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: Sequence[Worker], text: str) -> Worker | None:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return None
        return healthy[next(self._counter) % len(healthy)]


class ShortestQueue(Policy):
    """Fewest in-flight requests; ties rotate so idle workers share the work."""

    name = "shortest_queue"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: Sequence[Worker], text: str) -> Worker | None:
        return least_loaded([w for w in workers if w.healthy], next(self._counter))


def least_loaded(healthy: Sequence[Worker], rotate: int = 0) -> Worker | None:
    if not healthy:
        return None
    n = len(healthy)
    order = [healthy[(i + rotate) % n] for i in range(n)]
    return min(order, key=lambda w: w.inflight)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        max_tree_size: int = 1 << 20,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.trees: dict[str, ApproxRadixTree] = {}
        self._counter = itertools.count()

    def tree(self, worker: Worker) -> ApproxRadixTree:
        tree = self.trees.get(worker.url)
        if tree is None:
            tree = self.trees[worker.url] = ApproxRadixTree(self.max_tree_size)
        return tree

    def imbalanced(self, healthy: Sequence[Worker]) -> bool:
        loads = [w.inflight for w in healthy]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def pick(self, workers: Sequence[Worker], text: str) -> Worker | None:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return None
        rotate = next(self._counter)
        if not text or self.imbalanced(healthy):
            chosen = least_loaded(healthy, rotate)
        else:
            matches = [(self.tree(w).match(text), w) for w in healthy]
            best_len = max(m for m, _ in matches)
            if best_len / len(text) > self.cache_threshold:
                chosen = min((w for m, w in matches if m == best_len), key=lambda w: w.inflight)
            else:  # a new prefix: the emptiest cache, then the least loaded
                n = len(healthy)
                order = [healthy[(i + rotate) % n] for i in range(n)]
                chosen = min(order, key=lambda w: (self.tree(w).size, w.inflight))
        assert chosen is not None
        if text:
            self.tree(chosen).insert(text)
        return chosen

    def forget(self, worker: Worker) -> None:
        self.trees.pop(worker.url, None)


def make_policy(
    name: str,
    cache_threshold: float = 0.5,
    balance_abs_threshold: int = 32,
    balance_rel_threshold: float = 1.0001,
    max_tree_size: int = 1 << 20,
) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    if name == "cache_aware":
        return CacheAware(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size)
    raise ValueError(f"unknown load balance method {name!r}; choose from {POLICIES}")


def routing_text(path: str, body: object) -> str:
    """The text the policy routes on: the prompt (its first element for a batch), the chat
    messages' contents concatenated, or /generate's `text` / `input_ids` (ids joined as text,
    so token prompts sharing a prefix share a text prefix). Anything else routes on ""."""
    if not isinstance(body, dict):
        return ""
    if path.endswith("/chat/completions"):
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):  # content parts: their text
                parts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "".join(parts)
    prompt = body.get("prompt") if path.endswith("/completions") else body.get("text")
    if prompt is None and not path.endswith("/completions"):
        prompt = body.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route on its first element
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)) + " " if prompt else ""
    return ""


__all__ = [
    "POLICIES",
    "CacheAware",
    "Policy",
    "RoundRobin",
    "ShortestQueue",
    "Worker",
    "least_loaded",
    "make_policy",
    "routing_text",
]
