"""Find the KV prefixes that requests of one decode batch share, for cascade attention.

Requests that matched the same radix-cache prefix hold the *same* KV slots for those tokens
(the tree owns them; they are read-only while locked). A decode step that attends each request
over its whole sequence reads those shared rows once per request: for 8 groups of 8 requests on
a 512-token system prompt that is 8x the KV traffic the step needs, and KV reads are most of a
CPU decode step at long contexts. The cascade split (as FlashInfer's and vLLM's cascade
attention) reads each shared prefix once for all its requests (one GEMM with all their query
rows) and each request's own suffix separately, then merges the two softmax partials exactly.

`plan_shared_prefix` is the planning half: from the batch's slot table rows it finds groups of
requests with a common leading run of slots, and builds the padded index tensors every layer
reuses. It runs once per forward, on the host, and costs one comparison of the rows of each group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A group is worth its own GEMM when it saves at least this many KV rows per member.
MIN_SHARED_PREFIX = 32
# ...and the plan as a whole when it removes at least this share of the step's KV reads.
MIN_SAVED_FRACTION = 0.25


@dataclass
class SharedPrefixPlan:
    """Index tensors for one cascade decode step (n groups, B requests).

    Shapes: prefix part `[n, P]` (P = longest shared prefix), members `[n, M]` (M = largest group),
    suffix part `[B, S]` (S = longest per-request remainder). Padding entries hold valid slots or
    batch rows and are masked (prefix, suffix) or discarded (members).
    """

    num_groups: int
    max_prefix: int
    max_members: int
    prefix_slots: torch.Tensor  # [n * P] int64 KV slots of each group's shared prefix
    prefix_pad: torch.Tensor | None  # [n, P] bool, True = past that group's prefix; None if all equal
    member_rows: torch.Tensor  # [n * M] int64 batch row of each (group, member), padded with a member
    member_slot: torch.Tensor  # [B] int64 index into the n * M (+1 null) member slots; n * M = no group
    has_ungrouped: bool
    max_suffix: int
    suffix_slots: torch.Tensor  # [B * S] int64 KV slots of each request's own part
    suffix_pad: torch.Tensor | None  # [B, S] bool, True = padding; None if no padding
    suffix_lens: torch.Tensor  # [B] int64 on the host: each request's own part (>= 1)


@dataclass
class GroupedQueries:
    """A cascade step's prefix half as the decode kernel takes it: one slot row per group (its
    shared prefix), the grouped requests' queries in group order (`query_starts`: group r's are
    `order[starts[r]:starts[r + 1]]`), each over its group's prefix length."""

    order: torch.Tensor  # [Q] int64 batch rows of the grouped requests, group by group
    starts: torch.Tensor  # [n + 1] int64
    lens: torch.Tensor  # [Q] int64: each query's group's prefix length
    rows: torch.Tensor  # [n, P] int64 prefix slots (padding past a group's length is never read)


