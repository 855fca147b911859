"""Tests for engine.sampling: batch packing and the vectorised sampler (parameter validation and
the counter-based random numbers: test_sampling_params.py).

Everything runs on CPU with tiny vocabularies; all randomness is seeded, so no test is flaky.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.sampling import Sampler, SamplingBatchInfo, SamplingParams, apply_penalties

torch.set_num_threads(1)

CPU = torch.device("cpu")
SAMPLER = Sampler()


def make_info(
    params: list[SamplingParams],
    vocab: int,
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    output_ids: list[list[int]] | None = None,
    input_ids: list[list[int]] | None = None,
    **kwargs,
) -> SamplingBatchInfo:
    n = len(params)
    return SamplingBatchInfo.from_requests(
        params,
        seeds if seeds is not None else [p.seed if p.seed is not None else 0 for p in params],
        steps if steps is not None else [0] * n,
        output_ids,
        input_ids,
        vocab,
        CPU,
        **kwargs,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> torch.Tensor:
    return SAMPLER(logits, make_info(params, logits.shape[1], **kwargs)).next_token_ids


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_argmax(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 100, generator=gen).to(dtype)
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(top_k=1, seed=9)] * 2
    params += [SamplingParams(temperature=1e-7)] * 2
    info = make_info(params, 100)
    assert info.is_all_greedy
    out = SAMPLER(logits, info)
    assert out.logprobs is None and out.top_logprobs_val is None
    assert out.next_token_ids.dtype == torch.int64
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_tiny_temperature_sampling_picks_argmax() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 50, generator=gen).repeat(64, 1)
    logits[:, 17] = logits.max() + 1.0  # clear winner
    params = [SamplingParams(temperature=1e-3)] * 64
    info = make_info(params, 50, seeds=list(range(64)))
    assert not info.is_all_greedy
    assert torch.equal(SAMPLER(logits, info).next_token_ids, torch.full((64,), 17))


# --------------------------------------------------------------------------------------------
# Distribution
# --------------------------------------------------------------------------------------------

PROBS = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
DRAWS = 6000


def _frequencies(params: SamplingParams, logits_row: torch.Tensor) -> torch.Tensor:
    """Counts of DRAWS tokens drawn for one request at steps 0..DRAWS-1, in one batched call."""
    logits = logits_row.repeat(DRAWS, 1)
    tokens = sample(logits, [params] * DRAWS, seeds=[2024] * DRAWS, steps=list(range(DRAWS)))
    return torch.bincount(tokens, minlength=logits_row.numel()).float()


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    keep = expected_probs > 0
    assert counts[~keep].sum().item() == 0, "excluded token was sampled"
    expected = expected_probs[keep] / expected_probs[keep].sum() * counts.sum()
    return (((counts[keep] - expected) ** 2) / expected).sum().item()


def _expected(keep: list[int], temperature: float = 1.0) -> torch.Tensor:
    p = PROBS ** (1.0 / temperature)
    mask = torch.zeros_like(p, dtype=torch.bool)
    mask[keep] = True
    return torch.where(mask, p, torch.zeros_like(p))


# (params, tokens that may appear, temperature used for the expected distribution)
DISTRIBUTIONS = [
    (SamplingParams(), [0, 1, 2, 3, 4, 5], 1.0),
    (SamplingParams(temperature=0.7), [0, 1, 2, 3, 4, 5], 0.7),
    (SamplingParams(temperature=1.5), [0, 1, 2, 3, 4, 5], 1.5),
    (SamplingParams(top_k=3), [0, 1, 2], 1.0),
    # mass before token 2 is 0.60 < 0.65, before token 3 it is 0.75: keep {0, 1, 2}
    (SamplingParams(top_p=0.65), [0, 1, 2], 1.0),
    # threshold 0.3 * 0.35 = 0.105 drops 0.08 and 0.05
    (SamplingParams(min_p=0.3), [0, 1, 2, 3], 1.0),
    # top-p applies to the renormalised top-k survivors: 0.65 * 0.87 = 0.5655 <= 0.60
    (SamplingParams(top_k=4, top_p=0.65), [0, 1], 1.0),
]


@pytest.mark.parametrize(("params", "keep", "temperature"), DISTRIBUTIONS)
def test_sampled_frequencies_match_distribution(params: SamplingParams, keep: list[int], temperature: float) -> None:
    logits = PROBS.log() + 3.0  # an offset: softmax must not care
    counts = _frequencies(params, logits)
    assert counts.sum().item() == DRAWS
    dof = len(keep) - 1
    # 99.99th percentile of chi-square for dof <= 5 is below 26: a wrong distribution (e.g.
    # ignoring the temperature, or not renormalising top-p) lands far above it.
    assert _chi_square(counts, _expected(keep, temperature)) < 26.0, (dof, counts)


def test_wrong_distribution_is_detected() -> None:
    """Guards the chi-square test itself: temperature 0.7 draws are far from temperature 1."""
    counts = _frequencies(SamplingParams(temperature=0.7), PROBS.log())
    assert _chi_square(counts, _expected([0, 1, 2, 3, 4, 5], 1.0)) > 60.0


def test_filters_never_emit_excluded_tokens_on_random_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab, rows = 40, 300
    logits = torch.randn(rows, vocab, generator=gen) * 2
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    cases = {
        "top_k": SamplingParams(top_k=5),
        "top_p": SamplingParams(top_p=0.5),
        "min_p": SamplingParams(min_p=0.2),
    }
    for name, params in cases.items():
        tokens = sample(logits, [params] * rows, seeds=list(range(rows)))
        chosen_p = probs.gather(1, tokens[:, None]).squeeze(1)
        rank = (order == tokens[:, None]).float().argmax(-1)
        if name == "top_k":
            assert (rank < 5).all()
        elif name == "top_p":
            mass_before = (sorted_p.cumsum(-1) - sorted_p).gather(1, rank[:, None]).squeeze(1)
            assert (mass_before < 0.5 + 1e-6).all()
        else:
            assert (chosen_p >= 0.2 * probs.max(-1).values - 1e-7).all()
        assert tokens.unique().numel() > 5, name  # really sampling, not collapsing to argmax


# --------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------


def test_seeded_request_is_independent_of_batch_and_position() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab, steps = 32, 20
    target_row = torch.randn(vocab, generator=gen) * 0.5
    variants = [
        SamplingParams(temperature=0.9, seed=1234),
        SamplingParams(temperature=1.1, top_p=0.9, seed=77),
        SamplingParams(top_k=8, min_p=0.05, seed=5),
    ]
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, seed=1),
        SamplingParams(top_p=0.3, seed=2),
        SamplingParams(min_p=0.5, frequency_penalty=1.0, repetition_penalty=1.3, seed=3),
        SamplingParams(temperature=0.2, seed=4),
    ]

    def run(target: SamplingParams, position: int, others: list[SamplingParams]) -> list[int]:
        tokens = []
        for step in range(steps):
            params = list(others)
            params.insert(position, target)
            rows = torch.randn(len(params), vocab, generator=gen)
            rows[position] = target_row
            seeds = [p.seed if p.seed is not None else 99 for p in params]
            out = sample(
                rows,
                params,
                seeds=seeds,
                steps=[step] * len(params),
                output_ids=[[1, 2, 2]] * len(params),
                input_ids=[[3]] * len(params),
            )
            tokens.append(out[position].item())
        return tokens

    for target in variants:
        alone = run(target, 0, [])
        assert len(set(alone)) > 3  # the request really samples
        assert run(target, 2, neighbours) == alone
        assert run(target, 5, neighbours) == alone
        assert run(target, 0, neighbours[1:3]) == alone


def test_different_seeds_and_steps_differ() -> None:
    vocab = 32
    logits = torch.zeros(64, vocab)  # uniform distribution
    params = [SamplingParams()] * 64
    by_seed = sample(logits, params, seeds=list(range(64)))
    by_step = sample(logits, params, seeds=[7] * 64, steps=list(range(64)))
    assert by_seed.unique().numel() >= 20
    assert by_step.unique().numel() >= 20
    assert not torch.equal(by_seed, by_step)
    # Seeds beyond 64 bits and negative seeds are accepted (folded to 63 bits) and reproducible.
    huge = [SamplingParams(seed=2**80 + 3)] * 2
    folded = sample(logits[:2], huge, seeds=[2**80 + 3] * 2)
    assert torch.equal(folded, sample(logits[:2], huge, seeds=[3, 3]))


# --------------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------------


def _reference_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    inputs: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    """Straightforward per-row, per-token loop of the documented penalty rules."""
    out = logits.clone()
    for i, p in enumerate(params):
        if p.repetition_penalty != 1.0:
            for t in set(inputs[i]) | set(outputs[i]):
                v = out[i, t].item()
                out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t, c in Counter(outputs[i]).items():
            out[i, t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_match_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 12
    logits = torch.randn(5, vocab, generator=gen) * 3
    params = [
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.2),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(frequency_penalty=0.3, presence_penalty=0.4, repetition_penalty=1.3),
        SamplingParams(),  # no penalty: must come out untouched
    ]
    inputs = [[0, 1, 2, 3, 4, 5]] * 5  # prompt-only tokens: repetition yes, frequency no
    outputs = [[6, 6, 6, 7], [6, 7, 7], [6, 8], [6, 6, 9, 9, 9, 2], [6, 6, 6]]
    info = make_info(params, vocab, output_ids=outputs, input_ids=inputs)
    assert info.need_penalties
    got = apply_penalties(logits, info)
    want = _reference_penalties(logits, params, inputs, outputs)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[4], logits[4])
    # Non-trivial: rows 0-3 all changed, including a prompt-only token under repetition.
    assert all(not torch.equal(got[i], logits[i]) for i in range(4))
    seen_signs = logits[2, [0, 1, 2, 3, 4, 5, 6, 8]].sign()
    assert (seen_signs > 0).any() and (seen_signs < 0).any()  # both HF branches exercised
    assert not torch.equal(got[2, :6], logits[2, :6])
    assert torch.equal(got[0, :6], logits[0, :6])  # frequency ignores the prompt


def test_penalties_skipped_when_unused() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.0)]
    info = make_info(params, 10, output_ids=[[1, 1], [2]], input_ids=None)
    assert not info.need_penalties
    assert info.output_token_counts is None and info.seen_token_mask is None
    assert info.banned_token_index is None


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.5, 1.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    assert sample(logits, [SamplingParams(temperature=0.0)]).item() == 1
    # token 1 generated twice: 5.0 - 0.8 = 4.2 < 4.5
    assert sample(logits, [p], output_ids=[[1, 1]], input_ids=[[3]]).item() == 2
    rep = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    # token 1 in the prompt: 5.0 / 1.2 = 4.17 < 4.5
    assert sample(logits, [rep], output_ids=[[]], input_ids=[[1]]).item() == 2


def test_min_new_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0]])  # EOS (0) then stop id (1) are the top two
    p = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[1])
    assert sample(logits, [p], steps=[2], eos_token_ids=[0]).item() == 2
    assert sample(logits, [p], steps=[3], eos_token_ids=[0]).item() == 0
    ignore = SamplingParams(temperature=0.0, min_new_tokens=3, ignore_eos=True)
    assert sample(logits, [ignore], steps=[0], eos_token_ids=[0]).item() == 0


# --------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    vocab = 30
    logits = (torch.randn(4, vocab, generator=gen) * 2).to(dtype)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, seed=1),
        SamplingParams(top_k=4, seed=2, frequency_penalty=1.0),
        SamplingParams(top_p=0.8, repetition_penalty=1.5, seed=3),
    ]
    info = make_info(
        params,
        vocab,
        output_ids=[[1], [2], [3, 3], [4]],
        input_ids=[[5]] * 4,
        return_logprob=[True, False, True, False],
        top_logprobs_num=[0, 3, 5, 0],
    )
    out = SAMPLER(logits, info)
    raw = torch.log_softmax(logits.float(), -1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.next_token_ids[:, None]).squeeze(1))
    assert out.top_logprobs_val.shape == (4, 5)
    want_val, want_idx = raw.topk(5, dim=-1)
    assert torch.equal(out.top_logprobs_idx, want_idx)
    assert torch.allclose(out.top_logprobs_val, want_val)
    # Raw, not post-temperature: the temperature-0.5 row would differ otherwise.
    scaled = torch.log_softmax(logits[1].float() / 0.5, -1)[out.next_token_ids[1]]
    assert not torch.isclose(out.logprobs[1], scaled)


def test_no_logprobs_when_nobody_asks() -> None:
    logits = torch.randn(2, 10)
    params = [SamplingParams(seed=1)] * 2
    info = make_info(params, 10, return_logprob=[False] * 2, top_logprobs_num=[0, 0])
    out = SAMPLER(logits, info)
    assert out.logprobs is None and out.top_logprobs_val is None and out.top_logprobs_idx is None
    only_top = make_info([SamplingParams(temperature=0.0)] * 2, 10, top_logprobs_num=[0, 2])
    out = SAMPLER(logits, only_top)
    assert out.logprobs is not None and out.top_logprobs_idx.shape == (2, 2)


# --------------------------------------------------------------------------------------------
# Mixed batch
# --------------------------------------------------------------------------------------------


def test_mixed_batch_matches_per_request_runs() -> None:
    gen = torch.Generator().manual_seed(7)
    vocab = 24
    logits = torch.randn(6, vocab, generator=gen) * 2
    logits[1, 3] = logits[1].max() + 0.5  # raw argmax is an output token the penalties hit
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=2.0, repetition_penalty=1.5),
        SamplingParams(top_k=2, seed=11),
        SamplingParams(temperature=0.8, top_p=0.7, seed=12),
        SamplingParams(min_p=0.1, frequency_penalty=0.5, seed=13),
        SamplingParams(temperature=1.3, seed=14),
    ]
    inputs = [[0, 1]] * 6
    outputs = [[2, 3, 3]] * 6
    seeds = [p.seed or 0 for p in params]
    info = make_info(params, vocab, seeds=seeds, steps=[4] * 6, output_ids=outputs, input_ids=inputs)
    assert not info.is_all_greedy and info.need_penalties
    assert info.need_top_k_sampling and info.need_top_p_sampling and info.need_min_p_sampling
    assert info.sample_indices.tolist() == [2, 3, 4, 5]
    tokens = SAMPLER(logits, info).next_token_ids
    assert torch.equal(logits, before)  # the sampler never writes into its input

    assert tokens[0].item() == logits[0].argmax().item()
    penalised = _reference_penalties(logits, params, inputs, outputs)
    assert tokens[1].item() == penalised[1].argmax().item()
    assert tokens[1].item() != 3
    assert tokens[2].item() in logits[2].topk(2).indices.tolist()
    for i in range(6):
        solo = sample(
            logits[i : i + 1],
            [params[i]],
            seeds=[seeds[i]],
            steps=[4],
            output_ids=[outputs[i]],
            input_ids=[inputs[i]],
        )
        assert solo.item() == tokens[i].item(), i


def test_flags_ignore_greedy_rows() -> None:
    params = [SamplingParams(temperature=0.0, top_p=0.5, min_p=0.3), SamplingParams(top_k=100)]
    info = make_info(params, 50)
    assert not info.need_top_p_sampling and not info.need_min_p_sampling
    assert not info.need_top_k_sampling  # top_k >= vocab is no filter
    assert info.top_ks.tolist() == [1, 50]
    assert info.temperatures.shape == (2, 1) and info.seeds.dtype == torch.int64
