"""Request and response bodies of the tokenizer and embeddings endpoints, as msgspec Structs:
/tokenize, /detokenize and /tokenizer_info (server/tokenizer_api.py), /v1/embeddings and
/encode (server/embeddings_api.py).

The conventions are `server/protocol.py`'s: requests decode strictly but ignore unknown fields,
field names and defaults follow vLLM's, SGLang's or OpenAI's endpoint of the same name, and one
array type per union (`list[int | list[int]]` for "ids or a batch of id lists"; handlers check
the shape).
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from server.protocol import ChatMessage

# ---- tokenizer endpoints (server/tokenizer_api.py) -------------------------------------------


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
