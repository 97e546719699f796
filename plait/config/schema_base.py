"""Shared pieces of the config schema: ``AUTO``, :class:`ConfigError` and the ``_auto`` field helper.

Kept apart (and free of plait imports) so that ``schema``, ``schema_optim`` and ``schema_zero`` can all use
them without importing one another; import them from :mod:`plait.config.schema` or :mod:`plait.config`.
"""
from __future__ import annotations

import types
import typing
from dataclasses import field
from typing import Any, Literal

AUTO = "auto"


class ConfigError(ValueError):
    """A configuration that plait cannot use; the message names the key, the numbers and the fix."""


def _auto(default: Any = None, **meta: Any) -> Any:
    """A field that may be written as ``"auto"`` in JSON (a placeholder :mod:`plait.config.resolve` fills)."""
    return field(default=default, metadata={"auto": True, **meta})


def takes_auto(hint: Any) -> bool:
    """True when a field's type admits ``Literal["auto"]``: there "auto" is a value of its own (e.g.
    ``offload_optimizer.device_step_fraction``), kept as written; nothing resolves or fills it."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(takes_auto(a) for a in typing.get_args(hint))
    return typing.get_origin(hint) is Literal and AUTO in typing.get_args(hint)
