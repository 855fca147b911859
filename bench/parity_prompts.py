"""The prompt set of the greedy-parity checks (tests/test_greedy_default_model.py on CPU,
bench/gpu_parity.py on CUDA): raw text and chat-templated, a few tokens to several hundred."""

from __future__ import annotations

from typing import Any

_STORY = (
    "The lighthouse keeper had lived alone on the island for eleven years. Every evening he climbed the "
    "spiral staircase, polished the great lens, and lit the lamp that warned ships away from the rocks. "
    "He kept a logbook of every vessel that passed, the weather, the colour of the sea, and the birds "
    "that rested on the gallery rail. "
)
_CODE = (
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n"
)

RAW_PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "Once upon a time",
    _STORY * 4 + "One night, a storm",
    _CODE * 3 + "# Explain what merge_sorted does:\n",
    "Translate to French: Good morning, how are you?",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the boiling point of water?"}],
    [{"role": "user", "content": "Write a haiku about autumn."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three primes."}],
    [{"role": "user", "content": "Summarise this story:\n" + _STORY * 5}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
    [{"role": "user", "content": "Review this code:\n" + _CODE * 2}],
]


def parity_prompts(tokenizer: Any) -> list[list[int]]:
    """The twelve prompts as token ids: the raw ones encoded, the chat ones templated."""
    ids = [tokenizer.encode(p) for p in RAW_PROMPTS]
    ids += [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        for m in CHAT_PROMPTS
    ]
    return ids
