"""Request and response bodies, as msgspec Structs.

Requests decode strictly (a wrong type is a 400 naming the field, see `errors.decode`) but
ignore unknown fields, so clients that send newer OpenAI fields keep working. Field names and
defaults are OpenAI's; the SGLang/vLLM sampling extensions (`top_k`, `min_p`, `ignore_eos`, ...)
are accepted too. Responses keep OpenAI's explicit nulls (`logprobs: null`), which strict
clients expect.

msgspec allows one array type per union, hence `list[str | int | list[int]]` for OpenAI's
"string, array of strings, array of tokens, or array of token arrays"; handlers check the shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

from engine import SamplingParams
from server.errors import ErrorInfo

# ---- OpenAI requests -------------------------------------------------------------------------


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # OpenAI's shape: token ids are object keys, so strings; `openai_common.logit_bias_map` parses them
    # (a bad key is a 400 naming logit_bias) and the engine's verify() checks ids and values.
    logit_bias: Annotated[
        dict[str, float] | None,
        msgspec.Meta(
            description="Token id (a decimal string) -> bias in [-100, 100] added to that token's logit "
            "before penalties, temperature and top-k/top-p/min-p; at most 1024 entries. "
            "Log-probs stay those of the unbiased model."
        ),
    ] = None
    user: str | None = None
    # SGLang / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    # Structured output (server/structured.py): OpenAI's response_format, SGLang's regex / ebnf.
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = None  # OpenAI's default is 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class ImageUrlPart(Struct, tag="image_url", tag_field="type"):
    image_url: Any = None


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | ImageUrlPart] | None = None
    name: str | None = None
    # An earlier assistant turn's calls ({"id", "type": "function", "function": {"name",
    # "arguments"}}), and a tool result's reference to its call (server/tool_calls.py).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# ---- OpenAI responses ------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class FunctionCallDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(Struct, omit_defaults=True):
    """One streamed piece of call `index`: the first has id, type and the name; a call's
    `function.arguments` pieces concatenate to its arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None


class ModelCard(Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "asyncllm"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


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


class AbortRequest(Struct, kw_only=True):
    rid: str


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
    output_token_logprobs: list[tuple[float, int, None]] | None = None
    output_top_logprobs: list[list[tuple[float, int, None]]] | None = None
    # n-gram speculation (only when the request speculated): SGLang's spec_verify_ct, and the
    # drafts verified and accepted (engine.StreamDelta)
    spec_verify_ct: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None


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
