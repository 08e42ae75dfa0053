"""The value rules every config check shares: one of a list, a positive number."""

from __future__ import annotations

from collections.abc import Sequence


def choice(key: str, value: object, allowed: Sequence[str]) -> None:
    """`key`'s value is one of `allowed`, else one line listing them."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of: {', '.join(allowed)}")


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    """`key`'s value is > 0 (>= 0 with allow_zero), else one line."""
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
