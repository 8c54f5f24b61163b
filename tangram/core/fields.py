"""The checks every parser of outside input shares (config files, workloads, profile stores).

Each check raises ``error(field, reason)`` with the dotted path of the field,
``error`` being the :class:`~tangram.core.errors.FieldError` subclass of the
layer that parses (``ConfigError`` for cluster configs, ``WorkloadError`` for
workloads, ...): one set of checks, one wording, one error family.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from tangram.core.errors import FieldError


class Fields:
    """Field checks raising ``error``."""

    def __init__(self, error: type[FieldError]):
        self.error = error

    def mapping(self, v: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(v, Mapping):
            raise self.error(where, f"must be a mapping, got {type(v).__name__}")
        return v

    def list(self, v: Any, where: str) -> list:
        if not isinstance(v, (list, tuple)):
            raise self.error(where, f"must be a list, got {type(v).__name__}")
        return list(v)

    def known(self, m: Mapping[str, Any], where: str, keys: set[str]) -> None:
        """No key of ``m`` outside ``keys`` (``where`` ``<root>``: a top-level key is its own path)."""
        unknown = sorted(str(k) for k in m if k not in keys)
        if unknown:
            prefix = "" if where == "<root>" else f"{where}."
            raise self.error(f"{prefix}{unknown[0]}", f"unknown field (expected one of {sorted(keys)})")

    def boolean(self, v: Any, where: str) -> bool:
        if not isinstance(v, bool):
            raise self.error(where, f"must be true or false, got {v!r}")
        return v

    def string(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or not v:
            raise self.error(where, "is required" if v is None else f"must be a non-empty string, got {v!r}")
        return v

    def integer(self, v: Any, where: str, *, lo: int | None = None, hi: int | None = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(where, f"must be an integer, got {v!r}")
        if lo is not None and v < lo:
            raise self.error(where, f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise self.error(where, f"must be <= {hi}, got {v}")
        return v

    def number(self, v: Any, where: str, *, lo: float | None = None, above: float | None = None) -> float:
        """A finite number, ``>= lo`` and ``> above`` when given."""
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
            raise self.error(where, f"must be a finite number, got {v!r}")
        if lo is not None and v < lo:
            raise self.error(where, f"must be >= {lo:g}, got {v!r}")
        if above is not None and not v > above:
            raise self.error(where, f"must be > {above:g}, got {v!r}")
        return float(v)

    def positive(self, v: Any, where: str) -> float:
        """A positive finite number."""
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0) or math.isinf(v):
            raise self.error(where, f"must be a positive finite number, got {v!r}")
        return float(v)
