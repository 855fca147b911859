"""The model's tokenizer over HTTP: POST /tokenize, POST /detokenize (and their /v1/ spellings,
which SGLang serves too) and GET /tokenizer_info.

Shapes are vLLM's, so that clients written against it work unchanged; lm-evaluation-harness's
`RemoteTokenizer` (`tokenizer_backend=remote`) is one: it reads the special tokens and the chat
template from /tokenizer_info, encodes with `{"prompt", "add_special_tokens": false}` and
decodes with `{"tokens"}`, reading `prompt` back. SGLang's batch forms (a list of prompts, a
list of id lists) and its `text` answer field are accepted and given as well.

/tokenize renders chat `messages` exactly as /v1/chat/completions does (the same template, the
same reserved template kwargs), so its `count` is the `prompt_tokens` that request would report
(without `tools`, which are not rendered here).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from server.errors import ApiError
from server.openai_chat import RESERVED_TEMPLATE_KWARGS, chat_messages
from server.protocol_tokens import (
    AddedTokenInfo,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from server.request_body import read_json
from server.state import STATE

# Text longer than this is tokenized in a worker thread: a prompt of megabytes takes the fast
# tokenizer a noticeable time, and the event loop serves every other request meanwhile.
THREAD_ABOVE_CHARS = 32_768
THREAD_ABOVE_IDS = 8_192  # the same for /detokenize


def _render_chat(tokenizer: Any, req: TokenizeRequest) -> str:
    assert req.messages is not None
    if req.add_generation_prompt and req.continue_final_message:
        # vLLM refuses the pair too: a new assistant turn cannot also continue the last one.
        raise ApiError(
            400, "add_generation_prompt and continue_final_message cannot both be true", param="continue_final_message"
        )
    kwargs = dict(req.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ApiError(400, f"chat_template_kwargs cannot set {key!r}", param="chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(
            chat_messages(req.messages),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except ApiError:
        raise
    except Exception as e:  # a template error (a missing variable, a bad role order) is the caller's input
        raise ApiError(400, f"cannot apply the chat template: {type(e).__name__}: {e}", param="messages") from e


async def _encode(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    def run() -> list[list[int]]:
        return [list(tokenizer.encode(t, add_special_tokens=add_special_tokens)) for t in texts]

    if sum(len(t) for t in texts) > THREAD_ABOVE_CHARS:
        return await asyncio.to_thread(run)
    return run()


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, TokenizeRequest)
    tokenizer = state.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        texts, batch = [_render_chat(tokenizer, req)], False
        add_special = bool(req.add_special_tokens)  # None -> false for chat
    else:
        batch = isinstance(req.prompt, list)
        texts = list(req.prompt) if isinstance(req.prompt, list) else [req.prompt]
        add_special = req.add_special_tokens is not False  # None -> true for a prompt
    ids = await _encode(tokenizer, texts, add_special)
    strs = [tokenizer.convert_ids_to_tokens(x) for x in ids] if req.return_token_strs else None
    out = TokenizeResponse(
        count=[len(x) for x in ids] if batch else len(ids[0]),
        max_model_len=state.engine.model_info.context_len,
        tokens=list(ids) if batch else list(ids[0]),
        token_strs=(list(strs) if batch else list(strs[0])) if strs is not None else None,
    )
    return web.json_response(body=msgspec.json.encode(out))


def _check_ids(ids: list[int], vocab: int, param: str) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise ApiError(400, f"token id {t} is out of the vocabulary [0, {vocab})", param=f"{param}[{i}]")


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, DetokenizeRequest)
    vocab = state.engine.model_info.vocab_size
    batch = bool(req.tokens) and all(isinstance(x, list) for x in req.tokens)
    if batch:
        seqs: list[list[int]] = [x for x in req.tokens if isinstance(x, list)]
        for k, seq in enumerate(seqs):
            _check_ids(seq, vocab, f"tokens[{k}]")
    else:
        if not all(isinstance(x, int) for x in req.tokens):
            raise ApiError(400, "tokens must be a list of token ids or a list of such lists", param="tokens")
        seqs = [[x for x in req.tokens if isinstance(x, int)]]
        _check_ids(seqs[0], vocab, "tokens")

    def run() -> list[str]:
        return [state.engine.detokenize(seq, skip_special_tokens=req.skip_special_tokens) for seq in seqs]

    texts = await asyncio.to_thread(run) if sum(map(len, seqs)) > THREAD_ABOVE_IDS else run()
    text: str | list[str] = texts if batch else texts[0]
    return web.json_response(body=msgspec.json.encode(DetokenizeResponse(prompt=text, text=text)))


def _token(tokenizer: Any, name: str) -> tuple[str | None, int | None]:
    """A special token's text and id (both None when the tokenizer has none)."""
    value = getattr(tokenizer, name, None)
    if not isinstance(value, str):
        return None, None
    token_id = getattr(tokenizer, f"{name}_id", None)
    return value, token_id if isinstance(token_id, int) else None


