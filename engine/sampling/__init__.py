"""Sampling: per-request parameters, their batched device form, and the sampler."""

from engine.sampling.counter_rng import counter_uniforms
from engine.sampling.logit_bias import LogitBias, apply_logit_bias
from engine.sampling.sampler import Sampler, SamplerOutput, SamplingBatchInfo, apply_penalties, greedy_ids
from engine.sampling.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    SAMPLING_EPS,
    TOP_K_DISABLED,
    SamplingParams,
)

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "SAMPLING_EPS",
    "TOP_K_DISABLED",
    "LogitBias",
    "Sampler",
    "SamplerOutput",
    "SamplingBatchInfo",
    "SamplingParams",
    "apply_logit_bias",
    "apply_penalties",
    "counter_uniforms",
    "greedy_ids",
]
