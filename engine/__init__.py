"""An SGLang-style LLM serving engine built from asyncio actors.

    from engine import Engine, SamplingParams
    async with Engine(model="smollm2-135m") as engine:
        result = await engine.generate("Hello", SamplingParams(max_new_tokens=16))

Public names: everything in `__all__` below. The server and the benchmarks use only these.
"""

from engine.api import (
    EmbeddingResult,
    GenerateResult,
    ModelInfo,
    Prompt,
    PromptLogprobs,
    RequestStream,
    ResultBuilder,
    StepRecord,
    StreamDelta,
)
from engine.child_process import die_with_parent, exit_when_orphaned
from engine.device.cpu_threads import default_torch_threads
from engine.distributed.launcher import run_worker_node
from engine.engine import Engine
from engine.errors import (
    ContextLengthExceededError,
    DistributedError,
    EngineError,
    EngineUnhealthyError,
    GrammarCompileTimeoutError,
    GrammarQueueFullError,
    InvalidRequestError,
    InvalidServerArgsError,
    ModelLoadError,
    RequestTooLargeError,
)
from engine.models.loader import ModelSource, resolve_model
from engine.recorder.replay import ReplayReport, replay
from engine.recorder.ring import load_dump
from engine.sampling import SamplingParams
from engine.scheduler.step import FORWARD_ANNOTATION, SyncScheduler
from engine.server_args import GRAMMAR_BACKENDS, ServerArgs, default_mem_fraction

__all__ = [
    "FORWARD_ANNOTATION",
    "GRAMMAR_BACKENDS",
    "ContextLengthExceededError",
    "DistributedError",
    "EmbeddingResult",
    "Engine",
    "EngineError",
    "EngineUnhealthyError",
    "GenerateResult",
    "GrammarCompileTimeoutError",
    "GrammarQueueFullError",
    "InvalidRequestError",
    "InvalidServerArgsError",
    "ModelInfo",
    "ModelLoadError",
    "ModelSource",
    "Prompt",
    "PromptLogprobs",
    "ReplayReport",
    "RequestStream",
    "RequestTooLargeError",
    "ResultBuilder",
    "SamplingParams",
    "ServerArgs",
    "StepRecord",
    "StreamDelta",
    "SyncScheduler",
    "default_mem_fraction",
    "default_torch_threads",
    "die_with_parent",
    "exit_when_orphaned",
    "load_dump",
    "replay",
    "resolve_model",
    "run_worker_node",
]
