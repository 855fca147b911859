"""An SGLang-style LLM serving engine built from asyncio actors.

    from engine import Engine, SamplingParams
    async with Engine(model="smollm2-135m") as engine:
        result = await engine.generate("Hello", SamplingParams(max_new_tokens=16))
"""

from engine.engine import Engine, GenerateResult
from engine.sampling import SamplingParams

__all__ = ["Engine", "GenerateResult", "SamplingParams"]
