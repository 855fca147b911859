"""Tests for engine.sampling's parameters (SGLang's validation rules, each error naming its field)
and the counter-based random numbers seeded sampling draws from."""

from __future__ import annotations

import msgspec
import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams, counter_uniforms
from engine.sampling.sampler import mix64_

# --------------------------------------------------------------------------------------------
# SamplingParams.verify
# --------------------------------------------------------------------------------------------

INVALID = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"presence_penalty": -3.0}, "presence_penalty"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ({"n": 0}, "n"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 3}, "stop"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID)
def test_verify_rejects_and_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as exc_info:
        SamplingParams(**kwargs).verify(vocab_size=100)
    assert exc_info.value.param == field
    assert field in str(exc_info.value)


def test_verify_stop_token_ids_bounded_by_vocab() -> None:
    SamplingParams(stop_token_ids=[0, 9]).verify(vocab_size=10)
    SamplingParams(stop_token_ids=[10**6]).verify()  # no vocab given: no bound
    for bad in ([10], [-1]):
        with pytest.raises(InvalidRequestError) as exc_info:
            SamplingParams(stop_token_ids=bad).verify(vocab_size=10)
        assert exc_info.value.param == "stop_token_ids"


def test_verify_accepts_boundary_values() -> None:
    edge = [
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"top_k": 1},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0, "repetition_penalty": 2.0},
        {"min_new_tokens": 7, "max_new_tokens": 7},
        {"max_new_tokens": 0},
        {"seed": -5},
        {"seed": 2**80},
        {"temperature": 1, "top_p": 1},  # ints where floats are expected are fine
    ]
    for kwargs in edge:
        SamplingParams(**kwargs).verify(vocab_size=100)


def test_params_defaults_stop_strs_and_json() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.n, p.stop_strs) == (128, 1.0, -1, 1, [])
    assert not p.is_greedy
    assert SamplingParams(stop="###").stop_strs == ["###"]
    assert SamplingParams(stop=["a", "", "b"]).stop_strs == ["a", "b"]
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(top_k=1).is_greedy
    body = b'{"temperature": 0.5, "stop": ["x"], "seed": 3}'
    decoded = msgspec.json.decode(body, type=SamplingParams)
    assert decoded == SamplingParams(temperature=0.5, stop=["x"], seed=3)


# --------------------------------------------------------------------------------------------
# Counter-based uniforms
# --------------------------------------------------------------------------------------------

_U64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _ref_mix(z: int) -> int:
    """splitmix64's finaliser on Python ints (unbounded ints + explicit masking)."""
    z &= _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _ref_uniform(seed: int, step: int, token: int) -> float:
    key = _ref_mix(_ref_mix(seed) + step)
    z = _ref_mix(key + (token + 1) * _GAMMA)
    return ((z >> 41) + 0.5) / 2**23


def test_mix64_matches_splitmix64_reference_vector() -> None:
    # Published splitmix64 output for state 0: first value is 0xE220A8397B1DCDAF.
    z = torch.tensor([_GAMMA - (1 << 64)], dtype=torch.int64)
    assert mix64_(z).item() & _U64 == 0xE220A8397B1DCDAF


def test_counter_uniforms_match_python_reference_and_are_uniform() -> None:
    seeds = [0, 1, (1 << 63) - 1, 123456789]
    steps = [0, 5, 2**40, 3]
    u = counter_uniforms(torch.tensor(seeds), torch.tensor(steps), 16)
    assert u.shape == (4, 16) and u.dtype == torch.float32
    for r, (seed, step) in enumerate(zip(seeds, steps)):
        for t in (0, 7, 15):
            assert u[r, t].item() == pytest.approx(_ref_uniform(seed, step, t), abs=0)
    big = counter_uniforms(torch.arange(64), torch.zeros(64, dtype=torch.int64), 1000)
    assert big.min().item() > 0.0 and big.max().item() < 1.0
    assert abs(big.mean().item() - 0.5) < 0.005
    hist = torch.histc(big, bins=10, min=0.0, max=1.0)
    assert (hist - 6400).abs().max().item() < 400  # 64000 draws, 10 bins
