"""Hand-written response schemas of the JSON answers no Struct describes (SGLang's loosely
typed admin and info endpoints), for the OpenAPI document (server/openapi.py)."""

from __future__ import annotations

OBJECT = {"type": "object"}
SUCCESS = {
    "type": "object",
    "properties": {"success": {"type": "boolean"}, "message": {"type": "string"}},
    "required": ["success"],
}
PROFILE = {
    "type": "object",
    "properties": {"success": {"type": "boolean"}, "message": {"type": "string"}, "trace": {"type": "string"}},
    "required": ["success", "trace"],
}
FLIGHT_DUMP = {
    "type": "object",
    "properties": {
        "success": {"type": "boolean"},
        "path": {"type": "string"},
        "size": {"type": "integer"},
        "recorded": {"type": "integer"},
        "dropped": {"type": "integer"},
        "last_dump": {"type": ["string", "null"]},
    },
    "required": ["success", "path"],
}
MODEL_INFO = {
    "type": "object",
    "properties": {
        "model_path": {"type": "string"},
        "tokenizer_path": {"type": "string"},
        "served_model_name": {"type": "string"},
        "is_generation": {"type": "boolean"},
        "architecture": {"type": "string"},
        "context_length": {"type": "integer"},
        "vocab_size": {"type": "integer"},
        "dtype": {"type": "string"},
        "device": {"type": "string"},
        "weight_version": {"type": "string"},
    },
    "required": ["model_path", "served_model_name", "context_length", "vocab_size"],
}
SERVER_INFO = {
    "type": "object",
    "properties": {
        "version": {"type": "string"},
        "inflight_generations": {"type": "integer"},
        "internal_states": {"type": "array", "items": OBJECT},
    },
    "required": ["version", "internal_states"],
}
WEIGHTS_UPDATED = {
    "type": "object",
    "properties": {
        "success": {"type": "boolean"},
        "message": {"type": "string"},
        "weight_version": {"type": "string"},
    },
    "required": ["success", "weight_version"],
}
