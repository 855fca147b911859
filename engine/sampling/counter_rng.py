"""Counter-based uniforms: the random numbers of seeded sampling as a pure function.

The uniform for (request seed, step, token id) is a hash of those three integers, computed in a
few vectorised int64 ops on whatever device the seeds live. A request therefore draws the same
numbers whichever batch it lands in, at whatever row, which a shared `torch.Generator` cannot
give. Kept apart from the sampler so each file stays one job.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _as_int64(value: int) -> int:
    """A 64-bit constant reinterpreted as a signed int64 (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64 constants (Steele, Lea & Flood, "Fast splittable pseudorandom number generators").
_GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)
_MIX_MUL_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_MUL_2 = _as_int64(0x94D049BB133111EB)


def _xor_shift_right_(z: Tensor, shift: int, scratch: Tensor) -> None:
    """z ^= z >>> shift, in place, as a *logical* shift.

    torch's `>>` on int64 is arithmetic (it copies the sign bit in), so the sign-extended top
    bits are masked off to get the unsigned shift the mixer is defined with.
    """
    torch.bitwise_right_shift(z, shift, out=scratch)
    scratch.bitwise_and_((1 << (64 - shift)) - 1)
    z.bitwise_xor_(scratch)


def mix64_(z: Tensor) -> Tensor:
    """splitmix64's finaliser, in place on an int64 tensor.

    It is a bijection on 64-bit words with full avalanche. int64 multiplication in torch wraps
    modulo 2**64, which is exactly the unsigned product's bit pattern, so signed storage is fine.
    """
    scratch = torch.empty_like(z)
    _xor_shift_right_(z, 30, scratch)
    z.mul_(_MIX_MUL_1)
    _xor_shift_right_(z, 27, scratch)
    z.mul_(_MIX_MUL_2)
    _xor_shift_right_(z, 31, scratch)
    return z


def counter_uniforms(seeds: Tensor, steps: Tensor, num_tokens: int) -> Tensor:
    """Uniforms in (0, 1), shape [S, num_tokens], float32: a pure function of (seed, step, token).

    Row key = mix(mix(seed) + step): whitening the seed first keeps nearby seeds' step ranges
    from overlapping. Each row is then a splitmix64 stream: token t gets mix(key + (t+1)*gamma).
    The top 23 bits become a float32 at the centre of its bucket: (k + 0.5) / 2**23 is exact
    in float32 (24-bit significand; 24 bits plus the half would round k = 2**24-1 up to 1.0),
    so 0 and 1 never occur and -log(u) is always finite and positive.
    """
    key = mix64_(seeds.to(torch.int64).clone())
    key.add_(steps.to(torch.int64))
    mix64_(key)
    stream = torch.arange(1, num_tokens + 1, dtype=torch.int64, device=seeds.device)
    stream.mul_(_GOLDEN_GAMMA)
    z = mix64_(key[:, None] + stream[None, :])
    z.bitwise_right_shift_(41).bitwise_and_((1 << 23) - 1)
    return z.to(torch.float32).add_(0.5).mul_(2.0**-23)