def _opt(value: Any, type_: type) -> Any:
    return value if isinstance(value, type_) else None


def tokenizer_info(tokenizer: Any, name_or_path: str, vocab_size: int, context_len: int) -> TokenizerInfoResponse:
    """The tokenizer as vLLM's /tokenizer_info describes it (JSON-safe fields only: the
    tokenizer's raw init kwargs hold objects and file paths of this machine)."""
    kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    added: dict[str, AddedTokenInfo] = {}
    for token_id, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        added[str(token_id)] = AddedTokenInfo(
            content=str(getattr(tok, "content", tok)),
            special=bool(getattr(tok, "special", False)),
            single_word=bool(getattr(tok, "single_word", False)),
            lstrip=bool(getattr(tok, "lstrip", False)),
            rstrip=bool(getattr(tok, "rstrip", False)),
            normalized=bool(getattr(tok, "normalized", False)),
        )
    eos, eos_id = _token(tokenizer, "eos_token")
    bos, bos_id = _token(tokenizer, "bos_token")
    pad, pad_id = _token(tokenizer, "pad_token")
    unk, unk_id = _token(tokenizer, "unk_token")
    return TokenizerInfoResponse(
        tokenizer_class=type(tokenizer).__name__,
        name_or_path=name_or_path,
        vocab_size=vocab_size,
        model_max_length=context_len,
        chat_template=_opt(getattr(tokenizer, "chat_template", None), str),
        eos_token=eos,
        eos_token_id=eos_id,
        bos_token=bos,
        bos_token_id=bos_id,
        pad_token=pad,
        pad_token_id=pad_id,
        unk_token=unk,
        unk_token_id=unk_id,
        add_bos_token=_opt(getattr(tokenizer, "add_bos_token", kwargs.get("add_bos_token")), bool),
        add_eos_token=_opt(getattr(tokenizer, "add_eos_token", kwargs.get("add_eos_token")), bool),
        clean_up_tokenization_spaces=_opt(getattr(tokenizer, "clean_up_tokenization_spaces", None), bool),
        padding_side=_opt(getattr(tokenizer, "padding_side", None), str),
        truncation_side=_opt(getattr(tokenizer, "truncation_side", None), str),
        added_tokens_decoder=added,
    )


async def get_tokenizer_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info = state.engine.model_info
    body = tokenizer_info(state.engine.tokenizer, state.config.model_path, info.vocab_size, info.context_len)
    return web.json_response(body=msgspec.json.encode(body))


def add_routes(app: web.Application) -> None:
    r = app.router
    for prefix in ("", "/v1"):
        r.add_post(f"{prefix}/tokenize", tokenize)
        r.add_post(f"{prefix}/detokenize", detokenize)
    r.add_get("/tokenizer_info", get_tokenizer_info)


__all__ = ["add_routes", "tokenizer_info"]
