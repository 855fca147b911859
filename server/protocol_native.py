"""Request and response bodies of the SGLang-native API, as msgspec Structs: /generate and
/abort_request (server/native_api.py), /start_profile (server/admin_api.py), /version and
/get_load, and the WebSocket messages of /ws (server/ws.py) with their JSON `encode`.

The conventions are `server/protocol.py`'s: requests decode strictly but ignore unknown fields
(unknown keys inside `sampling_params` are a 400 naming the key). The /ws messages are msgspec
tagged unions on `type`: a client sends `WsClientMessage` (`generate` or `cancel`), the server
answers `delta` and `error` frames.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

from engine import SamplingParams
from server.errors import ErrorInfo

# ---- native (SGLang) -------------------------------------------------------------------------


class GenerateRequest(Struct, kw_only=True):
    """POST /generate: `text` or `input_ids` (one prompt or a batch), SGLang's sampling params."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: SamplingParams | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prompt log-probs from this position on (-1: only the last prompt position, unscored), one
    # value for every prompt or one per prompt; the token texts ride along when asked.
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False
    # The LoRA adapter (its name) to run under, one for every prompt or one per prompt (SGLang's);
    # None: the base model
    lora_path: str | list[str | None] | None = None


class LoadLoRAAdapterRequest(Struct, kw_only=True):
    """POST /load_lora_adapter (SGLang's): a PEFT LoRA adapter folder, served as `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(Struct, kw_only=True):
    """POST /unload_lora_adapter (SGLang's); refused while a request uses it."""

    lora_name: str


class AbortRequest(Struct, kw_only=True):
    """A generation by rid, or every request (`abort_all`, SGLang's)."""

    rid: str = ""
    abort_all: bool = False


class UpdateWeightsFromDiskRequest(Struct, kw_only=True):
    """POST /update_weights_from_disk (SGLang's): a checkpoint of the served model with new values."""

    model_path: str
    load_format: Literal["auto", "safetensors", "gguf"] | None = None
    weight_version: str | None = None  # None: the number of updates applied so far
    abort_all_requests: bool = False  # else running requests end first, under the old weights
    flush_cache: bool = True


class InitWeightsUpdateGroupRequest(Struct, kw_only=True):
    """POST /init_weights_update_group (SGLang's): join a trainer's group (engine/distributed/weight_sync.py)."""

    master_address: str
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    rank_offset: Annotated[int, msgspec.Meta(ge=1)]
    world_size: Annotated[int, msgspec.Meta(ge=2)]
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"


class UpdateWeightsFromDistributedRequest(Struct, kw_only=True):
    """POST /update_weights_from_distributed (SGLang's): the tensors the trainer broadcasts, in order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[Annotated[int, msgspec.Meta(ge=0)]]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class WeightsGroupNameRequest(Struct, kw_only=True):
    """POST /destroy_weights_update_group."""

    group_name: str = "weight_update_group"


class MemoryTagsRequest(Struct, kw_only=True):
    """POST /release_memory_occupation, /resume_memory_occupation (optional body: both tags)."""

    tags: list[Literal["kv_cache", "weights"]] | None = None


class PauseGenerationRequest(Struct, kw_only=True):
    """POST /pause_generation (optional body): SGLang's modes (engine/actors/generation_control.py)."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ProfileRequest(Struct, kw_only=True):
    """POST /start_profile (optional body). Traces go to the server's --profile-dir: a client
    does not choose where the server writes files."""

    num_steps: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | None = None
    activities: list[Literal["CPU", "GPU"]] | None = None


class MetaInfo(Struct, omit_defaults=True):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    # SGLang's (log-prob, token id, text or None) triples; a prompt's first position has no log-prob
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    input_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    output_top_logprobs: list[list[tuple[float, int, str | None]]] | None = None
    # n-gram speculation (only when the request speculated): SGLang's spec_verify_ct, and the
    # drafts verified and accepted (engine.StreamDelta)
    spec_verify_ct: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    weight_version: str | None = None  # of the weights that produced the last token


class GenerateResponse(Struct, omit_defaults=True):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None


# ---- WebSocket (/ws) -------------------------------------------------------------------------


class WsGenerate(GenerateRequest, tag="generate", tag_field="type", kw_only=True):
    """Start a generation tagged with the client's `id` (unique among its running ones)."""

    id: str | int


class WsCancel(Struct, tag="cancel", tag_field="type", kw_only=True):
    id: str | int


WsClientMessage = WsGenerate | WsCancel


class WsDelta(Struct, omit_defaults=True, tag="delta", tag_field="type"):
    """One increment of generation `id`; the last one has `finish_reason` and `meta_info`."""

    id: str | int
    text: str
    token_ids: list[int]
    finish_reason: dict[str, Any] | None = None
    meta_info: MetaInfo | None = None
    index: int | None = None


class WsError(Struct, tag="error", tag_field="type"):
    id: str | int | None
    error: ErrorInfo


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


# ---- info endpoints (/version and /get_load) -------------------------------------------------


class VersionResponse(Struct):
    version: str


class LoadInfo(Struct):
    """One data-parallel rank's load, as SGLang's GET /get_load answers it (a list of these)."""

    dp_rank: int
    num_reqs: int  # running
    num_waiting_reqs: int
    num_tokens: int  # KV cache tokens held by requests (neither free nor evictable cache)
    max_total_num_tokens: int  # the KV pool's size
    token_usage: float  # num_tokens / max_total_num_tokens
