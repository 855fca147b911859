"""Structured output: grammars (JSON schema, JSON object, regex, EBNF) compiled by xgrammar,
one matcher per request, and the batch's token masks.

It sits at the sampling level of the layering: it imports only `engine.errors`, torch and
xgrammar, never the scheduler, the actors or the model side. The scheduler owns the
`GrammarBackend` (one per model) and each request's `GrammarState`.
"""

from engine.constrained.backend import GRAMMAR_KINDS, CompiledGrammar, GrammarBackend, GrammarCacheInfo, GrammarKind
from engine.constrained.bitmask import allocate_bitmask, apply_bitmask, fill_bitmasks
from engine.constrained.json_bounds import JsonBounds
from engine.constrained.state import GrammarState

__all__ = [
    "GRAMMAR_KINDS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCacheInfo",
    "GrammarKind",
    "GrammarState",
    "JsonBounds",
    "allocate_bitmask",
    "apply_bitmask",
    "fill_bitmasks",
]
