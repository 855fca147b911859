"""Sampling: per-request parameters, their batched device form, and the sampler."""

from engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatchInfo,
    apply_penalties,
    counter_uniforms,
)
from engine.sampling.sampling_params import SAMPLING_EPS, TOP_K_DISABLED, SamplingParams

__all__ = [
    "SAMPLING_EPS",
    "TOP_K_DISABLED",
    "Sampler",
    "SamplerOutput",
    "SamplingBatchInfo",
    "SamplingParams",
    "apply_penalties",
    "counter_uniforms",
]
