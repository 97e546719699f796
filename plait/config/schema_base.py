"""Shared pieces of the config schema: ``AUTO``, :class:`ConfigError`, the ``_auto`` and ``bounded`` field
helpers and :func:`check_number`, the range check every number of a config passes.

Kept apart (and free of plait imports) so that ``schema``, ``schema_optim`` and ``schema_zero`` can all use
them without importing one another; import them from :mod:`plait.config.schema` or :mod:`plait.config`.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

AUTO = "auto"
#: integers of a config must fit in 64 bits (torch's seeds, sizes and step counters do)
INT_LIMIT = 2**63


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


@dataclass(frozen=True)
class Bounds:
    """The allowed range of a numeric field: ``lo``/``hi`` inclusive unless ``lo_open``/``hi_open``; None leaves
    that side open."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v: float) -> bool:
        """Whether ``v`` lies in the range."""
        below = self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)
        above = self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi)
        return not (below or above)

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return "" if self.hi is None else f"{'<' if self.hi_open else '<='} {self.hi:g}"


def bounded(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    auto: bool = False,
    aliases: tuple = (),
) -> Any:
    """A numeric field with its allowed range (``ge``/``gt`` below, ``le``/``lt`` above; a tuple's range holds
    for each element). The config builder checks it with :func:`check_number` once "auto" is filled in."""
    meta: dict = {
        "bounds": Bounds(
            ge if gt is None else gt, le if lt is None else lt, gt is not None, lt is not None
        )
    }
    if auto:
        meta["auto"] = True
    if aliases:
        meta["aliases"] = aliases
    return field(default=default, metadata=meta)


_COUNT = {2: "two", 3: "three"}


def check_number(path: str, value: Any, bounds: Bounds | None = None) -> None:
    """Check one config value: every number finite, every integer within 64 bits, each within ``bounds``; a
    tuple or list element by element; other values (strings, booleans, None) pass.

    Raises:
        ConfigError: ``'<path> = <value> is out of range: it must be <range>'``.
    """
    where = f" {bounds}" if bounds is not None and str(bounds) else ""
    if isinstance(value, (tuple, list)):
        if not all(_fits(v, bounds) for v in value):
            count = _COUNT.get(len(value), len(value))
            raise ConfigError(
                f"{path} = {list(value)!r} is out of range: it must be "
                + (f"{count} numbers{where}" if where else f"{count} finite numbers")
            )
    elif not _fits(value, bounds):
        if isinstance(value, float):
            what = f"a finite number{where}"
        elif -INT_LIMIT <= value < INT_LIMIT:
            what = f"an integer{where}"
        else:
            what, value = (
                f"an integer{where} of 64 bits (|value| < 2**63)",
                float(value),
            )  # shown as 1e+30
        raise ConfigError(f"{path} = {value!r} is out of range: it must be {what}")


def _fits(value: Any, bounds: Bounds | None) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if isinstance(value, int) and not -INT_LIMIT <= value < INT_LIMIT:
        return False
    return bounds is None or bounds.holds(value)
