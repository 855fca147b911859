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
    # Prompt log-probs from this position on (-1: only the last prompt position, unscored), one
    # value for every prompt or one per prompt; the token texts ride along when asked.
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False


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


# ---- tokenizer and info endpoints (server/tokenizer_api.py, /version and /get_load) -------------


class TokenizeRequest(Struct, kw_only=True):
    """POST /tokenize (and /v1/tokenize): vLLM's completion and chat shapes in one body, plus
    SGLang's batch of prompts. Exactly one of `prompt` and `messages`."""

    model: str | None = None  # accepted and ignored, as everywhere (one model is served)
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's defaults, true for a prompt and false for messages (the chat template already
    # writes the special tokens it wants).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(Struct, omit_defaults=True):
    """vLLM's and SGLang's answer; for a batch of prompts `tokens`, `count` (and `token_strs`)
    are lists with one entry per prompt."""

    count: int | list[int]
    max_model_len: int
    tokens: list[int | list[int]]
    token_strs: list[str | list[str]] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    """POST /detokenize (and /v1/detokenize): token ids, or a batch of id lists (SGLang)."""

    model: str | None = None
    tokens: list[int | list[int]]
    skip_special_tokens: bool = False  # vLLM's behaviour: the text of every id, as HF's decode


class DetokenizeResponse(Struct):
    """`prompt` is vLLM's name (what lm-eval's remote tokenizer reads), `text` SGLang's."""

    prompt: str | list[str]
    text: str | list[str]


class AddedTokenInfo(Struct):
    content: str
    special: bool
    single_word: bool = False
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False


class TokenizerInfoResponse(Struct):
    """GET /tokenizer_info (vLLM's): what a client needs to tokenize like the server, e.g.
    lm-evaluation-harness's RemoteTokenizer (special tokens, chat template)."""

    tokenizer_class: str
    name_or_path: str
    vocab_size: int
    model_max_length: int  # the served context length (the tokenizer's own is often a sentinel)
    chat_template: str | None
    eos_token: str | None
    eos_token_id: int | None
    bos_token: str | None
    bos_token_id: int | None
    pad_token: str | None
    pad_token_id: int | None
    unk_token: str | None
    unk_token_id: int | None
    add_bos_token: bool | None
    add_eos_token: bool | None
    clean_up_tokenization_spaces: bool | None
    padding_side: str | None
    truncation_side: str | None
    added_tokens_decoder: dict[str, AddedTokenInfo]


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


# ---- embeddings (server/embeddings_api.py) ---------------------------------------------------


class EmbeddingRequest(Struct, kw_only=True):
    """POST /v1/embeddings (OpenAI's): a string, a list of strings, a list of token ids or a list
    of token-id lists (the handler checks the shape)."""

    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own width: no truncation (Matryoshka) here
    user: str | None = None


class EmbeddingData(Struct):
    index: int
    embedding: list[float] | str  # base64: the float32 little-endian bytes, as OpenAI encodes them
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class EncodeRequest(Struct, kw_only=True):
    """POST /encode (SGLang's): `text` or `input_ids`, one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    rid: str | None = None


class EncodeMetaInfo(Struct):
    id: str
    prompt_tokens: int
    cached_tokens: int
    e2e_latency: float


class EncodeResponse(Struct):
    embedding: list[float]
    meta_info: EncodeMetaInfo
