"""`RadixCache` (RadixAttention): the prefix cache shared across requests.

The radix tree maps token sequences to the KV slots that already hold their keys and values, so a
new request whose prompt starts with a cached prefix only computes the rest. Edges are compressed
(one node holds a run of tokens and the same number of slots). With `page_size > 1` the tree only
ever holds whole pages: keys are truncated to a multiple of `page_size` and children are keyed by
their first page, because the allocator hands out and frees whole pages.

Ownership. A KV slot is owned by exactly one of: the allocator's free list, the tree, or one
running request (its "own" slots: the part of its `req_to_token` row past the tree prefix it
points into). Tree nodes are either *protected* (`lock_ref > 0`: some running request reads them)
or *evictable* (unlocked; `evict` may free them, leaves first, least recently used first).

Locking protocol (as in SGLang): when the scheduler admits a request whose `last_node` came from
`match_prefix`, it calls `inc_lock_ref(req.last_node)`; `cache_unfinished_req` moves that lock to
the request's new node and `cache_finished_req` releases it. A chunked request continues with
`req.init_next_round_input()` *without* the tree cache: its `prefix_indices` (set by
`cache_unfinished_req`) already cover every committed position, including its own tail.

Only computed KV enters the tree. A request's slots are committed when its batch is planned, but
their KV exists only once that forward completed (`kv_computed_len`, advanced by the scheduler
when it processes a result). A forward that fails, or a request aborted or retracted while its
forward is still running, leaves committed-but-uncomputed slots: they are freed, never inserted,
so no later request can match a prefix whose KV was never written. The tree part of a request's
row is the path to its `last_node` (`_tree_len`), whatever its own tail's length.

Namespaces (multi-LoRA). KV computed under a LoRA adapter differs from the base model's for the
same tokens, so each adapter's prefixes live under a root of their own, keyed by the registry's
`cache_key` (0: the base model, `self.root`): `match_prefix` and `insert` take the namespace, and
a request's hand-off uses its `lora_key`. Roots are the nodes without a parent; nothing is ever
shared across them. `drop_namespace` frees an unloaded adapter's whole tree.

Invariant the scheduler checks when idle (no running, no chunked request):

    allocator.available_size() + cache.evictable_size() + cache.protected_size() == allocator.size
    and req_to_token_pool.available_size() == req_to_token_pool.size

While requests run, their own slots (rounded up to whole pages) make up the difference.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from engine.cache.base_prefix_cache import (
    BasePrefixCache,
    CacheableReq,
    PrefixSummary,
    committed_tokens,
    empty_slots,
)
from engine.cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

ChildKey = int | tuple[int, ...]
PREFIX_HEAD_TOKENS = 24  # token ids of a prefix shown in a summary


class TreeNode:
    """One compressed edge of the radix tree: `key` tokens stored at `value` slots."""

    _ids = itertools.count()

    __slots__ = ("children", "hit_count", "id", "key", "last_access_time", "lock_ref", "parent", "value")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.id = next(TreeNode._ids)  # tie-breaker for the eviction heap
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[ChildKey, TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = 0
        self.hit_count = 0  # admitted requests that reused this node (the dashboard's radix summary)

    def is_leaf(self) -> bool:
        return not self.children

    def __lt__(self, other: TreeNode) -> bool:
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref})"


class RadixCache(BasePrefixCache):
    """Radix tree over token ids whose values are KV slots (SGLang's RadixAttention cache)."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
    ) -> None:
        if page_size != token_to_kv_pool_allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {token_to_kv_pool_allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        # A logical clock, not wall time: deterministic LRU order, no ties from coarse timers.
        self._clock = itertools.count(1)
        self.reset_tree()

    # ---- tree bookkeeping ---------------------------------------------------------------------

    def reset_tree(self) -> None:
        """Forget the tree without freeing anything (construction; `reset` frees first)."""
        self.root = TreeNode([], empty_slots(), None)
        self.root.lock_ref = 1  # never evicted, never counted
        self.roots: dict[int, TreeNode] = {0: self.root}  # by namespace (see the module docstring)
        self._evictable = 0
        self._protected = 0

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} protected tokens (requests still locked)")
        slots = [node.value for node in self._nodes()]
        if slots:
            self.token_to_kv_pool_allocator.free(torch.cat(slots))
        self.reset_tree()

    def _nodes(self) -> list[TreeNode]:
        """Every node but the root."""
        out, stack = [], [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _child_key(self, key: list[int]) -> ChildKey:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of `a` and `b`, in whole pages."""
        n = min(len(a), len(b))
        if self.page_size == 1:
            i = 0
            while i < n and a[i] == b[i]:
                i += 1
            return i
        ps, i = self.page_size, 0
        while i + ps <= n and a[i : i + ps] == b[i : i + ps]:
            i += ps
        return i

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child` after `at` tokens; return the new upper node (which inherits the locks)."""
        upper = TreeNode(child.key[:at], child.value[:at].clone(), child.parent)
        upper.lock_ref = child.lock_ref  # same requests read both halves
        upper.last_access_time = child.last_access_time
        upper.hit_count = child.hit_count  # every hit on the whole edge was a hit on its upper part
        child.key = child.key[at:]
        child.value = child.value[at:].clone()
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        assert upper.parent is not None
        upper.parent.children[self._child_key(upper.key)] = upper
        return upper

    # ---- match / insert -----------------------------------------------------------------------

    def _root(self, namespace: int) -> TreeNode:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = TreeNode([], empty_slots(), None)
            root.lock_ref = 1
        return root

    def drop_namespace(self, namespace: int) -> int:
        """Free every prefix cached under `namespace` (an adapter unloaded: no request can use
        them again); returns the tokens freed. None of them may be locked."""
        root = self.roots.get(namespace)
        if root is None or namespace == 0:
            return 0
        nodes, stack = [], list(root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        if any(n.lock_ref for n in nodes):
            raise RuntimeError(f"drop_namespace({namespace}) with prefixes still locked by requests")
        del self.roots[namespace]
        freed = sum(len(n.value) for n in nodes)
        self._evictable -= freed
        if nodes:
            self.token_to_kv_pool_allocator.free(torch.cat([n.value for n in nodes]))
        return freed

    def match_prefix(self, key: list[int], namespace: int = 0) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached page-aligned prefix in `namespace`; splits a node so the result ends at a node."""
        return self._walk(key, namespace)

    def _walk(self, key: list[int], namespace: int) -> tuple[torch.Tensor, TreeNode]:
        key = key[: self._aligned(len(key))]
        now = next(self._clock)
        node, values = self._root(namespace), []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[n:]
        return (torch.cat(values) if values else empty_slots()), node

    def insert(self, key: list[int], value: torch.Tensor, namespace: int = 0) -> int:
        """Insert the page-aligned part of `key -> value`; return the length already present.

        For the already-present part the tree keeps its own slots: the caller still owns (and must
        free) its `value[:returned_len]` unless those are the tree's slots already.
        """
        if len(value) < len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(value)} slots")
        n_keep = self._aligned(len(key))
        key, value = key[:n_keep], value[:n_keep]
        now = next(self._clock)
        node, present = (self._root(namespace) if key else self.root), 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            present += n
            key, value = key[n:], value[n:]
            node = self._split(child, n) if n < len(child.key) else child
        if key:
            leaf = TreeNode(list(key), value.to(torch.int64).clone(), node)
            leaf.last_access_time = now
            node.children[self._child_key(key)] = leaf
            self._evictable += len(key)
        return present

    # ---- request hand-off ---------------------------------------------------------------------

    @staticmethod
    def _tree_len(req: CacheableReq) -> int:
        """Leading positions of `req`'s row that point at tree slots: the path to its `last_node`
        (its row may go on with its own slots, however many: see `cache_unfinished_req`)."""
        length, node = 0, req.last_node
        while node is not None and node.parent is not None:
            length += len(node.key)
            node = node.parent
        return length

    def exclusive_start(self, req: CacheableReq) -> int:
        """The first position of `req`'s row no other running request reads: the start of the
        deepest run of nodes on its path that only it has locked (its own tail is its alone)."""
        start, node = self._tree_len(req), req.last_node
        while node is not None and node.parent is not None and node.lock_ref == 1:
            start -= len(node.key)
            node = node.parent
        return start

    def _insertable(self, req: CacheableReq, token_ids: list[int], tree_len: int) -> int:
        """How many leading tokens of `req` may enter the tree: known, computed, page-aligned (and
        never fewer than its tree prefix, which is computed KV by construction)."""
        return max(self._aligned(min(len(token_ids), req.kv_computed_len)), tree_len)

    def cache_finished_req(self, req: CacheableReq) -> None:
        """Insert the request's computed tokens, free what the tree does not take, drop its row.

        The last sampled token has no KV yet, so the key is at most the first `kv_committed_len`
        tokens; KV not computed yet (a failed or still running forward) is freed, not inserted.
        """
        row = req.req_pool_idx
        if row is None:
            raise ValueError(f"cache_finished_req: {req!r} holds no req_to_token row")
        committed = req.kv_committed_len
        token_ids = committed_tokens(req)
        kv = self.req_to_token_pool.req_to_token[row, :committed].to(torch.int64)
        alloc = self.token_to_kv_pool_allocator
        tree_len = self._tree_len(req)
        n = self._insertable(req, token_ids, tree_len)
        present = self.insert(token_ids[:n], kv[:n], req.lora_key)
        alloc.free(kv[tree_len:present])  # our duplicates of what the tree had
        alloc.free(kv[n:])  # the tail: unaligned, uncomputed, or without a known token
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        self.dec_lock_ref(req.last_node)
        req.last_node = None

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Share a running request's computed prefix and point the request at the tree's slots.

        After this, `req.prefix_indices` covers all `kv_committed_len` positions: the tree's
        page-aligned computed part followed by the request's own tail (still owned by it).
        """
        row = req.req_pool_idx
        if row is None:
            raise ValueError(f"cache_unfinished_req: {req!r} holds no req_to_token row")
        committed = req.kv_committed_len
        token_ids = committed_tokens(req)
        kv = self.req_to_token_pool.req_to_token[row, :committed].to(torch.int64)
        tree_len = self._tree_len(req)
        n = self._insertable(req, token_ids, tree_len)
        present = self.insert(token_ids[:n], kv[:n], req.lora_key)
        self.token_to_kv_pool_allocator.free(kv[tree_len:present])
        new_indices, new_node = self._walk(token_ids[:n], req.lora_key)
        assert len(new_indices) == n, "a just-inserted key must match in full"
        self.req_to_token_pool.write(row, 0, new_indices)
        req.prefix_indices = torch.cat([new_indices, kv[n:]])
        self.inc_lock_ref(new_node)  # before dec, so the shared path never looks unlocked
        self.dec_lock_ref(req.last_node)
        req.last_node = new_node

    # ---- locks and eviction -------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.value)
                self._protected += len(node.value)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.value)
                self._evictable += len(node.value)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until `num_tokens` are freed.

        A parent whose last child goes becomes a candidate itself, so whole cold branches go.
        Returns the number of tokens freed (may exceed `num_tokens` by part of a node, or fall
        short when everything left is locked).
        """
        heap = [n for n in self._nodes() if n.is_leaf() and n.lock_ref == 0]
        heapq.heapify(heap)
        freed, to_free = 0, []
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            to_free.append(node.value)
            freed += len(node.value)
            self._evictable -= len(node.value)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key)]
            if parent.parent is not None and parent.is_leaf() and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        if to_free:
            self.token_to_kv_pool_allocator.free(torch.cat(to_free))
        return freed

    def record_hit(self, node: TreeNode | None) -> None:
        """An admitted request reuses the path to `node`: count a hit on each node of it."""
        while node is not None and node.parent is not None:
            node.hit_count += 1
            node = node.parent

    def top_prefixes(self, k: int = 10) -> list[PrefixSummary]:
        """The cached prefixes an operator wants to see: the `k` most hit and the `k` largest
        subtrees (by tokens below and including the node), most hit first."""
        subtree: dict[int, int] = {}
        depth: dict[int, int] = {root.id: 0 for root in self.roots.values()}
        nodes = self._nodes()  # parents before children (a stack walk from the root)
        for node in nodes:
            depth[node.id] = depth[node.parent.id] + len(node.key)  # type: ignore[union-attr]
        for node in reversed(nodes):  # children before parents
            subtree[node.id] = subtree.get(node.id, 0) + len(node.key)
            if node.parent.parent is not None:  # type: ignore[union-attr]
                subtree[node.parent.id] = subtree.get(node.parent.id, 0) + subtree[node.id]  # type: ignore[union-attr]
        by_hits = sorted((n for n in nodes if n.hit_count), key=lambda n: (-n.hit_count, -depth[n.id]))[:k]
        by_size = sorted((n for n in nodes if n.parent.parent is None), key=lambda n: -subtree[n.id])[:k]
        chosen = list({n.id: n for n in [*by_hits, *by_size]}.values())
        chosen.sort(key=lambda n: (-n.hit_count, -subtree[n.id]))
        return [
            PrefixSummary(self._path_head(n), depth[n.id], subtree[n.id], n.hit_count, n.lock_ref > 0) for n in chosen
        ]

    def _path_head(self, node: TreeNode, n: int = PREFIX_HEAD_TOKENS) -> list[int]:
        """The first `n` token ids of the path from the root to `node`."""
        path: list[TreeNode] = []
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        head: list[int] = []
        for part in reversed(path):
            head.extend(part.key[: n - len(head)])
            if len(head) >= n:
                break
        return head

    # ---- sizes and debugging ------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def all_values(self) -> torch.Tensor:
        """Every slot held by the tree (for invariant checks)."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else empty_slots()

    def pretty_print(self) -> str:
        """Indented dump of the tree; returned (and printed) for debugging."""
        lines: list[str] = [f"root (evictable={self._evictable}, protected={self._protected})"]

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.key):
                head = child.key[:8]
                more = "..." if len(child.key) > 8 else ""
                lines.append(
                    f"{'  ' * depth}{head}{more} len={len(child.key)} lock={child.lock_ref} t={child.last_access_time}"
                )
                walk(child, depth + 1)

        walk(self.root, 1)
        text = "\n".join(lines)
        print(text)
        return text
