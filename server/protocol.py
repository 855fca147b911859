"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs:
/v1/completions, /v1/chat/completions and /v1/models (the SGLang-native and WebSocket bodies are
in `server/protocol_native.py`, the tokenizer and embeddings ones in `server/protocol_tokens.py`;
all three follow the conventions below).

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
    # "arguments"}}), and a tool result's reference to its call (server/tool_parsers/).
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
    # SGLang's: extra variables for the model's chat template (Qwen3's `enable_thinking`, ...),
    # and, on a server with --reasoning-parser, whether to split the reasoning out of `content`
    # into `reasoning_content` (server/reasoning.py).
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True


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
    # server/structured.py: a JSON-constrained choice that stopped on max_tokens inside its JSON
    # (absent otherwise; the openai client keeps it in `choice.model_extra`)
    structured_output_warning: str | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None
    # SGLang's: {"weight_version": the weights that produced the first choice} (RL rollouts tell
    # which policy sampled a response); non-streaming responses only, as SGLang's
    metadata: dict[str, str] | None = None


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
    # Left out (UNSET) without --reasoning-parser, so such a server answers as before; with one it
    # is always there, null when there was no reasoning or the request did not separate it.
    reasoning_content: str | msgspec.UnsetType | None = msgspec.UNSET


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    # server/structured.py: a JSON-constrained choice that stopped on max_tokens inside its JSON
    # (absent otherwise; the openai client keeps it in `choice.model_extra`)
    structured_output_warning: str | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    # SGLang's: {"weight_version": the weights that produced the first choice} (RL rollouts tell
    # which policy sampled a response); non-streaming responses only, as SGLang's
    metadata: dict[str, str] | None = None


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
    reasoning_content: str | None = None  # a piece of the reasoning (server/reasoning.py)
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    # server/structured.py: a JSON-constrained choice that stopped on max_tokens inside its JSON
    # (absent otherwise; the openai client keeps it in `choice.model_extra`)
    structured_output_warning: str | msgspec.UnsetType = msgspec.UNSET


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
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"
