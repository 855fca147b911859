"""RadixCache: insert/match, splits, eviction, pages (helpers and the slot-content tracking
simulation: radix_sim.py)."""

from __future__ import annotations

import pytest
import torch

from tests.radix_sim import Sim, check_idle, free_pages, make, new_req, slots

# ---- insert / match ---------------------------------------------------------------------------


def test_insert_match_and_split():
    _, _, cache = make()
    assert cache.insert([1, 2, 3, 4, 5], slots(11, 12, 13, 14, 15)) == 0
    assert cache.total_size() == cache.evictable_size() == 5

    vals, node = cache.match_prefix([1, 2, 3])
    assert vals.tolist() == [11, 12, 13] and vals.dtype == torch.int64
    assert node.key == [1, 2, 3] and len(node.children) == 1  # split: [1,2,3] -> [4,5]
    assert next(iter(node.children.values())).key == [4, 5]

    vals, node2 = cache.match_prefix([1, 2, 3, 9, 9])
    assert vals.tolist() == [11, 12, 13] and node2 is node

    vals, node3 = cache.match_prefix([7, 1])
    assert vals.numel() == 0 and node3 is cache.root

    assert cache.insert([1, 2, 3, 7, 8], slots(21, 22, 23, 27, 28)) == 3
    assert cache.total_size() == 7  # the duplicate [1,2,3] slots were not taken
    vals, _ = cache.match_prefix([1, 2, 3, 7, 8, 9])
    assert vals.tolist() == [11, 12, 13, 27, 28]
    vals, _ = cache.match_prefix([1, 2, 3, 4, 5])
    assert vals.tolist() == [11, 12, 13, 14, 15]
    assert cache.insert([1, 2], slots(31, 32)) == 2
    assert cache.total_size() == 7
    assert "[3] len=1" in cache.pretty_print()  # [1,2,3] split again by the [1,2] insert


def test_insert_split_inside_node_keeps_locks():
    _, _, cache = make()
    cache.insert([1, 2, 3, 4], slots(1, 2, 3, 4))
    _, leaf = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(leaf)
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.insert([1, 2, 9], slots(5, 6, 7))  # splits the locked node after [1, 2]
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    assert cache.evict(100) == 1  # only the new [9] leaf can go
    cache.dec_lock_ref(leaf)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(leaf)


def test_finished_requests_share_and_free_duplicates():
    sim = Sim()
    prompt = list(range(100, 110))
    a, b = new_req("a", prompt), new_req("b", prompt)
    assert sim.admit(a) and sim.admit(b)  # both admitted before either is cached: no sharing yet
    assert set(sim.row(a)).isdisjoint(sim.row(b))
    for r in (a, b):
        r.output_ids.append(7)
    assert sim.decode([a, b])  # KV for the token 7; committed = 11
    for r in (a, b):
        r.output_ids.append(8)  # sampled last: never gets KV
    a_slots = sim.row(a)
    sim.cache.cache_finished_req(a)
    assert a.req_pool_idx is None and sim.cache.total_size() == 11
    before = sim.alloc.available_size()
    sim.cache.cache_finished_req(b)
    assert sim.alloc.available_size() == before + 11  # all of b's were duplicates
    assert sim.cache.total_size() == 11
    check_idle(sim.cache, sim.pool, sim.alloc)

    c = new_req("c", prompt + [7, 8, 5])
    assert sim.admit(c)
    assert c.prefix_indices.tolist() == a_slots  # served from the tree, a's slots
    assert sim.cache.protected_size() == 11
    sim.check_running(c)
    c.output_ids.append(1)
    sim.cache.cache_finished_req(c)
    check_idle(sim.cache, sim.pool, sim.alloc)
    assert sim.cache.total_size() == 13


# ---- eviction ---------------------------------------------------------------------------------


def test_lru_eviction_order_and_locks():
    pool, alloc, cache = make()
    for key in ([1, 1, 1], [2, 2, 2, 2], [3, 3]):  # inserted a, b, c in that order
        assert cache.insert(key, alloc.alloc(len(key))) == 0
    cache.match_prefix([1, 1, 1])  # touch a: LRU order is now b, c, a
    assert cache.evict(1) == 4  # the whole b node goes, nothing else
    assert cache.match_prefix([2, 2])[0].numel() == 0
    assert cache.match_prefix([3, 3])[0].numel() == 2 and cache.match_prefix([1])[0].numel() == 1
    # match_prefix above touched c then a, and split a: a=[1] -> [1,1]
    _, node_a = cache.match_prefix([1, 1, 1])
    cache.inc_lock_ref(node_a)
    assert cache.evict(100) == 2  # only c; a is locked
    assert cache.total_size() == cache.protected_size() == 3
    assert cache.match_prefix([1, 1, 1])[0].numel() == 3
    cache.dec_lock_ref(node_a)
    assert cache.evict(100) == 3
    check_idle(cache, pool, alloc)
    assert alloc.available_size() == alloc.size


