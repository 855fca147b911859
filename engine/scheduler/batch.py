"""`ScheduleBatch`, the scheduler's view of one forward's requests (seed 000; `Req` is in req.py).

Layering, as in SGLang: `ScheduleBatch` knows requests, pools and the prefix cache (scheduler
concerns); it hands the model worker a `ModelWorkerBatch` (the tensors, lengths and sampling info
one forward needs), from which the model runner builds the device-side `ForwardBatch` (both in
engine/model_executor/forward_batch_info.py). Each layer carries only what the next one needs,
and the types are imported downward: the model side knows nothing of requests.

Memory discipline: `prepare_for_extend` / `prepare_for_decode` either allocate everything the
batch needs or nothing, and report failure by returning False so the scheduler can evict, retract
or wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.cache.base_prefix_cache import BasePrefixCache
from engine.cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from engine.cache.swa_pool import SWATokenToKVPoolAllocator, release_out_of_window
from engine.constrained import allocate_bitmask, fill_bitmasks
from engine.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch, PromptLogprobPlan
from engine.sampling import SamplingBatchInfo
from engine.scheduler.req import Req


@dataclass
class ScheduleBatch:
    """A batch from the scheduler's point of view: requests, pools, cache, and its tensors."""

    reqs: list[Req]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache | None = None
    vocab_size: int = 0
    forward_mode: ForwardMode = ForwardMode.IDLE
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    input_ids: torch.Tensor | None = None
    req_pool_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    out_cache_loc: torch.Tensor | None = None
    seq_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    decode_inputs_on_device: bool = False  # overlap: decode input ids come from the device buffer
    mixed_decode_rows: int = 0  # MIXED: the last rows are running requests decoding one token
    spec_drafts: list[list[int]] = field(default_factory=list)  # TARGET_VERIFY: each request's drafts

    @classmethod
    def init_new(
        cls,
        reqs: list[Req],
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        tree_cache: BasePrefixCache | None = None,
        vocab_size: int = 0,
    ) -> ScheduleBatch:
        return cls(
            reqs=list(reqs),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            vocab_size=vocab_size,
            device=req_to_token_pool.device,
        )

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # ---- extend -------------------------------------------------------------------------------

    def prepare_for_extend(self) -> bool:
        """Allocate request rows and KV slots for every req's new tokens; all or nothing.

        Each req must have run `init_next_round_input` (fill_ids, prefix_indices set). A req that
        already holds a row (a continued chunk) keeps it.
        """
        self.forward_mode = ForwardMode.EXTEND
        pool, alloc = self.req_to_token_pool, self.token_to_kv_pool_allocator
        self.release_out_of_window()
        need_rows = [r for r in self.reqs if r.req_pool_idx is None]
        rows = pool.alloc(len(need_rows))
        if rows is None:
            return False
        new_slots: list[torch.Tensor] = []
        for req in self.reqs:
            row = rows[need_rows.index(req)] if req.req_pool_idx is None else req.req_pool_idx
            prefix_len = len(req.prefix_indices)
            last_slot = int(req.prefix_indices[-1]) if prefix_len else 0
            slots = alloc.alloc_extend(last_slot, prefix_len, req.extend_input_len)
            if slots is None:  # roll back everything this call took
                for r, s in zip(self.reqs, new_slots):
                    alloc.free_extend(s, len(r.prefix_indices))
                pool.free(rows)
                return False
            new_slots.append(slots)
        for req, row in zip(need_rows, rows):
            req.req_pool_idx = row
            # A fresh row starts from a tree prefix: computed KV (a continued chunk keeps its count).
            req.kv_computed_len = len(req.prefix_indices)
            req.swa_released_len = 0
        input_ids: list[int] = []
        for req, slots in zip(self.reqs, new_slots):
            prefix_len = len(req.prefix_indices)
            if prefix_len:
                pool.write(req.req_pool_idx, 0, req.prefix_indices)
            pool.write(req.req_pool_idx, prefix_len, slots)
            req.kv_committed_len = prefix_len + req.extend_input_len
            input_ids.extend(req.fill_ids[prefix_len:])
        self.prefix_lens = [len(r.prefix_indices) for r in self.reqs]
        self.extend_lens = [r.extend_input_len for r in self.reqs]
        self.seq_lens_cpu = [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
        self.out_cache_loc = torch.cat(new_slots) if new_slots else torch.empty(0, dtype=torch.int64)
        self.input_ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        self._set_index_tensors()
        return True

    def release_out_of_window(self) -> None:
        """Hybrid SWA memory: the running requests give back the SWA slots their windows left,
        before this forward allocates (engine/cache/swa_pool.py)."""
        alloc = self.token_to_kv_pool_allocator
        if isinstance(alloc, SWATokenToKVPoolAllocator):
            assert self.tree_cache is not None
            release_out_of_window(self.reqs, self.req_to_token_pool, alloc, self.tree_cache)

    # ---- decode -------------------------------------------------------------------------------

    def prepare_for_decode(self, inputs_on_device: bool = False) -> bool:
        """Allocate one KV slot per request for the next token; all or nothing.

        With `inputs_on_device` (overlap), input ids are not read from `req.output_ids` (they may
        not be known yet): the model runner gathers them from its last-sampled-ids buffer.
        """
        self.forward_mode = ForwardMode.DECODE
        alloc = self.token_to_kv_pool_allocator
        self.release_out_of_window()
        if alloc.page_size == 1:
            slots = alloc.alloc(len(self.reqs))
            if slots is None:
                return False
        else:
            parts: list[torch.Tensor] = []
            for req in self.reqs:
                last_slot = int(self.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_committed_len - 1])
                s = alloc.alloc_extend(last_slot, req.kv_committed_len, 1)
                if s is None:
                    for r, p in zip(self.reqs, parts):
                        alloc.free_extend(p, r.kv_committed_len)
                    return False
                parts.append(s)
            slots = torch.cat(parts)
        self.req_to_token_pool.write_each(
            [r.req_pool_idx for r in self.reqs], [r.kv_committed_len for r in self.reqs], slots
        )
        for req in self.reqs:
            req.kv_committed_len += 1
        self.decode_inputs_on_device = inputs_on_device
        self.input_ids = (
            None
            if inputs_on_device
            else torch.tensor(
                [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in self.reqs],
                dtype=torch.int64,
            )
        )
        self.out_cache_loc = slots
        self.seq_lens_cpu = [r.kv_committed_len for r in self.reqs]
        self.prefix_lens, self.extend_lens = [], []
        self._set_index_tensors()
        return True

    def prepare_for_verify(self, drafts: list[list[int]]) -> bool:
        """Speculative decoding: KV slots for each request's last token and its `drafts`, all or
        nothing (page size 1). The forward writes them all; the scheduler frees the rejected ones
        once it knows (engine/scheduler/speculation.py)."""
        self.release_out_of_window()
        slots = self.token_to_kv_pool_allocator.alloc(sum(len(d) + 1 for d in drafts))
        if slots is None:
            return False
        self.forward_mode, self.spec_drafts = ForwardMode.TARGET_VERIFY, drafts
        self.prefix_lens = [r.kv_committed_len for r in self.reqs]
        self.extend_lens = [len(d) + 1 for d in drafts]
        input_ids: list[int] = []
        first = 0
        for req, draft, n in zip(self.reqs, drafts, self.extend_lens):
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_committed_len, slots[first : first + n])
            req.kv_committed_len += n
            first += n
            input_ids += [req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1], *draft]
        self.seq_lens_cpu = [r.kv_committed_len for r in self.reqs]
        self.input_ids = torch.tensor(input_ids, dtype=torch.int64)
        self.out_cache_loc = slots
        self._set_index_tensors()
        return True

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Append the rows of `running`, just prepared for decode, to this prefill batch: one
        forward computes the prefill and one new token per running request (ForwardMode.MIXED).
        A decode row is a one-token extend over its own KV; its input id is read on the device
        from the last sampled ids (it may not be on the host yet, under overlap)."""
        n = len(running.reqs)
        self.forward_mode = ForwardMode.MIXED
        self.reqs = self.reqs + running.reqs
        self.prefix_lens = self.prefix_lens + [length - 1 for length in running.seq_lens_cpu]
        self.extend_lens = self.extend_lens + [1] * n
        self.seq_lens_cpu = self.seq_lens_cpu + list(running.seq_lens_cpu)
        self.out_cache_loc = torch.cat([self.out_cache_loc, running.out_cache_loc])
        placeholders = torch.zeros(n, dtype=torch.int64, device=self.input_ids.device)
        self.input_ids = torch.cat([self.input_ids, placeholders])
        self.mixed_decode_rows = n
        self._set_index_tensors()

    def _set_index_tensors(self) -> None:
        self.req_pool_indices = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        self.seq_lens = torch.tensor(self.seq_lens_cpu, dtype=torch.int64)

    # ---- membership ---------------------------------------------------------------------------

    def filter_batch(self, keep_indices: list[int] | None = None) -> None:
        """Keep only the listed requests (default: the unfinished ones)."""
        if keep_indices is None:
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished()]
        self.reqs = [self.reqs[i] for i in keep_indices]
        self.seq_lens_cpu = [r.kv_committed_len for r in self.reqs]
        self.input_ids = None
        self.out_cache_loc = None
        self._set_index_tensors()

    def merge_batch(self, other: ScheduleBatch) -> None:
        """Append another batch's requests (a finished prefill joins the running decode batch).

        Finished requests (whose memory may already be freed) are dropped from both.
        """
        self.reqs = [r for r in self.reqs + other.reqs if not r.finished()]
        self.seq_lens_cpu = [r.kv_committed_len for r in self.reqs]
        self.input_ids = None
        self.out_cache_loc = None
        self._set_index_tensors()

    # ---- hand-off to the model worker ---------------------------------------------------------

    def get_model_worker_batch(self, return_prompt_logits: bool = False) -> ModelWorkerBatch:
        reqs = self.reqs
        # Tokens generated before the one this forward samples. Derived from the KV length, not
        # from output_ids, because under overlap output_ids lags one step behind.
        steps = [r.kv_committed_len - len(r.origin_input_ids) for r in reqs]
        need_history = any(r.sampling_params.has_penalties() for r in reqs)
        grammars = [r.grammar for r in reqs]
        constrained = any(g is not None for g in grammars)
        sampling_info = SamplingBatchInfo.from_requests(
            params=[r.sampling_params for r in reqs],
            seeds=[r.seed for r in reqs],
            steps=steps,
            output_ids=[r.output_ids for r in reqs] if need_history else None,
            input_ids=[r.origin_input_ids for r in reqs] if need_history else None,
            vocab_size=self.vocab_size,
            device=self.device,
            eos_token_ids=sorted(reqs[0].eos_token_ids) if reqs else None,  # min_new_tokens bans EOS
            return_logprob=[r.return_logprob for r in reqs],
            top_logprobs_num=[r.top_logprobs_num for r in reqs],
            logit_biases=[r.logit_bias for r in reqs],
            constrained=[g is not None for g in grammars] if constrained else None,
        )
        if constrained:
            t0 = time.perf_counter()
            mask = allocate_bitmask(len(reqs), self.vocab_size, pin_memory=self.device.type == "cuda")
            rows = fill_bitmasks(grammars, mask)
            if rows:
                sampling_info.vocab_mask, sampling_info.vocab_mask_rows = mask, rows
            sampling_info.mask_fill_s = time.perf_counter() - t0
        prompt_lp = self._input_logprob_plan() if self.forward_mode.is_prefill() else None
        embed_rows, embed_counts = self._embed_plan() if self.forward_mode.is_prefill() else ([], [])
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            out_cache_loc=self.out_cache_loc,
            seq_lens_cpu=list(self.seq_lens_cpu),
            extend_seq_lens=list(self.extend_lens),
            extend_prefix_lens=list(self.prefix_lens),
            mixed_decode_rows=self.mixed_decode_rows,
            sampling_info=sampling_info,
            return_prompt_logits=return_prompt_logits,
            prompt_logprobs=prompt_lp,
            embed_rows=embed_rows,
            embed_counts=embed_counts,
            # each request's pinned adapter slot; None keeps a batch without adapters LoRA-free
            lora_slots=[r.lora_slot for r in reqs] if any(r.lora_slot >= 0 for r in reqs) else None,
        )

    def _embed_plan(self) -> tuple[list[int], list[int]]:
        """The flat rows of this extend that embedding requests pool, and each request's count
        (batch order); empty lists when no request is an embedding."""
        if not any(r.pooling is not None for r in self.reqs):
            return [], []
        rows: list[int] = []
        counts: list[int] = []
        start = 0
        for req, prefix, ext in zip(self.reqs, self.prefix_lens, self.extend_lens):
            first, n = req.embed_rows(prefix, ext)
            rows.extend(range(start + first, start + first + n))
            counts.append(n)
            start += ext
        return rows, counts

    def _input_logprob_plan(self) -> PromptLogprobPlan | None:
        """The rows of this extend whose logits score a prompt token, for the requests that asked
        for prompt log-probs (None when none did): flat row indices, the token each scores, and
        how many rows each request has, in batch order."""
        if not any(r.input_logprobs is not None for r in self.reqs):
            return None
        rows: list[int] = []
        targets: list[int] = []
        counts: list[int] = []
        top_n = 0
        start = 0
        for req, prefix, ext in zip(self.reqs, self.prefix_lens, self.extend_lens):
            first, n = req.input_logprob_rows(prefix, ext)
            if n:
                rows.extend(range(start + first, start + first + n))
                q = prefix + first + 1  # the prompt position the first row predicts
                targets.extend(req.origin_input_ids[q : q + n])
                top_n = max(top_n, req.top_logprobs_num)
            counts.append(n)
            start += ext
        if not rows:
            return None
        return PromptLogprobPlan(rows, targets, counts, top_n)
