"""Checks of user-given arguments, with one wording for all of them: ``<name> must be <what>, got <value>``."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number that is not a ``bool``."""
    return isinstance(value, Real) and not isinstance(value, bool)


def check_int(
    name: str, value: Any, minimum: int = 1, *, optional: bool = False, error: type[Exception] = ValueError
) -> Any:
    """``value`` if it is an integer >= ``minimum`` (or ``None`` with ``optional``); raise ``error`` otherwise."""
    if optional and value is None:
        return value
    if not is_int(value) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise error(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")
    return value


def check_number(
    name: str,
    value: Any,
    *,
    positive: bool = True,
    optional: bool = False,
    what: str | None = None,
    error: type[Exception] = ValueError,
) -> Any:
    """``value`` if it is a finite number, > 0 with ``positive`` (or ``None`` with ``optional``); raise otherwise
    (``what``: the message's description of what is accepted)."""
    if optional and value is None:
        return value
    if not is_number(value) or not math.isfinite(value) or (positive and value <= 0):
        what = what or ("a positive number" if positive else "a finite number") + (" or None" if optional else "")
        raise error(f"{name} must be {what}, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple, hint: str = "") -> Any:
    """``value`` if it is one of ``choices`` (by identity, or equality for strings: ``1`` is not ``True``)."""
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        raise ValueError(f"{name}={value!r} is not one of {choices}{hint}")
    return value


def check_bool(name: str, value: Any, error: type[Exception] = ValueError) -> bool:
    """``value`` if it is ``True`` or ``False``; raise ``error`` otherwise."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {value!r}")
    return value
