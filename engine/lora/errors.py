"""The typed errors of multi-LoRA serving.

They live here, not in engine/errors.py, only until the feature is wired in (that file is being
edited elsewhere now); both derive from `InvalidRequestError`, so the server already answers them
with a 400 and `param` names the input at fault (`lora_path`, `lora_paths`, `max_lora_rank`, ...).
"""

from __future__ import annotations

from engine.errors import InvalidRequestError


class LoRAError(InvalidRequestError):
    """An adapter cannot be used: a folder that is not a PEFT LoRA adapter, a feature we do not
    serve (DoRA, biases, `modules_to_save`), shapes that do not fit the base model, an unknown
    adapter name, a rank above `max_lora_rank`."""


class LoRAPoolFullError(LoRAError):
    """Every slot of the LoRA pool holds an adapter that running requests use: nothing can be
    evicted now. Transient, unlike its parent: a scheduler should keep the request waiting until a
    slot's requests finish rather than fail it."""
