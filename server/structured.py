"""Structured output on the OpenAI endpoints: `response_format` and SGLang's `regex` / `ebnf`
extension fields, mapped onto the engine's grammar parameters (SamplingParams.json_schema /
regex / ebnf, compiled by xgrammar).

- `{"type": "text"}` (or nothing): free text.
- `{"type": "json_object"}`: OpenAI's JSON mode, any JSON object (`{"type": "object"}`).
- `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`: output
  valid against `schema`; without a schema, any JSON object. `strict` is accepted and has no
  effect: the output always follows the schema (what OpenAI's strict mode promises).

At most one constraint per request: response_format (json) or regex or ebnf, a 400 otherwise.
Errors name OpenAI's fields (`response_format.json_schema.schema`), not the engine's.
"""

from __future__ import annotations

import json
from typing import Any

from server.errors import ApiError

ANY_JSON_OBJECT = '{"type": "object"}'
# The engine's grammar parameter -> the field a client of the OpenAI API sent.
PARAM_NAMES = {"json_schema": "response_format", "regex": "regex", "ebnf": "ebnf"}


def grammar_fields(response_format: dict[str, Any] | None, regex: str | None, ebnf: str | None) -> dict[str, str]:
    """SamplingParams keyword arguments (json_schema / regex / ebnf) for an OpenAI request."""
    out: dict[str, str] = {}
    schema = _response_format_schema(response_format)
    if schema is not None:
        out["json_schema"] = schema
    if regex is not None:
        out["regex"] = regex
    if ebnf is not None:
        out["ebnf"] = ebnf
    if len(out) > 1:
        names = [PARAM_NAMES[k] for k in out]
        raise ApiError(
            400, f"give at most one of response_format (json), regex and ebnf; got {', '.join(names)}", param=names[1]
        )
    return out


def schema_param(param: str | None, response_format: dict[str, Any] | None) -> str | None:
    """The OpenAI field an engine error about `param` is about."""
    if param != "json_schema":
        return param
    if response_format and response_format.get("type") == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format"


def _response_format_schema(rf: dict[str, Any] | None) -> str | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ApiError(400, "response_format must be an object", param="response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind != "json_schema":
        raise ApiError(
            400,
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format.type",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(
            400, "response_format.json_schema must be an object with a 'schema'", param="response_format.json_schema"
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise ApiError(
            400, "response_format.json_schema.name must be a string", param="response_format.json_schema.name"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(
            400, "response_format.json_schema.strict must be a boolean", param="response_format.json_schema.strict"
        )
    schema = spec.get("schema")
    if schema is None:
        return ANY_JSON_OBJECT
    if not isinstance(schema, (dict, bool)):
        raise ApiError(
            400,
            "response_format.json_schema.schema must be a JSON schema object",
            param="response_format.json_schema.schema",
        )
    return json.dumps(schema)


# The note an OpenAI choice carries (as an extra field, `structured_output_warning`, which the
# openai client keeps in `choice.model_extra`) when a JSON-constrained generation stopped on
# max_tokens inside its JSON: finish_reason "length" alone does not tell a client that the content
# will not parse, nor what to change.
INCOMPLETE_JSON_WARNING = (
    "max_tokens was reached inside the JSON: the content is incomplete and will not parse; raise "
    "max_tokens, or bound the schema (maxLength, maxItems, maximum) so the JSON ends sooner"
)


def incomplete_json_warning(response_format: dict[str, Any] | None, finish_reason: str | None, text: str) -> str | None:
    """INCOMPLETE_JSON_WARNING for a choice that stopped on length inside JSON it was constrained
    to (response_format json_object / json_schema); None otherwise (a complete JSON value that
    merely ended on the last allowed token included)."""
    if finish_reason != "length" or not isinstance(response_format, dict):
        return None
    if response_format.get("type") not in ("json_object", "json_schema"):
        return None
    try:
        json.loads(text)
    except ValueError:
        return INCOMPLETE_JSON_WARNING
    return None
