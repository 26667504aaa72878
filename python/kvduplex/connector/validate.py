"""The one set of value checks for what comes from outside the engine: the connector's options
(`config.py`, an operator's JSON or command line) and a request's `kv_transfer_params`
(`params.py`, any HTTP client's). Each check takes the value and the key it came under, and
returns the value or raises `Invalid` naming the key. `from_text` accepts a number or a boolean
written as text (options given on a command line); params never do. Every check's work is
bounded by the value's own size. No vLLM here: `config.py` imports without it.
"""

from __future__ import annotations

import math
from typing import Any


class Invalid(ValueError):
    """A value that is not what its key needs; the message names the key."""


def boolean(value: Any, key: str, *, from_text: bool = False) -> bool:
    if isinstance(value, bool):
        return value
    if from_text and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise Invalid(f"{key} must be a boolean (true or false), got {_shown(value)}")


def integer(
    value: Any,
    key: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    from_text: bool = False,
) -> int:
    if from_text and isinstance(value, str) and 0 < len(value) <= 32:
        if value.strip().lstrip("-").isdigit():
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"{key} must be an integer, got {_shown(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "-inf" if minimum is None else minimum
        high = "inf" if maximum is None else maximum
        raise Invalid(f"{key}={value} is outside [{low}, {high}]")
    return value


def number(value: Any, key: str, *, from_text: bool = False) -> float:
    """A finite number (an integer or a float)."""
    if from_text and isinstance(value, str) and len(value) <= 64:
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Invalid(f"{key} must be a finite number, got {_shown(value)}")
    return float(value)


def text(value: Any, key: str, *, max_chars: int | None = None) -> str:
    """A non-empty string; with `max_chars`, also printable, at most that long and without
    surrounding whitespace (an identifier or a host name from a peer)."""
    if not isinstance(value, str) or not value:
        raise Invalid(f"{key} must be a non-empty string, got {_shown(value)}")
    if max_chars is not None and (
        len(value) > max_chars or not value.isprintable() or value.strip() != value
    ):
        raise Invalid(f"{key} must be at most {max_chars} printable characters")
    return value


def port(value: Any, key: str) -> int:
    """A TCP port, 1 to 65535."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise Invalid(f"{key} must hold ports in [1, 65535], got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """The value for a message, cut short (a peer's value may be large)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        return "a larger integer"
    if isinstance(value, str) and len(value) > 80:
        value = value[:77] + "..."
    return repr(value) if isinstance(value, (bool, int, float, str)) else type(value).__name__
