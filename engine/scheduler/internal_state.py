"""The scheduler's run-time knobs (`Engine.set_internal_state`, `/set_internal_state`): which
exist and what values they take. Checked by the caller before anything is sent, so a bad one
is an InvalidRequestError naming it and changes nothing."""

from __future__ import annotations

from engine.errors import InvalidRequestError


def check_internal_state(state: dict) -> dict[str, int | float]:
    """The settable scheduler knobs in `state`, validated: InvalidRequestError names a bad one."""
    out: dict[str, int | float] = {}
    for key, value in state.items():
        if key == "max_running_requests":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"max_running_requests must be an integer >= 1, got {value!r}", key)
        elif key == "new_token_ratio":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise InvalidRequestError(f"new_token_ratio must be a number in [0, 1], got {value!r}", key)
            value = float(value)
        else:
            settable = ["max_running_requests", "new_token_ratio"]
            raise InvalidRequestError(f"cannot set {key!r}; settable: {settable}", key)
        out[key] = value
    return out
