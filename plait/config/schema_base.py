"""Shared pieces of the config schema: ``AUTO``, :class:`ConfigError` and the ``_auto`` field helper.

Kept apart (and free of plait imports) so that ``schema``, ``schema_optim`` and ``schema_zero`` can all use
them without importing one another; import them from :mod:`plait.config.schema` or :mod:`plait.config`.
"""
from __future__ import annotations

from dataclasses import field
from typing import Any

AUTO = "auto"


class ConfigError(ValueError):
    """A configuration that plait cannot use; the message names the key, the numbers and the fix."""


def _auto(default: Any = None, **meta: Any) -> Any:
    """A field that may be written as ``"auto"`` in JSON."""
    return field(default=default, metadata={"auto": True, **meta})