def grouped_queries(plan: SharedPrefixPlan) -> GroupedQueries:
    """`plan`'s groups as the decode kernel's rows and queries (member slots past a group's size
    are padding and left out)."""
    n, p, m = plan.num_groups, plan.max_prefix, plan.max_members
    slot = plan.member_slot.cpu()
    grouped = (slot < n * m).nonzero().squeeze(1)
    order = grouped[torch.argsort(slot[grouped])]  # member slots are group-major
    counts = torch.bincount(slot[order] // m, minlength=n)
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    prefix_lens = torch.full((n,), p, dtype=torch.int64)
    if plan.prefix_pad is not None:
        prefix_lens -= plan.prefix_pad.cpu().sum(1)
    lens = prefix_lens.repeat_interleave(counts)
    return GroupedQueries(order, starts, lens, plan.prefix_slots.cpu().view(n, p))


def _common_prefix_len(rows: torch.Tensor, limit: int) -> int:
    """Length of the leading run of columns on which all `rows` agree, at most `limit`."""
    head = rows[:, :limit]
    differs = (head != head[:1]).any(0)
    if not bool(differs.any()):
        return limit
    return int(differs.nonzero()[0])


def plan_shared_prefix(rows: torch.Tensor, seq_lens: list[int]) -> SharedPrefixPlan | None:
    """A cascade plan for a decode batch, or None when sharing would not pay.

    rows: `[B, L]` int64 slot table rows of the batch (L >= max(seq_lens)); seq_lens: each
    request's length including the token decoded now (whose slot is its own, so at most
    `seq_len - 1` tokens can be shared).
    """
    batch = len(seq_lens)
    if batch < 2 or max(seq_lens) <= MIN_SHARED_PREFIX:
        return None
    device = rows.device
    rows = rows.cpu()  # planning is host work (a no-op on CPU); the plan's tensors go back to `device`
    # A slot belongs to one radix node at one depth, so two rows holding the same slot at column
    # k hold the same slots at every column before k: keying on column MIN_SHARED_PREFIX - 1
    # groups exactly the requests that share at least MIN_SHARED_PREFIX tokens (requests that
    # share less, e.g. a chat template's first tokens, fall into different groups).
    key_col = MIN_SHARED_PREFIX - 1
    by_key: dict[int, list[int]] = {}
    for b, slot in enumerate(rows[:, key_col].tolist()):
        if seq_lens[b] - 1 > key_col:
            by_key.setdefault(slot, []).append(b)
    groups: list[tuple[list[int], int]] = []
    for members in by_key.values():
        if len(members) >= 2:
            limit = min(seq_lens[b] for b in members) - 1
            groups.append((members, _common_prefix_len(rows[members], limit)))
    if not groups:
        return None
    saved = sum((len(m) - 1) * p for m, p in groups)
    if saved < MIN_SAVED_FRACTION * sum(seq_lens):
        return None
    return _build_plan(rows, seq_lens, groups, device)


def _build_plan(
    rows: torch.Tensor, seq_lens: list[int], groups: list[tuple[list[int], int]], device: torch.device
) -> SharedPrefixPlan:
    batch, n = len(seq_lens), len(groups)
    max_prefix = max(p for _, p in groups)
    max_members = max(len(m) for m, _ in groups)
    prefix_lens = torch.tensor([p for _, p in groups])
    leaders = torch.tensor([m[0] for m, _ in groups])
    prefix_slots = rows[leaders, :max_prefix].reshape(-1)
    prefix_pad = None
    if int(prefix_lens.min()) < max_prefix:
        prefix_pad = torch.arange(max_prefix)[None, :] >= prefix_lens[:, None]

    member_rows = torch.empty(n, max_members, dtype=torch.int64)
    member_slot = torch.full((batch,), n * max_members, dtype=torch.int64)
    starts = torch.zeros(batch, dtype=torch.int64)
    for g, (members, shared) in enumerate(groups):
        member_rows[g, : len(members)] = torch.tensor(members)
        member_rows[g, len(members) :] = members[0]
        member_slot[members] = g * max_members + torch.arange(len(members))
        starts[members] = shared

    lens = torch.tensor(seq_lens, dtype=torch.int64)
    suffix_lens = lens - starts
    max_suffix = int(suffix_lens.max())
    offsets = torch.arange(max_suffix)
    cols = (starts[:, None] + offsets[None, :]).clamp_(max=rows.shape[1] - 1)
    suffix_slots = rows.gather(1, cols).reshape(-1)
    suffix_pad = None
    if int(suffix_lens.min()) < max_suffix:
        suffix_pad = offsets[None, :] >= suffix_lens[:, None]
    return SharedPrefixPlan(
        num_groups=n,
        max_prefix=max_prefix,
        max_members=max_members,
        prefix_slots=prefix_slots.to(device),
        prefix_pad=None if prefix_pad is None else prefix_pad.to(device),
        member_rows=member_rows.reshape(-1).to(device),
        member_slot=member_slot.to(device),
        has_ungrouped=bool((member_slot == n * max_members).any()),
        max_suffix=max_suffix,
        suffix_slots=suffix_slots.to(device),
        suffix_pad=None if suffix_pad is None else suffix_pad.to(device),
        suffix_lens=suffix_lens,
    )
