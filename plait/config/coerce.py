"""JSON values of a ds_config as the Python types of the schema's fields (:mod:`plait.config.schema`), with
the type in words when a value does not fit."""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import is_dataclass
from typing import Any, Literal, Union

from plait.config.schema import ConfigError

_UNIONS = (Union, types.UnionType)


def strip_optional(hint: Any) -> Any:
    """``X`` for ``Optional[X]`` (``X | None``); any other hint as it is."""
    if typing.get_origin(hint) in _UNIONS:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def describe(hint: Any) -> str:
    """The type hint ``hint`` in words, for error messages ("an integer", "one of 'a', 'b'")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return "a boolean (true/false)"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list of {len(args)} numbers"
    if origin is list:
        return "a list of strings" if args == (str,) else "a list of integers"
    if is_dataclass(hint):
        return "a JSON object (a section)"
    if origin in _UNIONS:
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    return getattr(hint, "__name__", str(hint))


class _Mismatch(Exception):
    pass


def coerce(value: Any, hint: Any, path: str) -> Any:
    """``value`` (parsed JSON) as the type ``hint`` (ints from integral floats like ``2e8``, tuples from lists).

    Raises:
        ConfigError: ``value`` does not fit ``hint``; names the key ``path``, the type in words and, for a
            misspelled choice, the closest one.
    """
    try:
        return _convert(value, hint)
    except _Mismatch:
        extra = ""
        if typing.get_origin(strip_optional(hint)) is Literal and isinstance(value, str):
            close = difflib.get_close_matches(
                value, [str(a) for a in typing.get_args(strip_optional(hint))], 1
            )
            extra = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"'{path}' must be {describe(hint)}, got {type(value).__name__} {value!r}{extra}"
        ) from None


def _convert(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)  # DeepSpeed configs write bucket sizes as 2e8
        raise _Mismatch
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise _Mismatch
    if origin in _UNIONS:
        for arg in args:
            try:
                return _convert(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is tuple:
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_convert(v, a) for v, a in zip(value, args))
        raise _Mismatch
    if hint is dict or origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise _Mismatch
    if origin is list:
        if isinstance(value, list):
            return [_convert(v, args[0]) for v in value]
        raise _Mismatch
    raise TypeError(f"plait.config: no reader for type {hint!r}")  # a schema bug, not a user error
