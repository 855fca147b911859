"""Batched next-token sampling: one vectorised pass for a batch of requests with mixed params.

Two pieces:

* `SamplingBatchInfo` packs the per-request `SamplingParams` of one decode step into a few device
  tensors plus batch-level flags, so the sampler can skip every stage no request needs.
* `Sampler` turns logits into token ids (and optionally log-probs) with no per-request Python
  loop: logit_bias -> penalties -> greedy argmax, and for sampled rows temperature -> softmax ->
  top-k/top-p/min-p masks -> a seeded draw (OpenAI's and vLLM's order for the bias).

Randomness is counter-based, not stateful (counter_rng.py): the uniform for (request seed, step,
token id) is a pure hash of those three integers. A request therefore samples the same tokens
whichever batch it lands in, at whatever row, next to whatever neighbours, which a shared
`torch.Generator` can never give. Requests without a user seed get a random one from the caller at creation time, so
every row takes the same code path.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.constrained import apply_bitmask
from engine.kernels import cpu_elementwise
from engine.sampling.counter_rng import counter_uniforms
from engine.sampling.counter_rng import mix64_ as mix64_  # re-exported: tests import it from here
from engine.sampling.logit_bias import LogitBias, apply_logit_bias, pack_logit_bias
from engine.sampling.sampling_params import SamplingParams

ARGMAX_KERNEL_DTYPES = (torch.bfloat16, torch.float32)

_SEED_MASK = (1 << 63) - 1


# --------------------------------------------------------------------------------------------
# Batch info
# --------------------------------------------------------------------------------------------


def _flat_token_index(rows: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device) -> Tensor | None:
    """Flat indices row * vocab_size + token for every token of every row (None if none).

    Each row is given as a few segments (e.g. prompt ids and output ids) so nothing is copied
    on the Python side. The index is assembled in numpy (`np.fromiter` is several times faster
    than `torch.tensor` on a long Python list) and crosses to the device in one copy.
    """
    lengths = np.fromiter((sum(map(len, segments)) for segments in rows), np.int64, len(rows))
    total = int(lengths.sum())
    if total == 0:
        return None
    tokens = itertools.chain.from_iterable(itertools.chain.from_iterable(rows))
    flat = np.fromiter(tokens, np.int64, total)
    flat += np.repeat(np.arange(len(rows), dtype=np.int64) * vocab_size, lengths)
    return torch.from_numpy(flat).to(device)


def _min_tokens_banned(
    params: SamplingParams, row: int, vocab_size: int, eos_token_ids: Sequence[int] | None
) -> list[int]:
    """Flat ids of the tokens that would end `row` early: its stop_token_ids, plus EOS unless
    EOS does not stop it anyway (ignore_eos)."""
    tokens = set(params.stop_token_ids or ())
    if eos_token_ids and not params.ignore_eos:
        tokens.update(eos_token_ids)
    return [row * vocab_size + t for t in sorted(tokens) if 0 <= t < vocab_size]


@dataclass
class SamplingBatchInfo:
    """Device-side sampling state of one batch, rebuilt every step by `from_requests`.

    Row i of every [B, ...] tensor belongs to request i. Greedy rows carry neutral values
    (temperature 1, top_k 1), as in SGLang; they never go through the sampling stages.
    Flags are computed over the rows that actually sample, so a greedy neighbour never turns
    on a stage nobody needs.
    """

    vocab_size: int
    temperatures: Tensor  # [B, 1] float32
    top_ps: Tensor  # [B] float32
    top_ks: Tensor  # [B] int64; vocab_size when off
    min_ps: Tensor  # [B] float32
    seeds: Tensor  # [B] int64, folded to 63 bits
    steps: Tensor  # [B] int64: tokens the request has generated so far
    is_all_greedy: bool
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool
    need_penalties: bool
    # Rows that sample (not greedy); None when every row samples or none does.
    sample_indices: Tensor | None = None
    # Penalty state: all None unless some request uses that penalty.
    frequency_penalties: Tensor | None = None  # [B, 1] float32
    presence_penalties: Tensor | None = None  # [B, 1] float32
    output_token_counts: Tensor | None = None  # [B, V] float32, output tokens only
    repetition_penalties: Tensor | None = None  # [B, 1] float32
    seen_token_mask: Tensor | None = None  # [B, V] bool, prompt + output tokens
    banned_token_index: Tensor | None = None  # flat row*V+token ids forced to -inf (min_new_tokens)
    # logit_bias, sparse: None unless some request has one (logit_bias.py).
    logit_bias_index: Tensor | None = None  # [M] int64, flat row*V+token
    logit_bias_values: Tensor | None = None  # [M] float32
    # Structured output: the grammar's token bitmask (int32 [>=B, ceil(V/32)], CPU, pinned on
    # CUDA) and the rows it restricts; None when no row is constrained (engine.constrained).
    vocab_mask: Tensor | None = None
    vocab_mask_rows: list[int] | None = None
    mask_fill_s: float = 0.0  # host time the scheduler spent filling the bitmask
    # Log-prob requests, batch level: the sampler computes them for all rows or none.
    return_logprob: bool = False
    top_logprobs_num: int = 0  # max over the batch, capped at vocab_size

    @property
    def batch_size(self) -> int:
        return self.top_ps.shape[0]

    @property
    def need_logprobs(self) -> bool:
        return self.return_logprob or self.top_logprobs_num > 0

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        output_ids: Sequence[Sequence[int]] | None,
        input_ids: Sequence[Sequence[int]] | None,
        vocab_size: int,
        device: torch.device | str,
        return_logprob: Sequence[bool] | None = None,
        top_logprobs_num: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        logit_biases: Sequence[LogitBias | None] | None = None,
        constrained: Sequence[bool] | None = None,
    ) -> SamplingBatchInfo:
        """Build the batch state from per-request Python values.

        `vocab_size` is the width of the logits rows. `seeds` are the effective seeds (the
        user's, or one drawn at request creation); any int works, it is folded to 63 bits.
        `output_ids`/`input_ids` are only read when some request uses a penalty. `eos_token_ids`
        (optional) are banned, together with the request's stop_token_ids, while a request has
        generated fewer than `min_new_tokens` tokens (EOS is not banned under `ignore_eos`).
        `logit_biases` are the requests' `LogitBias` arrays, built once per request by the caller;
        when omitted they are built here from `params`. `constrained` marks rows under a grammar
        (the caller sets `vocab_mask`): min_new_tokens bans nothing there, since a completed
        grammar allows only its stop tokens and banning them would leave no token at all.

        This runs every decode step, so it makes one Python pass over the requests and one
        host->device copy per group of fields (the logit_bias entries ride in the same two
        copies); penalty tensors are built only when used.
        """
        batch = len(params)
        if len(seeds) != batch or len(steps) != batch:
            raise ValueError(f"got {batch} params, {len(seeds)} seeds and {len(steps)} steps")
        device = torch.device(device)

        temperatures: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        sample_rows: list[int] = []
        need_top_p = need_top_k = need_min_p = False
        use_freq_presence = use_repetition = False
        banned: list[int] = []  # flat row*V+token ids blocked by min_new_tokens
        for i, p in enumerate(params):
            use_freq_presence |= p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            use_repetition |= p.repetition_penalty != 1.0
            if steps[i] < p.min_new_tokens and not (constrained and constrained[i]):
                banned.extend(_min_tokens_banned(p, i, vocab_size, eos_token_ids))
            if p.is_greedy:
                temperatures.append(1.0)
                top_ps.append(1.0)
                top_ks.append(1)
                min_ps.append(0.0)
                continue
            sample_rows.append(i)
            top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
            temperatures.append(p.temperature)
            top_ps.append(p.top_p)
            top_ks.append(top_k)
            min_ps.append(p.min_p)
            need_top_p |= p.top_p < 1.0
            need_top_k |= top_k < vocab_size
            need_min_p |= p.min_p > 0.0

        if logit_biases is None:
            logit_biases = [LogitBias.from_params(p) for p in params]
        bias = pack_logit_bias(logit_biases, vocab_size)
        floats_np = np.array([temperatures, top_ps, min_ps], dtype=np.float32).reshape(-1)
        ints_np = np.array([top_ks, [s & _SEED_MASK for s in seeds], list(steps)], dtype=np.int64).reshape(-1)
        if bias is not None:
            ints_np, floats_np = np.concatenate([ints_np, bias[0]]), np.concatenate([floats_np, bias[1]])
        flat_floats, flat_ints = torch.from_numpy(floats_np).to(device), torch.from_numpy(ints_np).to(device)
        floats, ints = flat_floats[: 3 * batch].view(3, batch), flat_ints[: 3 * batch].view(3, batch)
        sample_indices = None
        if 0 < len(sample_rows) < batch:
            sample_indices = torch.tensor(sample_rows, dtype=torch.int64, device=device)

        info = cls(
            vocab_size=vocab_size,
            temperatures=floats[0].unsqueeze(1),
            top_ps=floats[1],
            top_ks=ints[0],
            min_ps=floats[2],
            seeds=ints[1],
            steps=ints[2],
            is_all_greedy=not sample_rows,
            need_top_p_sampling=need_top_p,
            need_top_k_sampling=need_top_k,
            need_min_p_sampling=need_min_p,
            need_penalties=use_freq_presence or use_repetition or bool(banned),
            sample_indices=sample_indices,
        )
        if use_freq_presence or use_repetition:
            info._build_penalties(params, output_ids, input_ids, use_freq_presence, use_repetition, device)
        if banned:
            info.banned_token_index = torch.tensor(banned, dtype=torch.int64, device=device)
        if bias is not None:
            info.logit_bias_index, info.logit_bias_values = flat_ints[3 * batch :], flat_floats[3 * batch :]
        if return_logprob is not None:
            info.return_logprob = any(return_logprob)
        if top_logprobs_num:
            info.top_logprobs_num = min(max(top_logprobs_num), vocab_size)
        return info

    def _build_penalties(
        self,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]] | None,
        input_ids: Sequence[Sequence[int]] | None,
        use_freq_presence: bool,
        use_repetition: bool,
        device: torch.device,
    ) -> None:
        """Fill the penalty tensors. Rows that do not use a penalty contribute no tokens to it,
        so their logits pass through bit-for-bit unchanged."""
        batch, vocab = len(params), self.vocab_size
        empty: tuple[int, ...] = ()
        outputs = output_ids if output_ids is not None else [empty] * batch
        inputs = input_ids if input_ids is not None else [empty] * batch
        nothing: tuple[Sequence[int], ...] = ()

        if use_freq_presence:
            self.frequency_penalties, self.presence_penalties = torch.tensor(
                [[p.frequency_penalty for p in params], [p.presence_penalty for p in params]],
                dtype=torch.float32,
                device=device,
            ).unsqueeze(2)
            counted = [
                (out,) if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) else nothing
                for p, out in zip(params, outputs)
            ]
            counts = torch.zeros(batch * vocab, dtype=torch.float32, device=device)
            index = _flat_token_index(counted, vocab, device)
            if index is not None:
                counts.index_add_(0, index, torch.ones(index.shape[0], device=device))
            self.output_token_counts = counts.view(batch, vocab)

        if use_repetition:
            self.repetition_penalties = torch.tensor(
                [p.repetition_penalty for p in params], dtype=torch.float32, device=device
            ).unsqueeze(1)
            seen_rows = [
                (inp, out) if p.repetition_penalty != 1.0 else nothing for p, inp, out in zip(params, inputs, outputs)
            ]
            seen = torch.zeros(batch * vocab, dtype=torch.bool, device=device)
            index = _flat_token_index(seen_rows, vocab, device)
            if index is not None:
                seen.index_fill_(0, index, True)
            self.seen_token_mask = seen.view(batch, vocab)


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


@dataclass
class SamplerOutput:
    """What one sampling step produced.

    `logprobs` and the top-N pair are None when no request in the batch asked for them; when
    some did, every row is filled (rows that did not ask may be ignored). N is the batch max.
    """

    next_token_ids: Tensor  # [B] int64
    logprobs: Tensor | None = None  # [B] float32, log-prob of next_token_ids
    top_logprobs_val: Tensor | None = None  # [B, N] float32
    top_logprobs_idx: Tensor | None = None  # [B, N] int64
    mask_fill_s: float = 0.0  # the scheduler's bitmask fill time for this batch (passed through)
    mask_apply_s: float = 0.0  # host time spent applying grammar masks (on CUDA: launching it)


def greedy_ids(logits: Tensor) -> Tensor:
    """Each row's argmax. Contiguous CPU rows (bf16 logits stay bf16 on one rank) go through the
    C++ kernel, which reads them in place (torch's bf16 argmax is a scalar loop); same indices."""
    if logits.device.type == "cpu" and logits.dtype in ARGMAX_KERNEL_DTYPES and logits.is_contiguous():
        if cpu_elementwise.load() is not None:
            return cpu_elementwise.argmax_rows(logits)
    return logits.argmax(dim=-1)


def apply_penalties(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Penalised float32 copy of `logits` [B, V]; the input is never modified.

    Order (as vLLM): repetition penalty on every token seen in prompt or output, HF-style
    (positive logits divided by the penalty, negative ones multiplied); then
    logit -= frequency_penalty * count + presence_penalty * (count > 0) over OUTPUT tokens
    (OpenAI's definition); then tokens banned by min_new_tokens go to -inf.
    """
    x = logits.float()
    if info.seen_token_mask is not None:
        rp = info.repetition_penalties
        x = torch.where(info.seen_token_mask, torch.where(x > 0, x / rp, x * rp), x)
    if info.output_token_counts is not None:
        counts = info.output_token_counts
        x = x - info.frequency_penalties * counts - info.presence_penalties * (counts > 0)
    if info.banned_token_index is not None:
        x = x.contiguous()
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()
        x.view(-1).index_fill_(0, info.banned_token_index, float("-inf"))
    return x


def filtered_probs(
    logits: Tensor,
    temperatures: Tensor,
    top_ps: Tensor,
    top_ks: Tensor,
    min_ps: Tensor,
    info: SamplingBatchInfo,
) -> Tensor:
    """Temperature-scaled softmax with top-k, top-p and min-p applied (excluded tokens -> 0).

    The result is not renormalised: the exponential race below is scale-invariant. Top-k and
    top-p share one stable descending sort; the mask is scattered back to token order so the
    seeded noise stays indexed by token id whether or not a neighbour forced the sort.
    """
    probs = torch.softmax(logits / temperatures, dim=-1)
    if info.need_top_k_sampling or info.need_top_p_sampling:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        positions = torch.arange(probs.shape[-1], device=probs.device)
        remove = positions[None, :] >= top_ks[:, None]
        if info.need_top_p_sampling:
            if info.need_top_k_sampling:
                sorted_probs = sorted_probs.masked_fill(remove, 0.0)
            cumulative = sorted_probs.cumsum(dim=-1)
            # Top-p over the top-k survivors, renormalised (HF/vLLM order): keep the smallest
            # prefix whose mass reaches top_p. top_p == 1 never removes anything, even if the
            # cumulative sum rounds a hair above the total.
            limit = (top_ps * cumulative[:, -1]).masked_fill(top_ps >= 1.0, float("inf"))
            remove[:, 1:] |= cumulative[:, :-1] >= limit[:, None]
        probs.masked_fill_(torch.empty_like(remove).scatter_(1, order, remove), 0.0)
    if info.need_min_p_sampling:
        # The most likely token always survives top-k/top-p, so the max is unchanged by them.
        threshold = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


class Sampler:
    """Chooses next tokens for a batch; stateless, one instance can serve every step.

    Log-probs are "raw": log_softmax of the model's logits before logit_bias, penalties,
    temperature and top-k/top-p/min-p (vLLM's default). They describe what the model predicted,
    comparable across requests whatever their sampling settings, and they are cheap to get on the
    fast path. So a token forced by a +100 bias reports the model's own log-prob for it, not ~0.
    A grammar is the exception: its mask is a hard constraint, not a preference, so a
    constrained row's log-probs are over the tokens its grammar allows (as SGLang reports them).
    """

    def __call__(self, logits: Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[1] != info.vocab_size:
            raise ValueError(f"logits must be [B, {info.vocab_size}], got {tuple(logits.shape)}")
        mask_apply_s = 0.0
        if info.vocab_mask_rows:
            # First, in place: a disallowed token is -inf whatever the bias, penalties or
            # temperature do to it, and log-probs describe the allowed set.
            t0 = time.perf_counter()
            apply_bitmask(logits, info.vocab_mask, info.vocab_mask_rows)
            mask_apply_s = time.perf_counter() - t0
        out = self._choose(logits, info)
        out.mask_fill_s, out.mask_apply_s = info.mask_fill_s, mask_apply_s
        return out

    def _choose(self, logits: Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        biased = info.logit_bias_index is not None
        if info.is_all_greedy and not (info.need_penalties or info.need_logprobs or biased):
            return SamplerOutput(next_token_ids=greedy_ids(logits))

        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if info.need_logprobs else None
        scores = apply_logit_bias(logits, info.logit_bias_index, info.logit_bias_values) if biased else logits
        scores = apply_penalties(scores, info) if info.need_penalties else scores
        if info.is_all_greedy:
            next_ids = greedy_ids(scores)
        elif info.sample_indices is None:
            next_ids = self._sample(scores, info, None)
        else:
            next_ids = greedy_ids(scores)
            sampled = self._sample(scores, info, info.sample_indices)
            next_ids.index_copy_(0, info.sample_indices, sampled)
        return self._with_logprobs(next_ids, raw_logprobs, info)

    @staticmethod
    def _sample(scores: Tensor, info: SamplingBatchInfo, rows: Tensor | None) -> Tensor:
        """Seeded draw for the sampling rows (all rows when `rows` is None).

        Exponential race: argmax_i p_i / E_i with E_i = -log(u_i) ~ Exp(1) picks token i with
        probability p_i / sum(p), i.e. it is a multinomial draw, but each E_i comes from the
        counter hash, so the draw depends only on the row's own (seed, step) and probabilities.
        """
        temperatures, top_ps, top_ks = info.temperatures, info.top_ps, info.top_ks
        min_ps, seeds, steps = info.min_ps, info.seeds, info.steps
        if rows is not None:
            scores = scores.index_select(0, rows)
            temperatures, top_ps, top_ks = temperatures[rows], top_ps[rows], top_ks[rows]
            min_ps, seeds, steps = min_ps[rows], seeds[rows], steps[rows]
        probs = filtered_probs(scores.float(), temperatures, top_ps, top_ks, min_ps, info)
        exponentials = counter_uniforms(seeds, steps, probs.shape[-1]).log_().neg_()
        return probs.div_(exponentials).argmax(dim=-1)

    @staticmethod
    def _with_logprobs(next_ids: Tensor, raw_logprobs: Tensor | None, info: SamplingBatchInfo) -> SamplerOutput:
        if raw_logprobs is None:
            return SamplerOutput(next_token_ids=next_ids)
        chosen = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        top_val = top_idx = None
        if info.top_logprobs_num > 0:
            top_val, top_idx = raw_logprobs.topk(info.top_logprobs_num, dim=-1)
        return SamplerOutput(next_ids, chosen, top_val, top_idx)
