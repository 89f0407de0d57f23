"""Argument checks: one rule per kind of argument, used by every public entry point.

Each check raises `ArgumentError` (or the `error` class given, e.g. `ConfigError` for a config
field) with the message ``name=value is invalid: must be <allowed range>``, before the caller
changes any state. Integers never accept `bool` (a bool is an int in Python, but a level or a
token written as `True` is a caller bug).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sized
from typing import Any, NoReturn

from kvpool.errors import ArgumentError


def fail(
    name: str, value: object, allowed: str, error: type[ArgumentError] = ArgumentError
) -> NoReturn:
    raise error(f"{name}={value!r} is invalid: must be {allowed}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_int(
    name: str,
    value: object,
    low: int | None = None,
    high: int | None = None,
    error: type[ArgumentError] = ArgumentError,
) -> int:
    """`value` as an int in [low, high] (either bound may be None: unbounded)."""
    if is_int(value) and (low is None or value >= low) and (high is None or value <= high):  # type: ignore[operator]
        return value  # type: ignore[return-value]
    if low is not None and high is not None:
        allowed = (
            f"an integer in [{low}, {high}]"
            if low <= high
            else "an integer in an empty range (no value is valid now)"
        )
    elif low is not None:
        allowed = f"an integer >= {low}"
    elif high is not None:
        allowed = f"an integer <= {high}"
    else:
        allowed = "an integer"
    fail(name, value, allowed, error)


def check_index(
    name: str, value: object, count: int, error: type[ArgumentError] = ArgumentError
) -> int:
    """`value` as an index in [0, count)."""
    if is_int(value) and 0 <= value < count:  # type: ignore[operator]
        return value  # type: ignore[return-value]
    fail(name, value, f"an integer in [0, {count})", error)


def check_real(
    name: str,
    value: object,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    error: type[ArgumentError] = ArgumentError,
) -> float:
    """`value` as a finite (unless `high` is inf and not open) real in the given interval."""
    if is_real(value):
        number = float(value)  # type: ignore[arg-type]
        above = number > low if low_open else number >= low
        below = number < high if high_open else number <= high
        if not math.isnan(number) and math.isfinite(number) and above and below:
            return number
    left, right = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
    shown_high = "inf" if high == math.inf else f"{high:g}"
    fail(name, value, f"a finite number in {left}{low:g}, {shown_high}{right}", error)


def check_bool(name: str, value: object, error: type[ArgumentError] = ArgumentError) -> bool:
    if isinstance(value, bool):
        return value
    fail(name, value, "True or False", error)


def check_callable(name: str, value: object) -> None:
    if value is not None and not callable(value):
        fail(name, value, "callable or None")


def check_sequence(
    name: str,
    value: object,
    allowed: str = "a sequence (a list or tuple)",
    error: type[ArgumentError] = ArgumentError,
) -> list[Any]:
    """`value` as a list: a list, tuple, range, array or other sized iterable, but not a
    string or a mapping (whose items are characters or keys, never what was meant)."""
    if isinstance(value, list):
        return value
    if (
        isinstance(value, str | bytes | bytearray | Mapping)
        or not isinstance(value, Iterable)
        or not isinstance(value, Sized)
    ):
        fail(name, value, allowed, error)
    return list(value)


def token_list(name: str, tokens: object) -> list[Any]:
    """A request's tokens as a list (each token is checked when the tokens are encoded)."""
    return check_sequence(
        name, tokens, "a sequence of tokens (ints in [0, 2**31) or 32-byte digests)"
    )


__all__ = [
    "check_bool",
    "check_callable",
    "check_index",
    "check_int",
    "check_real",
    "check_sequence",
    "fail",
    "is_int",
    "is_real",
    "token_list",
]
