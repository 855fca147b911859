"""An approximate radix tree over characters, one per worker, for cache-aware routing.

It mirrors what a worker's prefix cache probably holds: the routing text of every request the
router sent there. It is approximate on purpose (characters, not the worker's tokens; no
knowledge of the worker's own evictions), which is what SGLang's router does too: cheap to
keep in the router, and good enough to send requests that share a prefix to the same worker.

The size (characters stored) is bounded: past `max_size` the least recently used leaves are
evicted, the way a worker's LRU cache would drop them.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    """One edge of the tree: `text` is the edge label leading into this node."""

    __slots__ = ("children", "last_access", "parent", "text")

    def __init__(self, text: str, parent: _Node | None, last_access: int) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.last_access = last_access


def _common_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ApproxRadixTree:
    """Insert texts, ask how long a prefix of a text is already held; bounded by LRU eviction."""

    def __init__(self, max_size: int = 1 << 20) -> None:
        self.max_size = max_size
        self.root = _Node("", None, 0)
        self.size = 0  # characters stored on all edges
        self._clock = itertools.count(1)  # logical time: monotonic and cheap, ties impossible

    def match(self, text: str) -> int:
        """Length of the longest prefix of `text` held in the tree (touches nothing)."""
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            common = _common_len(child.text, text[pos : pos + len(child.text)])
            pos += common
            if common < len(child.text):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        """Add `text` (marking its path most recently used), then evict past `max_size`."""
        text = text[: self.max_size]  # a single text can never hold more than the whole budget
        now = next(self._clock)
        node, pos = self.root, 0
        node.last_access = now
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node.children[text[pos]] = _Node(text[pos:], node, now)
                self.size += len(text) - pos
                break
            common = _common_len(child.text, text[pos : pos + len(child.text)])
            if common < len(child.text):  # split the edge: `mid` takes the shared part
                mid = _Node(child.text[:common], node, now)
                node.children[text[pos]] = mid
                child.text = child.text[common:]
                child.parent = mid
                mid.children[child.text[0]] = child
                child = mid
            child.last_access = now
            node, pos = child, pos + common
        if self.size > self.max_size:
            self.evict(self.size - self.max_size)

    def evict(self, chars: int) -> None:
        """Drop least recently used leaves until at least `chars` characters are gone."""
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < chars:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None:
                continue
            del parent.children[leaf.text[0]]
            freed += len(leaf.text)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.size -= freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def clear(self) -> None:
        self.root = _Node("", None, 0)
        self.size = 0


__all__ = ["ApproxRadixTree"]