def test_evict_parents_become_leaves():
    pool, alloc, cache = make()
    cache.insert([1, 2, 3], alloc.alloc(3))
    dup = alloc.alloc(3)
    assert cache.insert([1, 2, 4], dup) == 2  # tree: [1,2] -> {[3], [4]}
    alloc.free(dup[:2])  # the caller's copies of [1, 2]
    _, leaf4 = cache.match_prefix([1, 2, 4])
    cache.inc_lock_ref(leaf4)
    assert cache.evict(10) == 1  # [3] only: [1,2] still has the locked child
    assert cache.evictable_size() == 0 and cache.protected_size() == 3
    cache.dec_lock_ref(leaf4)
    assert cache.evict(1) == 1  # exactly the [4] leaf; its parent is now a leaf but enough freed
    assert cache.total_size() == 2
    assert cache.evict(1) == 2  # the parent goes whole
    assert cache.total_size() == 0 and cache.root.is_leaf()
    check_idle(cache, pool, alloc)


def test_evict_frees_exactly_the_evicted_slots():
    pool, alloc, cache = make(kv_tokens=16)
    s1, s2 = alloc.alloc(5), alloc.alloc(6)
    cache.insert([1] * 5, s1)
    cache.insert([2] * 6, s2)
    free_before = set(free_pages(alloc))
    assert cache.evict(3) == 5
    assert set(free_pages(alloc)) == free_before | set(s1.tolist())
    cache.reset()
    check_idle(cache, pool, alloc)
    assert alloc.available_size() == alloc.size and cache.total_size() == 0


# ---- pages ------------------------------------------------------------------------------------


def test_page_size_4_aligns_keys_and_frees_tails():
    sim = Sim(ps=4, kv_tokens=64)
    prompt = list(range(1, 11))  # 10 tokens
    a = new_req("a", prompt)
    assert sim.admit(a) and a.kv_committed_len == 10
    a.output_ids.append(99)
    sim.cache.cache_finished_req(a)
    assert sim.cache.total_size() == 8  # 2 whole pages; the 2-token tail page was freed
    assert sim.alloc.available_size() == sim.alloc.size - 8
    check_idle(sim.cache, sim.pool, sim.alloc)

    vals, _ = sim.cache.match_prefix(prompt)
    assert len(vals) == 8
    vals, node = sim.cache.match_prefix(prompt[:6] + [0, 0, 0])  # diverges inside page 2
    assert len(vals) == 4 and node.key == prompt[:4]  # split on the page boundary only

    b = new_req("b", prompt[:9] + [50, 51, 52])
    assert sim.admit(b)
    assert len(b.prefix_indices) == 8
    assert all(s % 4 == i % 4 for i, s in enumerate(sim.row(b)))  # offsets within pages hold
    sim.check_running(b)
    b.output_ids.append(3)
    sim.cache.cache_finished_req(b)
    check_idle(sim.cache, sim.pool, sim.alloc)
    assert sim.cache.total_size() == 12
    assert sim.cache.insert([1, 2, 3], slots(5, 6, 7)) == 0  # shorter than a page: nothing stored
    assert sim.cache.total_size() == 12


def test_hit_counts_and_top_prefixes():
    """The dashboard's radix summary: hits counted per admitted reuse, inherited by a split's
    upper part, and the most hit / largest prefixes listed with their heads."""
    _, _, cache = make()
    cache.insert([1, 2, 3, 4, 5], slots(11, 12, 13, 14, 15))
    cache.insert([9, 8], slots(21, 22))
    _, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.record_hit(node)
    cache.record_hit(node)
    _, upper = cache.match_prefix([1, 2, 7])  # splits [1..5] after [1, 2]
    assert upper.key == [1, 2] and upper.hit_count == 2  # every hit on the edge hit its upper part
    cache.record_hit(upper)
    cache.record_hit(cache.root)  # no prefix: nothing to count
    top = cache.top_prefixes(k=5)
    assert [(p.head, p.tokens, p.hits) for p in top[:2]] == [([1, 2], 2, 3), ([1, 2, 3, 4, 5], 5, 2)]
    assert top[0].subtree_tokens == 5 and not top[0].locked
    assert any(p.head == [9, 8] and p.hits == 0 and p.subtree_tokens == 2 for p in top)  # large, never hit
    cache.inc_lock_ref(node)
    assert next(p for p in cache.top_prefixes() if p.head == [1, 2]).locked
    cache.dec_lock_ref(node)
